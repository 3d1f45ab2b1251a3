"""The node's DNS proxy with real packets: a pod resolves through its steered queries, then connects.

The session node's pod a resolves names at a table DNS server in the outside namespace (ext);
its queries to port 53 are steered in BPF to the proxy (bpf_sk_assign), which answers from the
server and writes what it learned before releasing the answer. Pod a's egress allows only DNS
(to world, port 53) and, by its toFQDNs rule, TCP 8080 to names under example.test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import dns.message
import pytest

from services.datapath import dnsrouting
from services.datapath.datapath import Datapath
from services.datapath.dnsnames import NamePublisher, NameSource
from services.datapath.dnsproxy import DnsProxy, ProxyConfig, RefuseCode
from services.datapath.fqdncache import CacheLimits
from services.datapath.fqdnmaps import NameEndpoint
from services.datapath.types import (
    IDENTITY_WORLD,
    MIN_CIDR_IDENTITY,
    Direction,
    DnsRule,
    Enforcement,
    FqdnRule,
    L4Proto,
    NameRules,
    PolicyEntry,
    PolicyKey,
    is_local_identity,
)
from testkit.datapathnode import Node, drops
from testkit.dnsserver import DnsServer, Record, addresses, query
from testkit.traffic import DENY_TIMEOUT, Stream, tcp_exchange

pytestmark = [pytest.mark.root, pytest.mark.bcc]

T = TypeVar("T")
PORT = 8080
RULES = NameRules(
    fqdn=(FqdnRule("*.example.test", L4Proto.TCP, PORT),),
    dns=(DnsRule(0, L4Proto.ANY, 53, ("*.example.test",)),),
)
DNS_ALLOWED = [
    PolicyEntry(PolicyKey(Direction.EGRESS, IDENTITY_WORLD, L4Proto.UDP, 53)),
    PolicyEntry(PolicyKey(Direction.EGRESS, IDENTITY_WORLD, L4Proto.TCP, 53)),
]


class Loop:
    """An asyncio loop in a thread: the proxy and the DNS server run there while the test's
    blocking sockets run here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dns-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        async def wrapped() -> T:
            return fn(*args)

        return self.run(wrapped())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclasses.dataclass
class Clock:
    now: float

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class World:
    node: Node
    loop: Loop
    server: DnsServer
    clock: Clock
    port: int
    #: The same table served on ext's IPv6 address.
    server6: DnsServer

    @property
    def dns(self) -> str:
        return self.node.ext_in


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def world(node: Node) -> Iterator[World]:
    """One DNS server and the node's steering routes for the module."""
    dnsrouting.install()
    loop = Loop()
    server = DnsServer(node.ext.name, node.ext_in)
    loop.run(server.start())
    server6 = DnsServer(node.ext.name, node.ext_v6)
    server6.table = server.table
    loop.run(server6.start())
    try:
        yield World(node, loop, server, Clock(time.monotonic()), _free_port(), server6)
    finally:
        loop.run(server.stop())
        loop.run(server6.stop())
        loop.close()
        dnsrouting.remove()


def _clean(dp: Datapath, ep_ids: list[int]) -> None:
    """What the proxy wrote, removed (the session's other tests expect no learned entries)."""
    for key in dp.dns_steer_dump():
        dp.dns_steer_delete(*key)
    for ep_id in ep_ids:
        enforcement, entries = dp.dump_policy(ep_id)
        learned = [e for e in entries if is_local_identity(e.key.remote_identity)]
        dp.apply_policy(ep_id, enforcement, remove=learned)
    for prefix, ident in dp.ipcache_dump().items():
        if is_local_identity(ident):
            dp.ipcache_delete(prefix)


