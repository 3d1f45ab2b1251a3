"""Conntrack: which tuple a TCP SYN may match, and IPv4 entries moved to their own map.

Frames go through the node's compiled programs with BPF_PROG_TEST_RUN, as if they
arrived on a pod's host veth.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket

from services.datapath.maps.bpf import prog_test_run
from services.datapath.maps.ctmap import CtKey, CtValue
from services.datapath.types import Direction, Enforcement, L4Proto
from testkit.datapathnode import Node
from testkit.traffic import ACK, FIN, SYN, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT
from testkit.traffic import tc_frame as frame
from tests.datapath.entries import entry


def test_a_bare_syn_never_matches_the_reversed_tuple(net: Node) -> None:
    """b answering a's connection is a reply; b opening one back on the same ports is not, even
    while a's entry lives (closing): a's ingress policy, which admits nothing, decides it."""
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(a.ep_id, Enforcement(ingress=True), [])
    from_a, to_a = dp.template.from_container_fd, dp.template.to_container_fd
    a_if = a.net.host_ifindex
    tcp = socket.IPPROTO_TCP
    # b is local and admits everything: from_a passes a's packets straight to b.
    assert prog_test_run(from_a, frame(a.v4, b.v4, 41000, 8080, tcp, SYN), a_if, 1)[0] == TC_ACT_REDIRECT
    assert prog_test_run(to_a, frame(b.v4, a.v4, 8080, 41000, tcp, SYN | ACK), a_if, 1)[0] == TC_ACT_OK
    assert prog_test_run(to_a, frame(b.v4, a.v4, 8080, 41000, tcp, ACK), a_if, 1)[0] == TC_ACT_OK
    assert prog_test_run(from_a, frame(a.v4, b.v4, 41000, 8080, tcp, FIN | ACK), a_if, 1)[0] == TC_ACT_REDIRECT
    assert [e.closing for e in dp.conntrack(a.ep_id)] == [True]
    assert prog_test_run(to_a, frame(b.v4, a.v4, 8080, 41000, tcp, SYN), a_if, 1)[0] == TC_ACT_SHOT
    assert prog_test_run(to_a, frame(b.v4, a.v4, 8080, 41000, tcp, FIN | ACK), a_if, 1)[0] == TC_ACT_OK


def test_a_syn_on_a_closing_entry_opens_it_again(net: Node) -> None:
    """The same tuple, opened again the same way, is a live connection: its entry stops closing
    (else it would expire after the closing lifetime under a connection still in use)."""
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(
        b.ep_id,
        Enforcement(ingress=True),
        [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080, 8080)],
    )
    to_b, b_if = dp.template.to_container_fd, b.net.host_ifindex
    tcp = socket.IPPROTO_TCP
    assert prog_test_run(to_b, frame(a.v4, b.v4, 42000, 8080, tcp, SYN), b_if, 1)[0] == TC_ACT_OK
    assert prog_test_run(to_b, frame(a.v4, b.v4, 42000, 8080, tcp, FIN | ACK), b_if, 1)[0] == TC_ACT_OK
    (closing,) = dp.conntrack(b.ep_id)
    assert closing.closing
    assert prog_test_run(to_b, frame(a.v4, b.v4, 42000, 8080, tcp, SYN), b_if, 1)[0] == TC_ACT_OK
    (reopened,) = dp.conntrack(b.ep_id)
    assert not reopened.closing and reopened.expires_ns > closing.expires_ns


def legacy_key(src: str, dst: str, sport: int, dport: int, ep_id: int, direction: Direction) -> CtKey:
    """A key in the layout every family shared before the IPv4 map."""
    return CtKey(
        saddr=(ctypes.c_uint8 * 16)(*ipaddress.ip_address(src).packed.ljust(16, b"\0")[:16]),
        daddr=(ctypes.c_uint8 * 16)(*ipaddress.ip_address(dst).packed.ljust(16, b"\0")[:16]),
        sport=socket.htons(sport),
        dport=socket.htons(dport),
        ep_id=ep_id,
        family=ipaddress.ip_address(src).version,
        protocol=socket.IPPROTO_TCP,
        direction=direction.wire,
    )


def test_ipv4_entries_of_the_shared_map_are_copied_then_released(net: Node) -> None:
    """An agent before the IPv4 map left a's connection to b in the shared map. Opening copies it
    (the older program, still attached until a's re-attach, reads it there), so b's answers pass
    as replies though a's ingress admits nothing; the releasing pass after the restore keeps the
    copy the new program has been updating, and removes the IPv4 entries there. IPv6 entries stay."""
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(a.ep_id, Enforcement(ingress=True), [])
    to_a, a_if = dp.template.to_container_fd, a.net.host_ifindex
    answer = frame(b.v4, a.v4, 8080, 44000, socket.IPPROTO_TCP, ACK)
    assert prog_test_run(to_a, answer, a_if, 1)[0] == TC_ACT_SHOT  # no entry: judged, denied

    value = CtValue(expires_ns=2**62, epoch=dp.policy_epoch(), remote_identity=b.identity)
    shared = dp.conntrack_map.v6
    shared.update(legacy_key(a.v4, b.v4, 44000, 8080, a.ep_id, Direction.EGRESS), value)
    shared.update(legacy_key(a.v6, b.v6, 44000, 8080, a.ep_id, Direction.EGRESS), value)
    assert prog_test_run(to_a, answer, a_if, 1)[0] == TC_ACT_SHOT  # the program reads the IPv4 map only

    assert dp.migrate_conntrack(release=False) == 1
    assert prog_test_run(to_a, answer, a_if, 1)[0] == TC_ACT_OK
    assert sorted(int(k.family) for k in shared.keys(CtKey)) == [4, 6]  # still there for the older program
    fin = frame(a.v4, b.v4, 44000, 8080, socket.IPPROTO_TCP, FIN | ACK)
    assert prog_test_run(dp.template.from_container_fd, fin, a_if, 1)[0] == TC_ACT_REDIRECT  # the copy now closes

    assert dp.migrate_conntrack() == 0  # the copy is newer than the shared map's entry: kept
    assert [int(k.family) for k in shared.keys(CtKey)] == [6]
    assert sorted((e.source_ip, e.destination_port, e.closing) for e in dp.conntrack(a.ep_id)) == [
        (a.v4, 8080, True),
        (a.v6, 8080, False),
    ]
    assert prog_test_run(to_a, answer, a_if, 1)[0] == TC_ACT_OK
