"""Masquerade with real packets: a pod, its node, and "the internet" on a documentation address.

Three namespaces made by the test: the pod (10.77.x.5), its node (forwarding, the rules under
test), and a server standing for the internet at 203.0.113.10 that knows no way back to the pod
CIDR: only a masqueraded connection can be answered. The server's socket is the test's own, so
the source address it sees is read directly. Nothing is sent outside the machine.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from services.common.config import ConfigError
from services.datapath import masquerade, netns
from services.datapath.config import DatapathConfig
from services.datapath.masquerade import MasqueradePlan, ruleset
from services.datapath.nodes import NodeInfo, masquerade_plan
from testkit.traffic import socket_in

INTERNET = "203.0.113.10"
NODE_OUTSIDE = "203.0.113.1"


def test_the_rule_set_masquerades_each_family_from_the_pods_to_all_but_the_cluster() -> None:
    plan = MasqueradePlan(True, ("10.244.1.0/24", "fd00:1::/64"), ("10.244.0.0/24", "10.244.1.0/24", "172.31.0.10/32"))
    text = ruleset(plan)
    assert "ip saddr @pods4 ip daddr != @cluster4 masquerade" in text
    assert "ip6 saddr @pods6 ip6 daddr != @cluster6 masquerade" in text
    assert "elements = { 10.244.0.0/24, 10.244.1.0/24, 172.31.0.10/32 }" in text
    assert text.startswith("table inet palisade {}\ndelete table inet palisade\n")
    off = ruleset(MasqueradePlan(False, ("10.244.1.0/24",)))
    assert off == "table inet palisade {}\ndelete table inet palisade\n"


def test_the_plan_keeps_every_node_address_and_pod_cidr_and_the_listed_ranges() -> None:
    nodes = {
        "a": NodeInfo("a", ("172.31.0.10",)),
        "b": NodeInfo("b", ("172.31.0.11", "fd00::b"), ("10.244.9.0/24",)),
    }
    plan = masquerade_plan("a", nodes, {"a": ["10.244.0.0/24"]}, True, ["192.168.0.0/16"])
    assert plan.sources == ("10.244.0.0/24",)
    assert set(plan.keep) == {
        "10.244.0.0/24",
        "10.244.9.0/24",
        "172.31.0.10/32",
        "172.31.0.11/32",
        "fd00::b/128",
        "192.168.0.0/16",
    }


def test_a_misspelled_non_masquerade_range_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--non-masquerade-cidrs: '10\.0\.0\.0/33'"):
        DatapathConfig(non_masquerade_cidrs="192.168.0.0/16, 10.0.0.0/33").validate()


@dataclass(frozen=True)
class World:
    pod: str
    node: str
    internet: str
    pod_ip: str
    pod_cidr: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def world() -> Iterator[World]:
    tag = secrets.token_hex(3)
    pod, node, internet = f"pm{tag}p", f"pm{tag}n", f"pm{tag}i"
    octet = 1 + secrets.randbelow(250)
    w = World(pod, node, internet, f"10.77.{octet}.5", f"10.77.{octet}.0/24")
    made = []
    try:
        for ns in (pod, node, internet):
            netns.create_netns(ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", node, "link", "add", "topod", "type", "veth", "peer", "name", "eth0", "netns", pod)
        _ip("-n", node, "link", "add", "tonet", "type", "veth", "peer", "name", "eth0", "netns", internet)
        _ip("-n", pod, "addr", "add", f"{w.pod_ip}/24", "dev", "eth0")
        _ip("-n", node, "addr", "add", f"10.77.{octet}.1/24", "dev", "topod")
        _ip("-n", node, "addr", "add", f"{NODE_OUTSIDE}/24", "dev", "tonet")
        _ip("-n", internet, "addr", "add", f"{INTERNET}/24", "dev", "eth0")
        for ns, dev in ((pod, "eth0"), (node, "topod"), (node, "tonet"), (internet, "eth0")):
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", pod, "route", "add", "default", "via", f"10.77.{octet}.1")
        subprocess.run(["ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)
        yield w
    finally:
        for ns in made:
            netns.delete_netns(ns)


def _apply(w: World, plan: MasqueradePlan) -> None:
    netns.in_netns(w.node, masquerade.apply, plan)


def _tcp_peer(w: World) -> tuple[str, bytes]:
    """A TCP exchange from the pod to the internet: the address the server saw, what the pod got back."""
    with socket_in(w.internet, socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind((INTERNET, 0))
        server.listen(1)
        server.settimeout(5)
        port = server.getsockname()[1]
        with socket_in(w.pod, socket.AF_INET, socket.SOCK_STREAM) as client:
            client.settimeout(5)
            client.connect((INTERNET, port))
            conn, (peer, _) = server.accept()
            with conn:
                conn.sendall(b"from the internet")
                return peer, client.recv(64)


def _udp_source(w: World) -> str:
    """The source address a datagram from the pod arrives at the internet with."""
    with socket_in(w.internet, socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind((INTERNET, 0))
        server.settimeout(5)
        with socket_in(w.pod, socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.sendto(b"x", (INTERNET, server.getsockname()[1]))
            _, (source, _) = server.recvfrom(16)
            return str(source)


@pytest.mark.root
def test_pod_traffic_to_the_internet_leaves_with_the_nodes_address_and_replies_find_the_pod(world: World) -> None:
    _apply(world, MasqueradePlan(True, (world.pod_cidr,), (world.pod_cidr,)))
    peer, answer = _tcp_peer(world)
    assert peer == NODE_OUTSIDE
    assert answer == b"from the internet"
    assert _udp_source(world) == NODE_OUTSIDE


@pytest.mark.root
@pytest.mark.parametrize(
    "plan",
    ["listed as not masqueraded", "inside the cluster's ranges", "masquerade off", "no rules at all"],
)
def test_traffic_keeps_the_pods_address_when_the_rules_say_so(world: World, plan: str) -> None:
    sources = (world.pod_cidr,)
    plans = {
        "listed as not masqueraded": MasqueradePlan(True, sources, (world.pod_cidr, "203.0.113.0/24")),
        "inside the cluster's ranges": MasqueradePlan(True, sources, (world.pod_cidr, f"{INTERNET}/32")),
        "masquerade off": MasqueradePlan(False, sources),
    }
    _apply(world, MasqueradePlan(True, sources, (world.pod_cidr,)))  # on first: the plan must undo it
    if plan in plans:
        _apply(world, plans[plan])
    else:
        subprocess.run(["ip", "netns", "exec", world.node, "nft", "flush", "ruleset"], check=True)
    assert _udp_source(world) == world.pod_ip