class Proxies:
    """Starts proxies on the world's loop with one state dir; stops them at the end."""

    def __init__(self, world: World, state_dir: Path) -> None:
        self.world = world
        self.state_dir = state_dir
        self.running: list[DnsProxy] = []

    def start(self, *others: NameEndpoint, **settings: Any) -> DnsProxy:
        w = self.world
        config = ProxyConfig(state_dir=str(self.state_dir), port=w.port, **settings)
        # As the datapath does: the endpoints with name rules published, their queries steered.
        a = w.node.a
        NamePublisher(str(self.state_dir), w.node.dp, w.port).publish(
            [NameEndpoint(a.ep_id, a.identity, (a.v4, a.v6), RULES), *others]
        )
        proxy = DnsProxy(config, w.node.dp, source=NameSource(str(self.state_dir)), clock=w.clock)
        w.loop.run(proxy.start())
        self.running.append(proxy)
        return proxy

    def stop(self, proxy: DnsProxy) -> None:
        self.world.loop.run(proxy.stop())
        self.running.remove(proxy)

    def close(self) -> None:
        for proxy in list(self.running):
            self.stop(proxy)


@pytest.fixture
def proxies(world: World, net: Node, tmp_path: Path) -> Iterator[Proxies]:
    net.dp.sync_policy(net.a.ep_id, Enforcement(egress=True), DNS_ALLOWED)
    world.server.table.clear()
    world.server.queries.clear()
    made = Proxies(world, tmp_path)
    try:
        yield made
    finally:
        made.close()
        _clean(net.dp, [p.ep_id for p in net.pods])


def test_first_connection_after_each_lookup(world: World, proxies: Proxies) -> None:
    """Every lookup's address is allowed before the answer arrives, UDP and TCP lookups alike;
    with one address per name, each answer evicts the last one (a fresh identity each time)."""
    node, a = world.node, world.node.a
    proxy = proxies.start(limits=CacheLimits(max_per_name=1))
    # Not the DNS server's own address: a learned /32 takes the place of its world identity.
    targets = [node.ext_outside, node.ext_except]
    assert not tcp_exchange(a.name, node.ext_outside, PORT, timeout=DENY_TIMEOUT), "no name resolved yet"
    identities = set()
    for i in range(12):
        target = targets[i % len(targets)]
        world.server.table["api.example.test"] = Record([target], ttl=60)
        answer = query(a.name, world.dns, "api.example.test", tcp=i % 2 == 1)
        assert addresses(answer) == [target], f"lookup {i}"
        dropped = drops(node.dp, a.ep_id)
        assert tcp_exchange(a.name, target, PORT), f"connection after lookup {i}"
        assert drops(node.dp, a.ep_id) == dropped, f"the first SYN after lookup {i} passed (no retransmission)"
        identities.add(node.dp.ipcache_lookup(target))
        stale = targets[(i - 1) % len(targets)]
        if i:
            assert not tcp_exchange(a.name, stale, PORT, timeout=DENY_TIMEOUT), f"evicted {stale} after lookup {i}"
    assert len(identities) == 12 and all(is_local_identity(x or 0) for x in identities)
    assert proxy.stats.forwarded == 12


@pytest.mark.parametrize("refuse", [RefuseCode.REFUSED, RefuseCode.NXDOMAIN])
def test_name_no_rule_allows_is_refused(world: World, proxies: Proxies, refuse: RefuseCode) -> None:
    a = world.node.a
    world.server.table["api.other.test"] = Record([world.node.ext_outside])
    proxy = proxies.start(refuse=refuse)
    answer = query(a.name, world.dns, "api.other.test")
    assert answer is not None and answer.rcode() == refuse.rcode
    answer = query(a.name, world.dns, "api.other.test", tcp=True)
    assert answer is not None and answer.rcode() == refuse.rcode
    assert world.server.queries == [], "never forwarded"
    assert proxy.stats.refused == 2


