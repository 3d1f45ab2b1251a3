"""The node's DNS proxy: pods' queries that a DNS rule selects, filtered, forwarded and learned.

The program hands it the queries (``bpf/dns.h``): packets keep the pod's server as their
destination, so its sockets are transparent and it reads the original server from each query
(``IP_RECVORIGDSTADDR`` for UDP, the accepted socket's own address for TCP). Per query:

1. the client is a local endpoint, and one of its identity's DNS rules covers the server
   (identity, port, protocol) and allows the name (``services.common.fqdn``); otherwise the answer is the
   configured refusal (REFUSED or NXDOMAIN: musl treats REFUSED as final);
2. the query goes to the original server, over the protocol it came in;
3. the A/AAAA records of the answer, for a name some local endpoint's FQDN rules select, are
   learned (``fqdncache``), journaled (``fqdnstore``) and written to the maps: ipcache and the
   policy entries of every endpoint whose rules select the name (``fqdnmaps``),
4. and only then is the answer released, from the server's address, as a reply of the flow
   conntrack holds. The pod's first connection to an address it just resolved is never dropped.

Learned addresses expire with their TTL (raised to a minimum) once no conntrack entry uses them.
The proxy owns the ``dns_steering`` entries of its endpoints; they stay pinned while it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Protocol

import dns.exception
import dns.message
import dns.rcode
import dns.rdatatype

from services.common import fqdn
from services.common.log import get_logger
from services.datapath.dnsnames import NameSource
from services.datapath.fqdncache import CacheLimits, NameCache
from services.datapath.fqdnmaps import CidrPrefixes, NameEndpoint, NameMaps, PolicyMaps
from services.datapath.fqdnstore import NameStore
from services.datapath.fqdnview import NamesView
from services.datapath.fqdnview import view as names_view
from services.datapath.types import (
    IDENTITY_ANY,
    IDENTITY_WORLD,
    DnsRule,
    Enforcement,
    L4Proto,
    PolicyEntry,
    is_local_identity,
)

log = get_logger("dnsproxy")

# Linux socket options Python's socket module does not name.
IP_TRANSPARENT = 19
IP_RECVORIGDSTADDR = 20
IPV6_RECVORIGDSTADDR = 74
IPV6_TRANSPARENT = 75
SOL_IPV6 = 41

Address = tuple[str, int]


class RefuseCode(StrEnum):
    """The answer to a query for a name no DNS rule allows."""

    REFUSED = "refused"
    NXDOMAIN = "nxdomain"

    @property
    def rcode(self) -> dns.rcode.Rcode:
        return dns.rcode.REFUSED if self is RefuseCode.REFUSED else dns.rcode.NXDOMAIN


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """Settings of the DNS proxy."""

    #: Where the learned names are kept (the datapath's state dir).
    state_dir: str
    #: The port of the proxy's transparent sockets (both families, UDP and TCP).
    port: int = 10053
    #: The answer to a query for a name no DNS rule allows.
    refuse: RefuseCode = RefuseCode.REFUSED
    #: TTL floor and address bounds of the learned names.
    limits: CacheLimits = dataclasses.field(default_factory=CacheLimits)
    #: Seconds to wait for the original server's answer (the client retries after its own timeout).
    upstream_timeout: float = 2.0
    #: Seconds between passes that expire learned addresses.
    expire_interval: float = 1.0
    #: A new snapshot of the learned names once the journal holds ``compact_every`` answers and
    #: ``compact_ratio`` times as many as the cache holds pairs. A snapshot costs in proportion to
    #: the cache (about 50 ms at 10,000 pairs, during which lookups wait), so it is made in
    #: proportion to it: its pause touches a bounded share of lookups whatever the cache's size,
    #: and a restore replays a journal at most that many times the snapshot's length.
    compact_every: int = 2000
    compact_ratio: float = 4.0

    def __post_init__(self) -> None:
        if not 0 < self.port <= 0xFFFF:
            raise ValueError(f"DNS proxy port {self.port} is outside 1-65535")
        if self.upstream_timeout <= 0 or self.expire_interval <= 0:
            raise ValueError("the DNS proxy's upstream timeout and expire interval must be positive")
        if self.compact_every <= 0 or self.compact_ratio < 0:
            raise ValueError("the DNS proxy's compact_every must be positive and compact_ratio not negative")

    def compact_due(self, journaled: int, pairs: int) -> bool:
        """Whether ``journaled`` answers since the last snapshot of ``pairs`` learned pairs call for a new one."""
        return journaled >= max(self.compact_every, self.compact_ratio * pairs)


class ProxyMaps(PolicyMaps, Protocol):
    """The BPF facade as the proxy uses it (blocking calls)."""

    def ipcache_lookup(self, ip: str) -> int | None: ...

    def ipcache_dump(self) -> dict[str, int]: ...

    def dump_policy(self, ep_id: int) -> tuple[Enforcement, list[PolicyEntry]]: ...

    def open_destinations(self) -> set[str]: ...


@dataclasses.dataclass
class ProxyStats:
    queries: int = 0
    refused: int = 0
    #: Forwarded although no rule allows the name, because only audited rules cover the server.
    audited: int = 0
    forwarded: int = 0
    failed: int = 0
    learned: int = 0
    expired: int = 0


class Decision(StrEnum):
    """What the proxy does with a query."""

    ALLOW = "allow"
    #: Only rules of policies in audit mode cover the server, and none allows the name: the query
    #: is forwarded and reported as one an enforced policy would refuse.
    AUDIT = "audit"
    REFUSE = "refuse"


def judge(rules: Sequence[DnsRule], server_identity: int, port: int, protocol: L4Proto, name: str) -> Decision:
    """Whether the DNS rules that cover the server allow the name. Pure."""
    covering = [
        rule
        for rule in rules
        if rule.remote_identity in (IDENTITY_ANY, server_identity)
        and rule.port == port
        and rule.protocol in (L4Proto.ANY, protocol)
    ]
    if any(fqdn.selects_any(rule.selectors, name) is not None for rule in covering):
        return Decision.ALLOW
    if covering and all(rule.audit for rule in covering):
        return Decision.AUDIT
    return Decision.REFUSE


def rule_allows(rules: Sequence[DnsRule], server_identity: int, port: int, protocol: L4Proto, name: str) -> bool:
    """Whether the query gets an answer from the server (allowed, or only audited). Pure."""
    return judge(rules, server_identity, port, protocol, name) is not Decision.REFUSE


class DnsProxy:
    """One per node. ``async with``: restores the learned names, writes them, then serves."""

    def __init__(
        self,
        config: ProxyConfig,
        maps: ProxyMaps,
        *,
        source: NameSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        #: Where the datapath publishes the endpoints (None: they come through set_endpoints).
        self._source = source
        self._maps = maps
        self._clock = clock
        self._wall = wall
        self._store = NameStore(config.state_dir)
        self.cache = NameCache(config.limits)
        self._names = NameMaps(maps, self._base_identity, lambda prefix: self._prefixes.exact(prefix))
        #: Learned addresses' former identities (see NameEndpoint.aliased), from the CIDR prefixes.
        self._base_ids: dict[str, int] = {}
        self._prefixes = CidrPrefixes({})
        self._endpoints: dict[int, NameEndpoint] = {}
        #: The endpoints with toFQDNs rules, and the selectors they use.
        self._fqdn_endpoints: list[NameEndpoint] = []
        self._selectors: list[str] = []
        self._by_ip: dict[str, NameEndpoint] = {}
        self.stats = ProxyStats()
        self._since_compact = 0
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._expirer: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> DnsProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Learned names restored and written before the sockets open (the steering entries of the
        last run stay in place meanwhile: queries wait in the client's retry, never pass unfiltered)."""
        self._loop = asyncio.get_running_loop()
        self.cache = self._store.load(self.config.limits, self._clock(), self._wall())
        self._adopt_maps()
        self.reload()
        self._sync_maps()
        self._store.compact(self.cache, self._clock(), self._wall())
        self._open_udp(socket.AF_INET, "0.0.0.0")
        self._open_udp(socket.AF_INET6, "::")
        await self._open_tcp(socket.AF_INET, "0.0.0.0")
        await self._open_tcp(socket.AF_INET6, "::")
        self._expirer = asyncio.create_task(self._expire_loop(), name="dnsproxy-expire")
        log.info("DNS proxy serving", port=self.config.port, pairs=len(self.cache.pairs()))

    async def stop(self) -> None:
        if self._expirer is not None:
            self._expirer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expirer
        for server in self._servers:
            server.close()
        for sock in self._sockets:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sockets.clear()
        self._servers.clear()
        self._store.close()

    def _adopt_maps(self) -> None:
        """The learned entries the maps hold (the last run's): syncs then write what changed and
        remove what the restored cache no longer has. A restored pair keeps its identity, so
        the entries open connections use are never rewritten."""
        ipcache = {p: i for p, i in self._maps.ipcache_dump().items() if is_local_identity(i)}
        self._names.adopt(ipcache, {})

    def _adopt_endpoint(self, ep_id: int) -> None:
        _, entries = self._maps.dump_policy(ep_id)
        self._names.adopt_endpoint(ep_id, {e for e in entries if is_local_identity(e.key.remote_identity)})

    # -- endpoints -----------------------------------------------------------------------------

    def set_prefixes(self, prefixes: Mapping[str, int]) -> bool:
        """The ipcache's CIDR prefixes (see dnsnames); True if they changed. Learned addresses'
        former identities are recomputed: the next sync rewrites the entries they inherit."""
        # Host prefixes both a CIDR and a learned address hold: the learned entry is the map's.
        self._names.reassert(p for p in prefixes if p in self._names.ipcache)
        if prefixes == self._prefixes.held:
            return False
        self._prefixes = CidrPrefixes(prefixes)
        self._base_ids = {}
        return True

    def set_endpoints(self, endpoints: Iterable[NameEndpoint]) -> None:
        """The local endpoints and their name rules, whole; their learned policy entries follow."""
        self._endpoints = {ep.ep_id: ep for ep in endpoints}
        for ep_id in self._endpoints.keys() - self._names.entries.keys():
            self._adopt_endpoint(ep_id)
        self._by_ip = {str(ipaddress.ip_address(ip)): ep for ep in self._endpoints.values() for ip in ep.ips}
        self._fqdn_endpoints = [ep for ep in self._endpoints.values() if ep.rules.fqdn or ep.aliased]
        self._selectors = sorted({r.selector for ep in self._fqdn_endpoints for r in ep.rules.fqdn})
        for gone in self.cache.endpoints() - self._endpoints.keys():
            self.cache.forget_endpoint(gone)
        self._sync_maps()

    def view(self) -> NamesView:
        """What the proxy learned and the selectors in use (for the CLI, through the datapath)."""
        return names_view(self.cache, self._endpoints.values(), self._clock(), self._wall())

    def reload(self) -> bool:
        """Takes the published endpoints if they changed; True if they did."""
        published = None if self._source is None else self._source.read_if_changed()
        if published is None:
            return False
        self.set_prefixes(published.prefixes)
        self.set_endpoints(published.endpoints)
        return True

    def _sync_maps(self) -> None:
        self._names.sync(self.cache, self._endpoints.values())

    # -- answering -----------------------------------------------------------------------------

    async def answer(self, query: bytes, client: Address, server: Address, protocol: L4Proto) -> bytes | None:
        """The bytes to send the client, or None to send nothing (an unparsable query)."""
        self.stats.queries += 1
        try:
            message = dns.message.from_wire(query)
        except dns.exception.DNSException as exc:
            log.warning("unparsable DNS query dropped", client=client[0], error=str(exc))
            return None
        name = fqdn.normalize(message.question[0].name.to_text()) if message.question else ""
        server_identity = self._maps.ipcache_lookup(server[0]) or IDENTITY_WORLD
        ep = self._allowing(client[0], server_identity, server[1], protocol, name)
        if ep is None and self.reload():
            # The datapath published the endpoint (or its rules) after this proxy last looked.
            ep = self._allowing(client[0], server_identity, server[1], protocol, name)
        if ep is None:
            self.stats.refused += 1
            log.debug("DNS query refused", client=client[0], name=name, server=server[0])
            return self._refusal(message)
        if judge(ep.rules.dns, server_identity, server[1], protocol, name) is Decision.AUDIT:
            self.stats.audited += 1
            log.info("DNS query an enforced policy would refuse (audit)", client=client[0], name=name, server=server[0])
        try:
            raw = await self._forward(query, server, protocol)
        except (OSError, TimeoutError, EOFError, asyncio.IncompleteReadError) as exc:
            self.stats.failed += 1
            log.warning("DNS server did not answer", server=server[0], name=name, error=str(exc) or type(exc).__name__)
            return None  # the client retries, as it would had the server not answered
        self.stats.forwarded += 1
        try:
            response = dns.message.from_wire(raw)
        except dns.exception.DNSException:
            return raw  # not ours to judge: nothing learned from it
        answers = [
            (rd.address, float(rrset.ttl))
            for rrset in response.answer
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
            for rd in rrset
        ]
        if answers and self._selected(name):
            self._learn(ep.ep_id, name, answers)
        return raw

    def _allowing(
        self, client: str, server_identity: int, port: int, protocol: L4Proto, name: str
    ) -> NameEndpoint | None:
        """The client's endpoint if one of its DNS rules allows the query."""
        ep = self._by_ip.get(str(ipaddress.ip_address(client)))
        if ep is None or not name or not rule_allows(ep.rules.dns, server_identity, port, protocol, name):
            return None
        return ep

    def _selected(self, name: str) -> bool:
        return fqdn.selects_any(self._selectors, name) is not None

    def _learn(self, ep_id: int, name: str, answers: list[tuple[str, float]]) -> None:
        now, wall = self._clock(), self._wall()
        lookup = self.cache.learn(ep_id, name, answers, now)
        self._store.append(ep_id, name, answers, wall)
        if lookup.added or lookup.evicted:
            self._names.change(self.cache, self._fqdn_endpoints, lookup.added, lookup.evicted)
        self.stats.learned += len(answers)
        self._since_compact += 1
        if self.config.compact_due(self._since_compact, len(self.cache)):
            self._store.compact(self.cache, now, wall)
            self._since_compact = 0

    def _refusal(self, query: dns.message.Message) -> bytes:
        response = dns.message.make_response(query)
        response.set_rcode(self.config.refuse.rcode)
        return response.to_wire()

    async def _forward(self, query: bytes, server: Address, protocol: L4Proto) -> bytes:
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        timeout = self.config.upstream_timeout
        if protocol is L4Proto.TCP:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(server[0], server[1]), timeout)
            try:
                writer.write(struct.pack("!H", len(query)) + query)
                await writer.drain()
                size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), timeout))[0]
                return await asyncio.wait_for(reader.readexactly(size), timeout)
            finally:
                writer.close()
        loop = asyncio.get_running_loop()
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, server)
            await loop.sock_sendall(sock, query)
            while True:
                raw = await asyncio.wait_for(loop.sock_recv(sock, 65535), timeout)
                if raw[:2] == query[:2]:
                    return raw

    def _base_identity(self, ip: str) -> int:
        """The identity ``ip`` had before it was learned: the longest CIDR prefix's, else world."""
        known = self._base_ids.get(ip)
        if known is None:
            found = self._prefixes.longest(ip)
            self._base_ids[ip] = known = IDENTITY_WORLD if found is None else found
        return known

    # -- expiry --------------------------------------------------------------------------------

    def expire(self) -> int:
        """One pass: pairs past their TTL whose address no open connection uses are removed."""
        now = self._clock()
        if not self.cache.has_expired(now):
            return 0
        gone = self.cache.expire(now, self._maps.open_destinations())
        if gone:
            self._names.change(self.cache, self._fqdn_endpoints, (), gone)
            self._base_ids = {ip: i for ip, i in self._base_ids.items() if self.cache.identity(ip) is not None}
            self.stats.expired += len(gone)
            log.debug("learned addresses expired", count=len(gone))
        return len(gone)

    async def _expire_loop(self) -> None:
        """Expiry, and the published endpoints (an endpoint gone, rules changed: entries follow)."""
        while True:
            await asyncio.sleep(self.config.expire_interval)
            try:
                self.reload()
                self.expire()
            except OSError as exc:
                log.error("learned addresses not expired", error=str(exc))

    # -- sockets -------------------------------------------------------------------------------

    def _open_udp(self, family: int, host: str) -> None:
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET:
            sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            sock.setsockopt(socket.SOL_IP, IP_RECVORIGDSTADDR, 1)
        else:
            sock.setsockopt(SOL_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
            sock.setsockopt(SOL_IPV6, IPV6_RECVORIGDSTADDR, 1)
        sock.bind((host, self.config.port))
        sock.setblocking(False)
        self._sockets.append(sock)
        assert self._loop is not None
        self._loop.add_reader(sock.fileno(), self._on_udp, sock)

    def _on_udp(self, sock: socket.socket) -> None:
        for _ in range(64):  # a burst, then let others run
            try:
                data, ancdata, _flags, client = sock.recvmsg(65535, socket.CMSG_SPACE(64))
            except BlockingIOError:
                return
            server = _original_destination(ancdata)
            if server is None:
                continue  # not a steered packet (sent to the proxy's port directly)
            task = asyncio.create_task(self._udp_query(data, (client[0], client[1]), server))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _udp_query(self, data: bytes, client: Address, server: Address) -> None:
        reply = await self.answer(data, client, server, L4Proto.UDP)
        if reply is None:
            return
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as out:
            # From the server's own address and port: the reply of the flow the pod opened.
            out.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET:
                out.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            else:
                out.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
            out.bind(server)
            out.sendto(reply, client)

    async def _open_tcp(self, family: int, host: str) -> None:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET:
            sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        else:
            sock.setsockopt(SOL_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        sock.bind((host, self.config.port))
        sock.listen(512)
        sock.setblocking(False)
        self._servers.append(await asyncio.start_server(self._on_tcp, sock=sock))

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        local = writer.get_extra_info("sockname")
        try:
            while True:
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                query = await reader.readexactly(size)
                reply = await self.answer(query, (peer[0], peer[1]), (local[0], local[1]), L4Proto.TCP)
                if reply is None:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _original_destination(ancdata: list[tuple[int, int, bytes]]) -> Address | None:
    """The destination a steered datagram was sent to (struct sockaddr_in / sockaddr_in6)."""
    for level, kind, data in ancdata:
        if level == socket.SOL_IP and kind == IP_RECVORIGDSTADDR and len(data) >= 8:
            port = struct.unpack("!H", data[2:4])[0]
            return socket.inet_ntop(socket.AF_INET, data[4:8]), port
        if level == SOL_IPV6 and kind == IPV6_RECVORIGDSTADDR and len(data) >= 24:
            port = struct.unpack("!H", data[2:4])[0]
            return socket.inet_ntop(socket.AF_INET6, data[8:24]), port
    return None
