"""Policy enforced on real packets between pod namespaces: identities, ports, protocols, state."""

from __future__ import annotations

import socket

import pytest

from services.datapath.types import (
    Direction,
    Enforcement,
    L4Proto,
    Reason,
    Verdict,
)
from testkit.datapathnode import Node, drops
from testkit.traffic import (
    DENY_TIMEOUT,
    icmp_echo,
    sctp_init_crosses,
    socket_in,
    streams,
    tcp_exchange,
    udp_exchange,
)
from tests.datapath.entries import entry

pytestmark = [pytest.mark.root, pytest.mark.bcc]

INGRESS_ONLY = Enforcement(ingress=True)
EGRESS_ONLY = Enforcement(egress=True)


def test_without_policy_everything_passes(net: Node) -> None:
    # Counters live as long as the session's node: earlier tests' drops stay counted, so compare.
    dropped = drops(net.dp, net.b.ep_id)
    passed = net.dp.counters().packets(endpoint_id=net.b.ep_id, reason=Reason.NOT_ENFORCED, direction=Direction.INGRESS)
    assert tcp_exchange(net.a.name, net.b.v4, 8080)
    assert udp_exchange(net.a.name, net.b.v4, 5353)
    counters = net.dp.counters()
    assert counters.packets(endpoint_id=net.b.ep_id, reason=Reason.NOT_ENFORCED, direction=Direction.INGRESS) > passed
    assert drops(net.dp, net.b.ep_id) == dropped
    # One endpoint's counters alone (what GetEndpoint shows): the same figures, nobody else's.
    own = net.dp.counters([net.b.ep_id])
    assert own.values == {k: v for k, v in counters.values.items() if k.endpoint_id == net.b.ep_id} != {}


def test_tcp_allowed_by_identity_and_port(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])

    assert tcp_exchange(a.name, b.v4, 8080)
    before = drops(dp, b.ep_id, Direction.INGRESS)
    assert not tcp_exchange(a.name, b.v4, 8081, timeout=DENY_TIMEOUT), "other port must be denied"
    assert not tcp_exchange(c.name, b.v4, 8080, timeout=DENY_TIMEOUT), "other identity must be denied"
    assert drops(dp, b.ep_id, Direction.INGRESS) >= before + 2
    # b's egress is not enforced: b reaches a freely.
    assert tcp_exchange(b.name, a.v4, 8081)


def test_port_range_boundaries(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 9000, 9010)])

    for port in (9000, 9005, 9010):
        assert tcp_exchange(a.name, b.v4, port), port
    for port in (8999, 9011):
        assert not tcp_exchange(a.name, b.v4, port, timeout=DENY_TIMEOUT), port


def test_udp_allowed_with_reply_and_denied(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity, L4Proto.UDP, 5353)])

    assert udp_exchange(a.name, b.v4, 5353), "datagram and its reply must pass"
    assert not udp_exchange(a.name, b.v4, 5354, timeout=DENY_TIMEOUT)


def test_protocol_is_part_of_the_key(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity, L4Proto.UDP, 7000)])
    assert udp_exchange(a.name, b.v4, 7000)
    assert not tcp_exchange(a.name, b.v4, 7000, timeout=DENY_TIMEOUT), "UDP 7000 must not allow TCP 7000"

    # An L3-only entry (any protocol, any port) allows both.
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity)])
    assert tcp_exchange(a.name, b.v4, 7000)
    assert udp_exchange(a.name, b.v4, 7000)