def test_ttl_expiry_waits_for_open_connections(world: World, proxies: Proxies) -> None:
    node, a = world.node, world.node.a
    proxy = proxies.start(limits=CacheLimits(min_ttl=5))
    world.server.table["api.example.test"] = Record([node.ext_outside], ttl=1)
    assert addresses(query(a.name, world.dns, "api.example.test")) == [node.ext_outside]
    stream = Stream(a.name, node.ext_outside, PORT)
    try:
        assert stream.ping()
        world.clock.now += 4
        assert world.loop.call(proxy.expire) == 0, "the 5 s floor, not the 1 s TTL"
        world.clock.now += 2
        assert world.loop.call(proxy.expire) == 0, "an open connection keeps the address"
        assert stream.ping(), "a long-lived connection across the TTL"
    finally:
        stream.close()
    node.dp.flush_conntrack(a.ep_id)
    assert world.loop.call(proxy.expire) == 1
    assert not tcp_exchange(a.name, node.ext_outside, PORT, timeout=DENY_TIMEOUT), "expired and unused"
    # The name moved: the next answer allows the new address only.
    world.server.table["api.example.test"] = Record([node.ext_except], ttl=1)
    assert addresses(query(a.name, world.dns, "api.example.test")) == [node.ext_except]
    assert tcp_exchange(a.name, node.ext_except, PORT)
    assert not tcp_exchange(a.name, node.ext_outside, PORT, timeout=DENY_TIMEOUT)


def test_learned_address_follows_cidr_prefixes_published_after_the_lookup(world: World, proxies: Proxies) -> None:
    """The learned /32 hides every prefix holding the address in the LPM map, so what it keeps of
    its former identity follows the CIDR prefixes the datapath publishes: a toCIDR added after the
    lookup allows through it, a removed one stops; a CIDR /32 of exactly the address gives way to
    the learned entry and is put back when the address expires."""
    node, a = world.node, world.node.a
    cidr_id = MIN_CIDR_IDENTITY + 77
    on_7000 = PolicyEntry(PolicyKey(Direction.EGRESS, cidr_id, L4Proto.TCP, 7000))
    node.dp.sync_policy(a.ep_id, Enforcement(egress=True), [*DNS_ALLOWED, on_7000])
    wide, host = str(ipaddress.ip_network(f"{node.ext_outside}/24", strict=False)), f"{node.ext_outside}/32"
    publisher = NamePublisher(str(proxies.state_dir), node.dp, world.port)
    me = [NameEndpoint(a.ep_id, a.identity, (a.v4, a.v6), RULES, (on_7000,))]

    def publish(prefixes: dict[str, int]) -> None:
        # As the datapath does: the ipcache's entries, then the file; the proxy reads it within a second.
        for prefix in publisher_prefixes - prefixes.keys():
            node.dp.ipcache_delete(prefix)
        for prefix, ident in prefixes.items():
            node.dp.ipcache_upsert(prefix, ident)
        publisher_prefixes.clear()
        publisher_prefixes.update(prefixes)
        publisher.publish_prefixes(prefixes)
        assert world.loop.call(proxy.reload)
        node.dp.flush_conntrack(a.ep_id)

    publisher_prefixes: set[str] = set()
    proxy = proxies.start()
    try:
        publisher.publish(me)
        world.loop.call(proxy.reload)
        world.server.table["api.example.test"] = Record([node.ext_outside], ttl=1)
        assert addresses(query(a.name, world.dns, "api.example.test")) == [node.ext_outside]
        assert tcp_exchange(a.name, node.ext_outside, PORT), "by its name"
        assert not tcp_exchange(a.name, node.ext_outside, 7000, timeout=DENY_TIMEOUT), "world: no 7000"
        publish({wide: cidr_id})
        assert tcp_exchange(a.name, node.ext_outside, 7000), "the toCIDR added after the lookup"
        assert tcp_exchange(a.name, node.ext_outside, PORT)
        publish({})
        assert not tcp_exchange(a.name, node.ext_outside, 7000, timeout=DENY_TIMEOUT), "the toCIDR removed"
        # The CIDR names exactly the address; its /32 lands on the learned one (as a restarted
        # datapath's replay writes it), and the proxy puts the learned entry back.
        publish({host: cidr_id})
        assert is_local_identity(node.dp.ipcache_lookup(node.ext_outside) or 0)
        assert tcp_exchange(a.name, node.ext_outside, PORT)
        assert tcp_exchange(a.name, node.ext_outside, 7000)
        node.dp.flush_conntrack(a.ep_id)
        world.clock.now += 10
        assert world.loop.call(proxy.expire) == 1
        assert node.dp.ipcache_lookup(node.ext_outside) == cidr_id, "the CIDR's entry put back"
        assert tcp_exchange(a.name, node.ext_outside, 7000), "by the CIDR rule alone"
        assert not tcp_exchange(a.name, node.ext_outside, PORT, timeout=DENY_TIMEOUT), "the name expired"
    finally:
        for prefix in publisher_prefixes:
            node.dp.ipcache_delete(prefix)


