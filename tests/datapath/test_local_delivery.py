"""Local delivery: packets between two pods of the node go from the source's program straight
into the destination's namespace, judged by the destination's ingress policy on the way.

What shows the path: a packet the host forwards leaves through the destination's host veth
(a packet socket on that veth sees it go out, and to_container runs there); a packet delivered
directly never touches that veth. Every test sends real packets between pod namespaces.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import socket
import subprocess
from collections.abc import Iterator

import pytest

from services.datapath.loader import CALL_DELIVER, CALLS
from services.datapath.maps import deliverymap
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.deliverymap import DeliveryTarget
from services.datapath.types import Direction, Enforcement, L4Proto, PolicyEntry, Reason, Verdict
from testkit.datapathnode import Node, Pod, drops
from testkit.traffic import DENY_TIMEOUT, family_of, host_sent, socket_in, tcp_exchange, udp_exchange
from tests.datapath.entries import entry

pytestmark = [pytest.mark.root, pytest.mark.bcc]

#: The TTL / hop limit a pod's socket sends with, and what the destination sees after one hop.
SENT_TTL = 64
#: Linux's IP_RECVTTL (linux/in.h); Python's socket module does not export it.
IP_RECVTTL = 12


def allow_from(source: Pod, proto: L4Proto = L4Proto.ANY, port: int = 0) -> PolicyEntry:
    return entry(Direction.INGRESS, source.identity, proto, port, port)


@pytest.mark.parametrize("family", ["v4", "v6"])
def test_traffic_between_local_pods_skips_the_host(net: Node, family: str) -> None:
    """Both directions of an allowed exchange are delivered directly: neither pod's host veth
    transmits anything, and both ingress halves judged and counted as to_container would."""
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [allow_from(a, L4Proto.TCP, 8080)])
    target = b.v4 if family == "v4" else b.v6
    with host_sent(net.pods, a, b) as forwarded:
        assert tcp_exchange(a.name, target, 8080)
        assert udp_exchange(b.name, a.v4 if family == "v4" else a.v6, 5353)
        assert forwarded() == 0
    counters = dp.counters()
    assert counters.packets(endpoint_id=b.ep_id, reason=Reason.POLICY_ALLOW, direction=Direction.INGRESS) >= 1
    assert counters.packets(endpoint_id=b.ep_id, reason=Reason.ESTABLISHED, direction=Direction.INGRESS) >= 2
    assert counters.packets(endpoint_id=a.ep_id, reason=Reason.NOT_ENFORCED, direction=Direction.INGRESS) >= 1
    # b's connection entry was written for b, ingress: its replies went out as established.
    assert any(e.direction == Direction.INGRESS and e.destination_port == 8080 for e in dp.conntrack(b.ep_id))


def test_the_destinations_ingress_policy_drops_on_the_way(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [allow_from(c, L4Proto.TCP, 8080)])
    dp.read_flows(0)
    before_drops = drops(dp, b.ep_id, Direction.INGRESS)
    with host_sent(net.pods, b) as forwarded:
        assert not tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT)
        assert tcp_exchange(c.name, b.v4, 8080)
        assert forwarded() == 0
    assert drops(dp, b.ep_id, Direction.INGRESS) > before_drops
    denied = [e for e in dp.read_flows(0) if e.verdict == Verdict.DENY]
    assert denied, "a drop on the direct path reports a flow event"
    assert {(e.endpoint_id, e.ifindex, e.direction, e.reason, e.source_identity) for e in denied} == {
        (b.ep_id, b.net.host_ifindex, Direction.INGRESS, Reason.DEFAULT_DENY, a.identity)
    }


def received_ttl(sender: Pod, receiver: Pod, ip: str, port: int) -> int:
    """The TTL / hop limit ``receiver`` sees on a datagram ``sender`` sent to ``ip:port``."""
    family = family_of(ip)
    level, option, answer = (
        (socket.IPPROTO_IP, IP_RECVTTL, socket.IP_TTL)
        if family == socket.AF_INET
        else (socket.IPPROTO_IPV6, socket.IPV6_RECVHOPLIMIT, socket.IPV6_HOPLIMIT)
    )
    rx = socket_in(receiver.name, family, socket.SOCK_DGRAM)
    tx = socket_in(sender.name, family, socket.SOCK_DGRAM)
    with rx, tx:
        rx.setsockopt(level, option, 1)
        rx.bind((ip, port))
        rx.settimeout(5)
        if family == socket.AF_INET:
            tx.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, SENT_TTL)
        else:
            tx.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, SENT_TTL)
        tx.sendto(b"ttl", (ip, port))
        _, ancillary, _, _ = rx.recvmsg(16, socket.CMSG_SPACE(4))
    (value,) = [int.from_bytes(data[:4], "little") for lvl, kind, data in ancillary if (lvl, kind) == (level, answer)]
    return value


@pytest.mark.parametrize("family", ["v4", "v6"])
def test_a_delivered_packet_is_one_hop_on_as_if_forwarded(net: Node, family: str) -> None:
    a, b = net.a, net.b
    with host_sent(net.pods, b) as forwarded:
        assert received_ttl(a, b, b.v4 if family == "v4" else b.v6, 47001) == SENT_TTL - 1
        assert forwarded() == 0


def b_targets(node: Node) -> list[DeliveryTarget]:
    return [t for t in node.dp.delivery.targets() if t.ifindex == node.b.net.host_ifindex]


def test_attaching_offers_each_address_with_the_pods_ethernet_address(net: Node) -> None:
    b = net.b
    assert b_targets(net) == sorted(
        (DeliveryTarget(ip, b.net.host_ifindex, b.net.pod_mac, b.net.host_mac) for ip in (b.v4, b.v6)),
        key=lambda t: t.ip,
    )


@pytest.fixture
def b_on_older_programs(net: Node) -> Iterator[Node]:
    """b's delivery entries name an older generation (as after an upgrade, before b's re-attach);
    re-attaching b afterwards writes the current one again."""
    dp = net.dp
    targets = b_targets(net)
    assert targets and all(t.generation == deliverymap.GENERATION for t in targets)
    for target in targets:
        dp.delivery.write(dataclasses.replace(target, generation=deliverymap.GENERATION - 1))
    try:
        yield net
    finally:
        dp.attach_endpoint(net.b.spec)
    assert b_targets(net) == targets


def test_an_endpoint_on_older_programs_is_reached_through_the_host(b_on_older_programs: Node) -> None:
    """Delivering directly would run b's ingress half with this program's state, where b's own
    (older) program would not find it: until b runs these programs, the host forwards to it."""
    dp, a, b = b_on_older_programs.dp, b_on_older_programs.a, b_on_older_programs.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [allow_from(a, L4Proto.UDP, 5353)])
    with host_sent(b_on_older_programs.pods, b) as forwarded:
        assert udp_exchange(a.name, b.v4, 5353)
        assert forwarded() == 1


@pytest.fixture
def b_unresolved(net: Node) -> Iterator[Node]:
    """The host has no neighbour entry for b's IPv4 address on b's veth (another plugin's veth
    before its first packet): attaching offers the IPv6 address only. Restored afterwards."""
    dp, b = net.dp, net.b
    subprocess.run(["ip", "neigh", "del", b.v4, "dev", b.net.host_ifname], check=True, capture_output=True)
    try:
        dp.attach_endpoint(b.spec)
        yield net
    finally:
        subprocess.run(
            ["ip", "neigh", "replace", b.v4, "lladdr", b.net.pod_mac, "dev", b.net.host_ifname, "nud", "permanent"],
            check=True,
            capture_output=True,
        )
        dp.attach_endpoint(b.spec)
    assert {t.ip for t in b_targets(net)} == {b.v4, b.v6}


def test_an_address_without_a_known_neighbour_is_reached_through_the_host(b_unresolved: Node) -> None:
    net = b_unresolved
    a, b = net.a, net.b
    assert [t.ip for t in b_targets(net)] == [b.v6]
    with host_sent(net.pods, b) as forwarded:
        assert udp_exchange(a.name, b.v4, 5353)
        assert forwarded() == 1  # the host resolved b's address and forwarded the datagram
        assert udp_exchange(a.name, b.v6, 5353)
        assert forwarded() == 0


@pytest.fixture
def without_local_delivery(net: Node) -> Iterator[Node]:
    """a and b run a template built with local delivery off; the node's own afterwards."""
    dp = net.dp
    host_routed = dp._loader.template(dataclasses.replace(dp.config, local_delivery=False))
    assert host_routed.hash != dp.template.hash
    try:
        for pod in (net.a, net.b):
            dp._loader.attach(host_routed, pod.net.host_ifindex)
        yield net
    finally:
        for pod in (net.a, net.b):
            dp.attach_endpoint(pod.spec)


