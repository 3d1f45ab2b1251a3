"""`make run --nodes 2` with real DNS: pods resolve through the dev cluster's outside world.

The world is a namespace of the stack's holding the documentation ranges and a DNS server
answering from a zone file (services/devstack/world.py); this module edits that file while
the stack runs. A pod allowed ``toFQDNs: [{matchPattern: "*.example.test"}]`` (and a DNS rule
letting it resolve those names) reaches them by name and nothing else outside, with real
packets through its node's routing, masquerade and DNS proxy. One stack for the module; its
proxies keep learned addresses at least 1 s (``--dns-min-ttl``) and refuse with NXDOMAIN
(``--dns-refuse``), so a refusal is told apart from the server's own answer (it has the name).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import dns.rcode
import pytest
import yaml

from services.datapath.learnedmaps import LearnedMaps
from services.datapath.types import is_local_identity
from services.devstack import __main__ as devstack
from services.devstack.dnsserver import Record, render_zone
from testkit.dnsserver import SteadyLookups, addresses, query
from testkit.stack import Stack, analyze, probe, prober, running_stack, wait_for
from testkit.traffic import socket_in

pytestmark = [pytest.mark.root, pytest.mark.bcc]

SUBNET = "172.31.246.0/24"
ARGS = ("--nodes", "2", "--node-subnet", SUBNET, "--dns-min-ttl", "1", "--dns-refuse", "nxdomain")
CLIENT, FREE = "names/client", "names/free"
CLIENT_NODE = "dev-node-1"
#: The world's names for this module (TTL 1 s: the proxies' minimum here).
NAMES = {
    "api.example.test": Record(("192.0.2.10",), 1),
    "www.example.test": Record(("192.0.2.11",), 1),
    "moving.example.test": Record(("192.0.2.20",), 1),
    "control.example.test": Record(("192.0.2.30",), 1),
    "s3.example.test": Record(("203.0.113.1", "203.0.113.2", "203.0.113.3"), 1),
    "elsewhere.test": Record(("198.51.100.10",), 1),
}
MANIFESTS = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "names", "labels": {"team": "names"}}},
    *(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "names", "labels": {"app": name}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "ports": [{"containerPort": 8080}]}]},
        }
        for name, node in (("client", CLIENT_NODE), ("free", "dev-node-2"))
    ),
    {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "client-names", "namespace": "names"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "client"}},
            "egress": [
                {
                    # The world's DNS server, by its address: a CIDR identity the policy service
                    # holds in ipam for the prefix, and its ipcache entry.
                    "toCIDR": ["192.0.2.53/32"],
                    "toPorts": [
                        {
                            "ports": [{"port": "53", "protocol": "UDP"}, {"port": "53", "protocol": "TCP"}],
                            "rules": {"dns": [{"matchPattern": "*.example.test"}]},
                        }
                    ],
                },
                {
                    "toFQDNs": [{"matchPattern": "*.example.test"}],
                    "toPorts": [{"ports": [{"port": "80", "protocol": "TCP"}]}],
                },
            ],
        },
    },
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dns")
    folder = tmp / "start"
    folder.mkdir()
    (folder / "names.yaml").write_text(yaml.safe_dump_all(MANIFESTS))
    with running_stack(tmp, folder, *ARGS) as s:
        set_names(s, NAMES)
        # The DNS rule's server is a CIDR identity, allocated after the policy is accepted: the
        # client resolves once its node holds it (a name the tests do not use: nothing learned).
        netns, server = s.netns(CLIENT), s.addresses["dns"]
        assert wait_for(lambda: query(netns, server, "warmup.example.test", timeout=0.5) is not None, 60)
        yield s


def set_names(stack: Stack, names: dict[str, Record]) -> None:
    """The world's zone file, replaced whole (its server reads it again at the next query)."""
    path = Path(stack.addresses["dns_zone"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render_zone(names))
    os.replace(tmp, path)


def resolve(stack: Stack, pod: str, name: str) -> tuple[int, list[str]]:
    """A lookup from the pod, as its resolver sends it: the answer's code and addresses."""
    response = query(stack.netns(pod), stack.addresses["dns"], name)
    assert response is not None, f"no answer to {pod}'s query for {name}"
    return response.rcode(), addresses(response)


def reach_name(stack: Stack, pod: str, name: str, port: int) -> bool:
    """Resolve ``name`` from the pod, then connect to the answer (the prober does both, as a client)."""
    target = {"id": "t", "name": name, "port": port, "protocol": "TCP"}
    return prober(stack.netns(pod), [target], resolver=stack.addresses["dns"])["t"]


def learned(stack: Stack, ip: str) -> bool:
    """Whether the client's node holds ``ip`` as an address its DNS proxy learned (a node-local identity)."""
    maps = LearnedMaps.open(f"{stack.bpffs}-{CLIENT_NODE}")
    try:
        identity = maps.ipcache_lookup(ip)
    finally:
        maps.close()
    return identity is not None and is_local_identity(identity)


def world_netns(stack: Stack) -> str:
    args = devstack.parse([*ARGS, "--run-dir", str(stack.run_dir)])
    assert args.world is not None
    return str(args.world.netns)


def test_pods_resolve_through_the_world_and_reach_it_through_their_node(stack: Stack) -> None:
    """A pod no policy selects resolves every name and reaches the world; the world knows no way to
    any pod address (only its own legs and ranges), so replies come back only through the node's
    masquerade."""
    assert resolve(stack, FREE, "elsewhere.test") == (dns.rcode.NOERROR, ["198.51.100.10"])
    assert resolve(stack, FREE, "nowhere.example.test") == (dns.rcode.NXDOMAIN, [])
    assert reach_name(stack, FREE, "api.example.test", 80)
    assert probe(stack.netns(FREE), "198.51.100.10", 443)
    way_back = subprocess.run(["ip", "-n", world_netns(stack), "route", "get", stack.ip(FREE)],
                              capture_output=True, text=True)  # fmt: skip
    assert way_back.returncode != 0 and "unreachable" in way_back.stderr, way_back.stdout


def test_a_pattern_reaches_its_names_by_name_and_nothing_else_outside(stack: Stack) -> None:
    netns = stack.netns(CLIENT)
    # Not resolved yet: the address is the world's like any other.
    assert not probe(netns, "192.0.2.10", 80)
    # Resolved: the first connection after the answer gets through.
    assert reach_name(stack, CLIENT, "api.example.test", 80)
    assert reach_name(stack, CLIENT, "www.example.test", 80)
    assert learned(stack, "192.0.2.10") and learned(stack, "192.0.2.11")
    # Nothing else outside: another port of a learned address, an address never answered
    # (inside the pattern's names, and outside them).
    assert prober(netns, [
        {"id": "port", "ip": "192.0.2.10", "port": 443, "protocol": "TCP"},
        {"id": "unanswered", "ip": "203.0.113.1", "port": 80, "protocol": "TCP"},
        {"id": "elsewhere", "ip": "198.51.100.10", "port": 80, "protocol": "TCP"},
    ]) == {"port": False, "unanswered": False, "elsewhere": False}  # fmt: skip
    assert reach_name(stack, FREE, "api.example.test", 443), "the world serves it"


def test_a_name_no_dns_rule_allows_is_refused_with_the_configured_code(stack: Stack) -> None:
    # The server has the name (the unrestricted pod gets it): NXDOMAIN is the proxy's refusal.
    assert resolve(stack, FREE, "elsewhere.test") == (dns.rcode.NOERROR, ["198.51.100.10"])
    assert resolve(stack, CLIENT, "elsewhere.test") == (dns.rcode.NXDOMAIN, [])
    assert not reach_name(stack, CLIENT, "elsewhere.test", 80)
    assert not learned(stack, "198.51.100.10")
    assert resolve(stack, CLIENT, "api.example.test") == (dns.rcode.NOERROR, ["192.0.2.10"])


def test_an_address_change_at_ttl_expiry_and_a_connection_that_outlives_it(stack: Stack) -> None:
    """moving.example.test moves from .20 to .21. A connection opened to .20 keeps it allowed past its
    TTL (control.example.test, learned with it and never used, expires meanwhile); the new address
    is allowed once answered; once the connection is closed the old address stops being allowed."""
    netns = stack.netns(CLIENT)
    assert resolve(stack, CLIENT, "moving.example.test") == (dns.rcode.NOERROR, ["192.0.2.20"])
    assert resolve(stack, CLIENT, "control.example.test") == (dns.rcode.NOERROR, ["192.0.2.30"])
    with socket_in(netns, socket.AF_INET, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(("192.0.2.20", 80))
        assert conn.makefile("rb").readline() == b"world\n"
        # Past the TTL: the unused address expires, the one in use stays.
        assert wait_for(lambda: not learned(stack, "192.0.2.30")), "the unused address never expired"
        assert learned(stack, "192.0.2.20")
        assert not probe(netns, "192.0.2.30", 80)
        set_names(stack, {**NAMES, "moving.example.test": Record(("192.0.2.21",), 1)})
        assert not probe(netns, "192.0.2.21", 80), "not answered yet"
        assert reach_name(stack, CLIENT, "moving.example.test", 80)
        # The long-lived connection still works both ways.
        conn.sendall(b"still there\n")
        assert conn.recv(64) == b"still there\n"
    assert wait_for(lambda: not learned(stack, "192.0.2.20")), "the old address stayed after its connection closed"
    assert not probe(netns, "192.0.2.20", 80)
    assert reach_name(stack, CLIENT, "moving.example.test", 80)


def test_many_addresses_for_one_name_and_their_rotation(stack: Stack) -> None:
    netns = stack.netns(CLIENT)

    def every_address_reached(want: list[str]) -> None:
        code, got = resolve(stack, CLIENT, "s3.example.test")
        assert (code, sorted(got)) == (dns.rcode.NOERROR, want)
        targets = [{"id": ip, "ip": ip, "port": 80, "protocol": "TCP"} for ip in got]
        assert prober(netns, targets) == dict.fromkeys(got, True)

    every_address_reached(["203.0.113.1", "203.0.113.2", "203.0.113.3"])
    rotated = ("203.0.113.4", "203.0.113.5", "203.0.113.6")
    set_names(stack, {**NAMES, "s3.example.test": Record(rotated, 1)})
    assert not probe(netns, "203.0.113.4", 80), "not answered yet"
    every_address_reached(list(rotated))


def test_a_to_cidr_imported_after_a_lookup_allows_through_the_learned_address(stack: Stack, tmp_path: Path) -> None:
    """The learned /32 hides every prefix holding the address in the node's map: a toCIDR policy
    imported while the pod holds a learned address allows through it, and stops once deleted
    (the proxy follows the CIDR prefixes its datapath publishes). An open connection keeps the
    address learned meanwhile."""
    netns = stack.netns(CLIENT)
    assert resolve(stack, CLIENT, "www.example.test") == (dns.rcode.NOERROR, ["192.0.2.11"])
    policy = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "client-cidr", "namespace": "names"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "client"}},
            "egress": [{"toCIDR": ["192.0.2.0/24"], "toPorts": [{"ports": [{"port": "443", "protocol": "TCP"}]}]}],
        },
    }
    path = tmp_path / "cidr.yaml"
    path.write_text(yaml.safe_dump(policy))
    with socket_in(netns, socket.AF_INET, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(("192.0.2.11", 80))
        assert conn.makefile("rb").readline() == b"world\n"
        assert not probe(netns, "192.0.2.11", 443)
        imported = stack.palisade("policy", "import", str(path), "--wait")
        try:
            assert imported.returncode == 0, imported.stderr
            # The prefix's CIDR identity reaches the node after the revision (ipam holds it).
            assert wait_for(lambda: probe(netns, "192.0.2.11", 443), 30), "the toCIDR hidden by the learned /32"
            assert learned(stack, "192.0.2.11"), "still the learned address"
            assert probe(netns, "192.0.2.12", 443), "the prefix itself"
        finally:
            deleted = stack.palisade("policy", "delete", "cnp", "client-cidr", "-n", "names")
        assert deleted.returncode == 0, deleted.stderr
        assert wait_for(lambda: not probe(netns, "192.0.2.11", 443), 30), "the removed toCIDR kept allowing"
        assert learned(stack, "192.0.2.11")
        conn.sendall(b"still there\n")
        assert conn.recv(64) == b"still there\n"


def test_analyze_with_the_worlds_names_agrees_with_real_packets(stack: Stack) -> None:
    table = {n: NAMES[n].addresses for n in ("api.example.test", "www.example.test", "elsewhere.test")}
    flags = [f for name, ips in table.items() for f in ("--dns", f"{name}={','.join(ips)}")]
    answer = analyze("-f", str(stack.manifests), "--probe", "80/TCP", "--probe", "443/TCP", *flags)
    want = {p["port"]: p["names"] for p in answer["probes"]}
    got: dict[int, dict[str, dict[str, bool]]] = {80: {}, 443: {}}
    for pod in (CLIENT, FREE):
        # Every name on both ports from one prober (concurrently): each resolves, then connects.
        targets = [{"id": f"{n}:{p}", "name": n, "port": p, "protocol": "TCP"} for n in table for p in (80, 443)]
        reached = prober(stack.netns(pod), targets, resolver=stack.addresses["dns"])
        for port in (80, 443):
            got[port][pod] = {name: reached[f"{name}:{port}"] for name in table}
    assert {port: {pod: want[port][pod] for pod in (CLIENT, FREE)} for port in want} == got
    assert not got[80][CLIENT]["elsewhere.test"] and got[80][CLIENT]["api.example.test"], "the case tells them apart"


def _proxy_pid(stack: Stack, node: str) -> int:
    """The PID of ``node``'s DNS proxy process (the stack restarts it when it dies); 0: none."""
    bpffs = f"{stack.bpffs}-{node}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"services.datapath.dnsproxyd" in cmdline and bpffs + b"\0" in cmdline + b"\0":
                return int(entry)
    return 0


@pytest.mark.parametrize("victim", ["datapath", "proxy"])
def test_a_kill_9_under_lookups_loses_no_lookup_for_longer_than_one_retry(stack: Stack, victim: str) -> None:
    """The client resolves and connects steadily while its node's datapath (or DNS proxy) is killed
    (-9) and started again by the node: every lookup is answered within one client retry (a stub
    resolver's 1 s timeout, then a second try) and every connection to the answer gets through."""
    netns, server = stack.netns(CLIENT), stack.addresses["dns"]
    connect = partial(probe, netns, port=80)
    with SteadyLookups(netns, server, "api.example.test", ["192.0.2.10"], connect) as load:
        time.sleep(1)
        if victim == "datapath":
            child = f"datapath-{CLIENT_NODE.rsplit('-', 1)[1]}"
            stack.serving_again(child, stack.kill(child))
        else:
            old = _proxy_pid(stack, CLIENT_NODE)
            assert old, "the client node runs no DNS proxy"
            os.kill(old, signal.SIGKILL)
            assert wait_for(lambda: _proxy_pid(stack, CLIENT_NODE) not in (0, old), 30), "the proxy was not restarted"
        time.sleep(1)
    assert load.rounds > 5 and load.failures == [], load.failures


def test_zz_ctrl_c_removes_the_world(stack: Stack) -> None:
    netns = world_netns(stack)
    assert os.path.exists(f"/run/netns/{netns}")
    stack.interrupt()
    assert not os.path.exists(f"/run/netns/{netns}")