def test_many_addresses_bounded_per_name(world: World, proxies: Proxies) -> None:
    """An S3-like name whose answers rotate through addresses: the oldest learned goes first."""
    node, a = world.node, world.node.a
    proxies.start(limits=CacheLimits(max_per_name=2))
    table = world.server.table
    table["bucket.example.test"] = Record([node.ext_except, node.ext_v6])
    assert addresses(query(a.name, world.dns, "bucket.example.test")) == [node.ext_except]
    table["bucket.example.test"] = Record([node.ext_outside, node.ext_v6])
    assert addresses(query(a.name, world.dns, "bucket.example.test")) == [node.ext_outside]
    assert tcp_exchange(a.name, node.ext_except, PORT), "two addresses fit"
    assert addresses(query(a.name, world.dns, "bucket.example.test", rdtype="AAAA")) == [node.ext_v6]
    assert tcp_exchange(a.name, node.ext_v6, PORT)
    assert tcp_exchange(a.name, node.ext_outside, PORT)
    assert not tcp_exchange(a.name, node.ext_except, PORT, timeout=DENY_TIMEOUT), "the oldest, evicted"


def test_restart_restores_learned_names_and_keeps_steering(world: World, proxies: Proxies) -> None:
    node, a = world.node, world.node.a
    proxy = proxies.start()
    world.server.table["api.example.test"] = Record([node.ext_outside])
    assert addresses(query(a.name, world.dns, "api.example.test")) == [node.ext_outside]
    ident = node.dp.ipcache_lookup(node.ext_outside)
    proxies.stop(proxy)
    # While no proxy serves: what it learned stays allowed, and queries are not sent past it.
    assert tcp_exchange(a.name, node.ext_outside, PORT)
    world.server.queries.clear()
    assert query(a.name, world.dns, "api.example.test", timeout=0.5) is None
    assert world.server.queries == []
    restarted = proxies.start()
    assert restarted.cache.names() == {"api.example.test": [node.ext_outside]}
    assert node.dp.ipcache_lookup(node.ext_outside) == ident, "the same identity: open flows keep their verdict"
    assert tcp_exchange(a.name, node.ext_outside, PORT)
    world.server.table["www.example.test"] = Record([node.ext_except])
    assert addresses(query(a.name, world.dns, "www.example.test")) == [node.ext_except]
    assert tcp_exchange(a.name, node.ext_except, PORT)


def test_full_policy_sync_keeps_learned_entries(world: World, proxies: Proxies) -> None:
    """The realizer's full syncs own the policy service's entries only."""
    node, a = world.node, world.node.a
    proxies.start()
    world.server.table["api.example.test"] = Record([node.ext_outside])
    assert addresses(query(a.name, world.dns, "api.example.test")) == [node.ext_outside]
    node.dp.sync_policy(a.ep_id, Enforcement(egress=True), DNS_ALLOWED)
    assert tcp_exchange(a.name, node.ext_outside, PORT)


def _serving(a_name: str, server: str, name: str, attempts: int = 50) -> dns.message.Message | None:
    """The first answer a freshly started proxy process gives (it opens its sockets once restored)."""
    for _ in range(attempts):
        answer = query(a_name, server, name, timeout=0.2)
        if answer is not None:
            return answer
    return None