def test_without_local_delivery_the_host_forwards_and_to_container_judges(without_local_delivery: Node) -> None:
    net = without_local_delivery
    dp, a, b, c = net.dp, net.a, net.b, net.c
    assert received_ttl(a, b, b.v4, 47002) == SENT_TTL - 1
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [allow_from(a, L4Proto.UDP, 5353)])
    before_drops = drops(dp, b.ep_id, Direction.INGRESS)
    with host_sent(without_local_delivery.pods, a, b) as forwarded:
        assert udp_exchange(a.name, b.v4, 5353)
        assert forwarded() == 2  # the datagram and its echo
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [allow_from(c, L4Proto.UDP, 5353)])
    assert not udp_exchange(a.name, b.v4, 5353, timeout=DENY_TIMEOUT)
    assert drops(dp, b.ep_id, Direction.INGRESS) > before_drops


@pytest.fixture
def host_dnat(net: Node) -> Iterator[str]:
    """A virtual address the host translates to b:8080, as kube-proxy's nat rules do for a NodePort
    or an external IP; removed afterwards."""
    chain = f"PALT-{net.run_id}"
    vip = net.a.v4.rsplit(".", 1)[0] + ".250"
    dnat = ["-j", "DNAT", "--to-destination", f"{net.b.v4}:8080"]
    rules = [
        ["-t", "nat", "-N", chain],
        ["-t", "nat", "-A", chain, "-d", f"{vip}/32", "-p", "tcp", "--dport", "80", *dnat],
        ["-t", "nat", "-I", "PREROUTING", "-j", chain],
    ]
    try:
        for rule in rules:
            subprocess.run(["iptables", "-w", *rule], check=True, capture_output=True)
        yield vip
    finally:
        for rule in (
            ["-t", "nat", "-D", "PREROUTING", "-j", chain],
            ["-t", "nat", "-F", chain],
            ["-t", "nat", "-X", chain],
        ):
            subprocess.run(["iptables", "-w", *rule], check=False, capture_output=True)