def test_sctp_init_allowed_and_denied(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    dp.sync_policy(
        b.ep_id,
        INGRESS_ONLY,
        [
            entry(Direction.INGRESS, a.identity, L4Proto.SCTP, 3868),
            entry(Direction.INGRESS, c.identity, L4Proto.TCP, 3868),
        ],
    )
    assert sctp_init_crosses(a.name, b.name, b.v4, 3868)
    before = drops(dp, b.ep_id)
    assert not sctp_init_crosses(a.name, b.name, b.v4, 3869, timeout=DENY_TIMEOUT), "other SCTP port"
    assert not sctp_init_crosses(c.name, b.name, b.v4, 3868, timeout=DENY_TIMEOUT), "a TCP rule is not an SCTP rule"
    assert drops(dp, b.ep_id) >= before + 2

    # The SCTP entry's flow event says so.
    dp.read_flows(0)
    sctp_init_crosses(c.name, b.name, b.v4, 3868, timeout=DENY_TIMEOUT)
    events = [e for e in dp.read_flows(1000) if e.endpoint_id == b.ep_id and e.protocol == 132]
    assert events and events[0].verdict is Verdict.DENY and events[0].destination_port == 3868


def test_replies_pass_when_egress_denies_everything(net: Node) -> None:
    """b enforces egress with no entry at all, yet answers an allowed ingress connection."""
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(
        b.ep_id, Enforcement(ingress=True, egress=True), [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)]
    )
    assert tcp_exchange(a.name, b.v4, 8080), "b's replies belong to an allowed connection"
    assert udp_exchange(a.name, b.v4, 5353, timeout=DENY_TIMEOUT) is False, "ingress UDP was never allowed"
    before = drops(dp, b.ep_id, Direction.EGRESS)
    assert not tcp_exchange(b.name, a.v4, 8080, timeout=DENY_TIMEOUT), "b may not open connections"
    assert drops(dp, b.ep_id, Direction.EGRESS) > before


def test_ingress_and_egress_are_enforced_separately(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    # a may only talk to b on 8080; c enforces nothing.
    dp.sync_policy(a.ep_id, EGRESS_ONLY, [entry(Direction.EGRESS, b.identity, L4Proto.TCP, 8080)])

    assert tcp_exchange(a.name, b.v4, 8080)
    assert not tcp_exchange(a.name, c.v4, 8080, timeout=DENY_TIMEOUT)
    assert not tcp_exchange(a.name, b.v4, 8081, timeout=DENY_TIMEOUT)
    # Ingress of a is not enforced: c and b reach it on any port.
    assert tcp_exchange(c.name, a.v4, 8081)
    assert tcp_exchange(b.name, a.v4, 9000)

    # Now b also enforces ingress, admitting c only: a's egress allows a->b:8080 but b's ingress does not.
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, c.identity, L4Proto.TCP, 8080)])
    before_a, before_b = drops(dp, a.ep_id), drops(dp, b.ep_id, Direction.INGRESS)
    assert not tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT)
    assert drops(dp, a.ep_id) == before_a, "a's egress let it out"
    assert drops(dp, b.ep_id, Direction.INGRESS) > before_b, "b's ingress dropped it"
    assert tcp_exchange(c.name, b.v4, 8080)


def test_deny_beats_allow(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    dp.sync_policy(
        b.ep_id,
        INGRESS_ONLY,
        [
            entry(Direction.INGRESS, 0),  # anyone, anything
            entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080, deny=True),  # but not a on TCP 8080
            entry(Direction.INGRESS, c.identity, L4Proto.TCP, 9000, 9010),  # a specific allow ...
            entry(Direction.INGRESS, 0, L4Proto.TCP, 9005, deny=True),  # ... loses to a wider wildcard deny
        ],
    )
    assert tcp_exchange(a.name, b.v4, 8081)
    assert tcp_exchange(c.name, b.v4, 8080)
    assert tcp_exchange(c.name, b.v4, 9000)
    dp.read_flows(0)
    assert not tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT)
    assert not tcp_exchange(c.name, b.v4, 9005, timeout=DENY_TIMEOUT)
    reasons = {
        (e.source_identity, e.destination_port, e.reason) for e in dp.read_flows(500) if e.verdict is Verdict.DENY
    }
    assert (a.identity, 8080, Reason.POLICY_DENY) in reasons
    assert (c.identity, 9005, Reason.POLICY_DENY) in reasons