def test_proxy_process_killed_and_restarted(world: World, proxies: Proxies, bpf_base: str, tmp_path: Path) -> None:
    """The proxy as the node runs it (its own process): kill -9 keeps the steering and what it
    learned; queries in the gap are dropped, never sent past it; the restart restores the names."""
    node, a = world.node, world.node.a
    state = tmp_path / "state"
    state.mkdir()
    NamePublisher(str(state), node.dp, world.port).publish([NameEndpoint(a.ep_id, a.identity, (a.v4, a.v6), RULES)])
    cmd = [sys.executable, "-m", "services.datapath.dnsproxyd", "--bpffs", bpf_base, "--state-dir", str(state),
           "--dns-proxy-port", str(world.port), "--log-format", "text"]  # fmt: skip
    log = open(tmp_path / "dnsproxy.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        world.server.table["api.example.test"] = Record([node.ext_outside])
        assert addresses(_serving(a.name, world.dns, "api.example.test")) == [node.ext_outside]
        dropped = drops(node.dp, a.ep_id)
        assert tcp_exchange(a.name, node.ext_outside, PORT)
        assert drops(node.dp, a.ep_id) == dropped
        ident = node.dp.ipcache_lookup(node.ext_outside)

        proc.kill()
        proc.wait(10)
        world.server.queries.clear()
        assert query(a.name, world.dns, "api.example.test", timeout=0.5) is None
        assert world.server.queries == [], "not sent past the proxy"
        assert tcp_exchange(a.name, node.ext_outside, PORT), "learned entries stay in the pinned maps"

        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        world.server.table["www.example.test"] = Record([node.ext_except])
        assert addresses(_serving(a.name, world.dns, "www.example.test")) == [node.ext_except]
        assert tcp_exchange(a.name, node.ext_except, PORT)
        assert node.dp.ipcache_lookup(node.ext_outside) == ident, "restored with its identity"
        assert tcp_exchange(a.name, node.ext_outside, PORT)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_learned_address_keeps_other_endpoints_world_rules(world: World, proxies: Proxies) -> None:
    """Pod b may reach the world on 8080 and has no name rules: an address pod a learned (now a
    node-local identity) stays reachable for b, as world was."""
    node, a, b = world.node, world.node.a, world.node.b
    world_8080 = PolicyEntry(PolicyKey(Direction.EGRESS, IDENTITY_WORLD, L4Proto.TCP, PORT))
    node.dp.sync_policy(b.ep_id, Enforcement(egress=True), [world_8080])
    proxies.start(NameEndpoint(b.ep_id, b.identity, (b.v4, b.v6), NameRules(), (world_8080,)))
    assert tcp_exchange(b.name, node.ext_outside, PORT)
    world.server.table["api.example.test"] = Record([node.ext_outside])
    assert addresses(query(a.name, world.dns, "api.example.test")) == [node.ext_outside]
    assert is_local_identity(node.dp.ipcache_lookup(node.ext_outside) or 0)
    assert tcp_exchange(b.name, node.ext_outside, PORT), "world's allow carried to the learned identity"
    assert not tcp_exchange(b.name, node.ext_outside, 9000, timeout=DENY_TIMEOUT), "and nothing more"


def test_steered_over_ipv6(world: World, proxies: Proxies) -> None:
    """A query to an IPv6 server, UDP and TCP: steered, answered from the server's address, learned."""
    node, a = world.node, world.node.a
    proxy = proxies.start()
    world.server.table["api.example.test"] = Record([node.ext_outside])
    for tcp in (False, True):
        answer = query(a.name, node.ext_v6, "api.example.test", tcp=tcp)
        assert addresses(answer) == [node.ext_outside], f"tcp={tcp}"
    assert proxy.stats.forwarded == 2
    assert tcp_exchange(a.name, node.ext_outside, PORT)