def test_replies_of_a_flow_the_host_translated_go_back_through_the_host(net: Node, host_dnat: str) -> None:
    """a dials an address the host DNATs to b: b's replies must reach the host's conntrack to get
    that address back (delivered straight to a, they would carry b's and a would reset them)."""
    a, b = net.a, net.b
    with host_sent(net.pods, b) as forwarded:
        assert tcp_exchange(a.name, host_dnat, 80)
        assert tcp_exchange(a.name, host_dnat, 80)
        assert forwarded() >= 2  # every packet from a to b went through the host (its DNAT)
    assert tcp_exchange(b.name, a.v4, 8080)  # b's own flows to a are still delivered directly


class U32(ctypes.Structure):
    """A program array's key (the slot) and value (a program's descriptor)."""

    _fields_ = [("value", ctypes.c_uint32)]


@pytest.fixture
def empty_deliver_slot(net: Node) -> Iterator[Node]:
    """The template's program array without deliver (as while a template is being built, or
    after a prune unpinned it); filled again afterwards."""
    template = net.dp.template
    calls = PinnedMap(os.dup(template.calls_fd), MapSpec(CALLS, MapType.PROG_ARRAY, 4, 4, 1), "")
    slot = U32(CALL_DELIVER)
    try:
        assert calls.delete(slot)
        yield net
    finally:
        calls.update(slot, U32(template.deliver_fd))
        calls.close()


def test_a_failed_tail_call_leaves_the_packet_on_the_hosts_path(empty_deliver_slot: Node) -> None:
    net = empty_deliver_slot
    dp, a, b, c = net.dp, net.a, net.b, net.c
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [allow_from(a, L4Proto.UDP, 5353)])
    with host_sent(net.pods, a, b) as forwarded:
        assert udp_exchange(a.name, b.v4, 5353)
        assert forwarded() == 2  # the datagram and its echo, through the host; to_container judged
        assert not udp_exchange(c.name, b.v4, 5353, timeout=DENY_TIMEOUT)


def test_the_macs_given_with_an_endpoint_are_offered_without_a_lookup(net: Node) -> None:
    """The service knows both MACs of a veth it made (it chose them): it gives them, and the datapath
    reads neither the link nor the host's neighbour table (a dump that grows with the node's pods)."""
    b = net.b
    before = b_targets(net)
    given = dataclasses.replace(b.spec, host_mac="02:00:00:00:0a:0a", pod_mac="02:00:00:00:0b:0b")
    try:
        net.dp.attach_endpoint(given)
        assert {(t.ip, t.pod_mac, t.host_mac) for t in b_targets(net)} == {
            (ip, "02:00:00:00:0b:0b", "02:00:00:00:0a:0a") for ip in (b.v4, b.v6)
        }
    finally:
        net.dp.attach_endpoint(b.spec)
    assert b_targets(net) == before