def test_drop_emits_flow_event_with_identities_and_ports(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    dp.read_flows(0)
    assert not tcp_exchange(a.name, b.v4, 8081, timeout=DENY_TIMEOUT)

    events = dp.read_flows(1000)
    drop = next(e for e in events if e.verdict is Verdict.DENY and e.endpoint_id == b.ep_id)
    assert drop.direction is Direction.INGRESS
    assert drop.reason is Reason.DEFAULT_DENY
    assert (drop.source_identity, drop.destination_identity) == (a.identity, b.identity)
    assert (drop.source_ip, drop.destination_ip) == (a.v4, b.v4)
    assert drop.destination_port == 8081 and drop.source_port > 0
    assert drop.protocol == 6
    assert drop.ifindex == b.net.host_ifindex
    # The allowed new connection left one event at each end; its established packets none.
    assert tcp_exchange(a.name, b.v4, 8080)
    allowed = [e for e in dp.read_flows(1000) if e.verdict is Verdict.ALLOW and e.destination_port == 8080]
    assert sorted((e.endpoint_id, e.reason) for e in allowed) == [
        (a.ep_id, Reason.NOT_ENFORCED),
        (b.ep_id, Reason.POLICY_ALLOW),
    ]


def test_relabel_changes_what_an_endpoint_reaches(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    frontend = 4242
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, frontend, L4Proto.TCP, 8080)])
    assert not tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT)

    dp.set_identity(a.ep_id, frontend)
    assert tcp_exchange(a.name, b.v4, 8080)
    dp.read_flows(0)

    dp.set_identity(a.ep_id, a.identity)
    assert not tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT)
    events = [
        e
        for e in dp.read_flows(1000)
        if e.endpoint_id == b.ep_id and e.verdict is Verdict.DENY and e.direction is Direction.INGRESS
    ]
    assert events and {e.source_identity for e in events} == {a.identity}


def test_relabel_keeps_flows_both_labels_allow(net: Node) -> None:
    """The relabel protocol: new entries first, then the identity; a flow both allow survives."""
    dp, a, b = net.dp, net.a, net.b
    old, new = a.identity, 4343
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, old, L4Proto.TCP, 8080)])
    with streams((a.name, b.v4, 8080)) as (stream,):
        assert stream.ping()
        dp.apply_policy(b.ep_id, INGRESS_ONLY, add=[entry(Direction.INGRESS, new, L4Proto.TCP, 8080)])
        dp.set_identity(a.ep_id, new)
        dp.apply_policy(b.ep_id, INGRESS_ONLY, remove=[entry(Direction.INGRESS, old, L4Proto.TCP, 8080)])
        assert stream.ping()


def test_policy_change_cuts_denied_stream_and_keeps_allowed_one(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    kept = entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8081)
    cut = entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)
    dp.sync_policy(b.ep_id, INGRESS_ONLY, [cut, kept])
    with streams((a.name, b.v4, 8080), (a.name, b.v4, 8081), (a.name, b.v6, 8080)) as (s1, s2, s3):
        assert s1.ping() and s2.ping() and s3.ping()
        dp.read_flows(0)

        change = dp.apply_policy(b.ep_id, INGRESS_ONLY, remove=[cut])
        assert change.removed == 1

        assert not s1.ping(timeout=DENY_TIMEOUT), "the removed allow must cut the established flow"
        assert not s3.ping(timeout=DENY_TIMEOUT), "in both families"
        assert s2.ping(), "a flow the new policy still allows continues"
        assert s2.ping()
        events = [e for e in dp.read_flows(1000) if e.verdict is Verdict.DENY and e.endpoint_id == b.ep_id]
        assert {e.destination_port for e in events if e.direction is Direction.INGRESS} == {8080}


def test_icmp_echo_follows_policy(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    assert icmp_echo(a.name, b.v4) and icmp_echo(a.name, b.v6)

    dp.sync_policy(b.ep_id, INGRESS_ONLY, [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    assert not icmp_echo(a.name, b.v4, timeout=DENY_TIMEOUT), "a TCP rule does not admit ICMP"
    assert not icmp_echo(a.name, b.v6, timeout=DENY_TIMEOUT)

    dp.sync_policy(
        b.ep_id,
        INGRESS_ONLY,
        [entry(Direction.INGRESS, a.identity, L4Proto.ICMP), entry(Direction.INGRESS, a.identity, L4Proto.ICMPV6)],
    )
    assert icmp_echo(a.name, b.v4), "echo request allowed, its reply established"
    assert icmp_echo(a.name, b.v6)
    assert not tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT)


def test_truncated_packet_is_dropped_as_invalid(net: Node) -> None:
    """A TCP packet too short to hold ports cannot be judged: dropped, counted and reported."""
    dp, a, b = net.dp, net.a, net.b
    dp.read_flows(0)
    before = dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.INVALID)
    with socket_in(a.name, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP) as raw:
        raw.sendto(b"\x1f\x90", (b.v4, 0))  # two bytes of a TCP header
    events = [e for e in dp.read_flows(1000) if e.reason is Reason.INVALID]
    assert dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.INVALID) == before + 1
    assert [(e.endpoint_id, e.direction, e.verdict, e.destination_ip) for e in events] == [
        (a.ep_id, Direction.EGRESS, Verdict.DENY, b.v4)
    ]
