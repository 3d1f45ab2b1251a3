"""SCTP through ClusterIP Services on real packets: DNAT before policy, reverse NAT, hairpin, and the
CRC32c the receiver checks (the program updates it for the ports it rewrites, in sctp_csum)."""

from __future__ import annotations

import os
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.datapath.maps.bpf import prog_test_run
from services.datapath.types import (
    Backend,
    Direction,
    Enforcement,
    Frontend,
    L4Proto,
    LbService,
    Reason,
    Verdict,
)
from services.devstack.sctp import crc32c
from testkit.datapathnode import Node, clear_services
from testkit.traffic import (
    DENY_TIMEOUT,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    SctpListener,
    sctp_arrival,
    sctp_crc_ok,
    sctp_exchange,
    sctp_packet,
)
from tests.datapath.entries import entry

VIP = "10.96.78.10"
VIP6 = "fd00:96::78:10"
#: The frontend's port and the backends' (Diameter's): every translation changes the port.
FRONT = 2905
BACK = 3868
HEADER = Path(__file__).parents[2] / "services" / "datapath" / "bpf" / "lb_sctp.h"
POLY = 0x82F63B78


def sctp(address: str, port: int = FRONT) -> Frontend:
    return Frontend(address, port, L4Proto.SCTP)


@pytest.fixture
def lb(net: Node) -> Iterator[Node]:
    """The clean node with an SCTP server (raw sockets) on BACK in every pod and the outside host;
    every frontend a test adds is removed after it."""
    listeners = [SctpListener(ns, [BACK]) for ns in (*(p.name for p in net.pods), net.ext.name)]
    try:
        yield net
    finally:
        for listener in listeners:
            listener.close()
        clear_services(net.dp)


# -- the arithmetic, against Python's CRC32c (no kernel needed) ------------------------------------


def _mul(a: int, b: int) -> int:
    """a * b modulo the Castagnoli polynomial, bit-reflected (zlib's multmodp)."""
    p = 0
    for i in range(31, -1, -1):
        if a & (1 << i):
            p ^= b
        b = (b >> 1) ^ (POLY if b & 1 else 0)
    return p


def _x8(n: int, table: list[int]) -> int:
    p = 1 << 31
    for j in range(16):
        if n >> j & 1:
            p = _mul(table[j], p)
    return p


def _header_table() -> list[int]:
    found = dict(re.findall(r"#define CRC32C_X8_(\d+) (0x[0-9a-f]+)u", HEADER.read_text()))
    return [int(found[str(j)], 16) for j in range(16)]


def test_the_programs_power_table_is_x_to_the_8_times_2_to_the_j() -> None:
    expected, x = [], 1 << 30  # x^1
    for k in range(19):
        if k >= 3:
            expected.append(x)  # x^(2^k), k = 3..18: x^(8 * 2^j)
        x = _mul(x, x)
    assert _header_table() == expected


@pytest.mark.parametrize("length", [12, 16, 20, 100, 1480, 9000, 65515])
def test_a_port_change_moves_the_crc_by_the_ports_xor_times_x_to_the_8_times_the_rest(length: int) -> None:
    table = _header_table()
    old = bytearray(os.urandom(length))
    old[8:12] = bytes(4)
    new = bytearray(old)
    new[0:4] = os.urandom(4)
    diff = struct.unpack("<I", bytes(a ^ b for a, b in zip(old[:4], new[:4], strict=True)))[0]
    register = diff
    for _ in range(32):
        register = (register >> 1) ^ (POLY if register & 1 else 0)
    # What crc32c_port_delta computes, in the program's order of operations.
    assert crc32c(bytes(new)) == crc32c(bytes(old)) ^ _mul(_x8(length - 4, table), register)


# -- real packets ------------------------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.parametrize("family", [4, 6])
def test_an_sctp_clusterip_reaches_its_backend_and_the_answer_comes_from_the_clusterip(lb: Node, family: int) -> None:
    dp, a, b = lb.dp, lb.a, lb.b
    vip, backend = (VIP, b.v4) if family == 4 else (VIP6, b.v6)
    state = dp.lb_upsert(LbService(sctp(vip), (Backend(backend, BACK),)))
    # The INIT reaches b on its port with a CRC32c b accepts (b answers only then), and the INIT-ACK
    # comes back from the ClusterIP and its port, with a CRC32c the client accepts.
    assert sctp_exchange(a.name, vip, FRONT)
    entries = [e for e in dp.conntrack(a.ep_id) if e.service_id == state.id]
    assert entries and all(e.destination_ip == backend and e.destination_port == BACK for e in entries)


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("length", [4, 101, 1000, 1400])
def test_the_backend_sees_its_port_and_a_correct_crc_at_every_length(lb: Node, family: int, length: int) -> None:
    dp, a, b = lb.dp, lb.a, lb.b
    vip, backend = (VIP, b.v4) if family == 4 else (VIP6, b.v6)
    dp.lb_upsert(LbService(sctp(vip), (Backend(backend, BACK),)))
    vtag = int.from_bytes(os.urandom(4), "big") | 1
    packet = sctp_packet(40000 + length, FRONT, vtag, length)
    got = sctp_arrival(a.name, b.name, vip, packet)
    assert got is not None
    assert struct.unpack("!HH", got[:4]) == (40000 + length, BACK)
    assert got[12:] == packet[12:]
    assert sctp_crc_ok(got)


@pytest.mark.root
@pytest.mark.bcc
def test_a_zero_checksum_is_left_for_the_offload_to_compute(lb: Node) -> None:
    # A kernel SCTP sender on a veth (NETIF_F_SCTP_CRC) leaves the field zero for whoever computes it
    # later over the packet as it then is; an update written into it would end up in that result.
    dp, a, b = lb.dp, lb.a, lb.b
    dp.lb_upsert(LbService(sctp(VIP), (Backend(b.v4, BACK),)))
    packet = sctp_packet(40001, FRONT, 77, 64, checksum=False)
    got = sctp_arrival(a.name, b.name, VIP, packet)
    assert got is not None
    assert struct.unpack("!HH", got[:4]) == (40001, BACK)
    assert got[8:12] == bytes(4)


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.parametrize("family", [4, 6])
def test_through_the_host_to_a_backend_outside_and_back(lb: Node, family: int) -> None:
    # Not a local endpoint: from_container translates and the host forwards; the answer comes back
    # through the host, reverse-translated in to_container.
    a = lb.a
    vip, backend = (VIP, lb.ext_in) if family == 4 else (VIP6, lb.ext_v6)
    lb.dp.lb_upsert(LbService(sctp(vip), (Backend(backend, BACK),)))
    assert sctp_exchange(a.name, vip, FRONT)


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.parametrize("family", [4, 6])
def test_a_pod_reaches_itself_through_its_own_sctp_service(lb: Node, family: int) -> None:
    a = lb.a
    vip, backend = (VIP, a.v4) if family == 4 else (VIP6, a.v6)
    lb.dp.lb_upsert(LbService(sctp(vip), (Backend(backend, BACK),)))
    assert sctp_exchange(a.name, vip, FRONT)


@pytest.mark.root
@pytest.mark.bcc
def test_egress_policy_judges_the_sctp_backend_identity_and_port(lb: Node) -> None:
    dp, a, b, c = lb.dp, lb.a, lb.b, lb.c
    dp.lb_upsert(LbService(sctp(VIP), (Backend(b.v4, BACK),)))
    dp.lb_upsert(LbService(sctp(VIP, FRONT + 1), (Backend(c.v4, BACK),)))
    invalid = dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.INVALID)
    dp.sync_policy(a.ep_id, Enforcement(egress=True), [entry(Direction.EGRESS, b.identity, L4Proto.SCTP, BACK)])
    assert sctp_exchange(a.name, VIP, FRONT)
    assert not sctp_exchange(a.name, VIP, FRONT + 1, timeout=DENY_TIMEOUT)  # c is not allowed
    # Allowing the frontend's port, not the backend's, allows nothing (policy applies after DNAT).
    dp.sync_policy(a.ep_id, Enforcement(egress=True), [entry(Direction.EGRESS, b.identity, L4Proto.SCTP, FRONT)])
    dp.flush_conntrack()
    assert not sctp_exchange(a.name, VIP, FRONT, timeout=DENY_TIMEOUT)
    # SCTP's only: a late retransmit of an earlier test's TCP connection may be judged meanwhile.
    flows = [f for f in dp.read_flows(0) if f.source_ip == a.v4 and f.verdict is Verdict.DENY and f.protocol == 132]
    assert flows and all(f.destination_ip in (b.v4, c.v4) and f.destination_port == BACK for f in flows)
    assert dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.INVALID) == invalid  # no checksum trouble


@pytest.mark.root
@pytest.mark.bcc
def test_sctp_associations_spread_over_backends_unless_client_ip_affinity(lb: Node) -> None:
    dp, a, b, c = lb.dp, lb.a, lb.b, lb.c
    both = (Backend(b.v4, BACK), Backend(c.v4, BACK))

    def used(besides: frozenset[int] = frozenset()) -> dict[int, str]:
        """Each association's backend, by its source port."""
        return {
            e.source_port: e.destination_ip
            for e in dp.conntrack(a.ep_id)
            if e.service_id and e.direction is Direction.EGRESS and e.source_port not in besides
        }

    dp.lb_upsert(LbService(sctp(VIP), both))
    for _ in range(24):
        assert sctp_exchange(a.name, VIP, FRONT)  # each from another source port: a new association
    first = used()
    assert set(first.values()) == {b.v4, c.v4}
    dp.flush_conntrack()
    dp.lb_upsert(LbService(sctp(VIP), both, affinity_timeout=600))
    for _ in range(24):
        assert sctp_exchange(a.name, VIP, FRONT)
    # The first associations' last packets (the kernels' ABORTs of the probes' INIT-ACKs) may land
    # after the flush and enter their own backends again: only the new associations count.
    assert len(set(used(frozenset(first)).values())) == 1


def _sctp_frame(src: str, dst: str, packet: bytes, frag_off: int) -> bytes:
    """An IPv4 Ethernet frame around an SCTP packet, with the given flags/fragment offset field."""
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(packet), 1, frag_off, 64, 132, 0, *(socket.inet_aton(a) for a in (src, dst))
    )
    return b"\x02" * 6 + b"\x04" * 6 + struct.pack("!H", 0x0800) + ip + packet


@pytest.mark.root
@pytest.mark.bcc
def test_a_first_fragment_to_an_sctp_clusterip_is_dropped_as_invalid_not_sent_with_a_wrong_crc(lb: Node) -> None:
    # The CRC32c covers the whole SCTP packet; from its first fragment its length is unknown.
    dp, a, b = lb.dp, lb.a, lb.b
    dp.lb_upsert(LbService(sctp(VIP), (Backend(b.v4, BACK),)))
    from_a, a_if = dp.template.from_container_fd, a.net.host_ifindex
    whole = sctp_packet(41000, FRONT, 5, 64)
    more_fragments = 0x2000

    def invalid() -> int:
        return dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.INVALID, direction=Direction.EGRESS)

    before = invalid()
    assert prog_test_run(from_a, _sctp_frame(a.v4, VIP, whole, more_fragments), a_if, 1)[0] == TC_ACT_SHOT
    assert invalid() == before + 1
    # The same packet unfragmented is translated, with its CRC32c right (local delivery to b).
    code = prog_test_run(from_a, _sctp_frame(a.v4, VIP, sctp_packet(41001, FRONT, 5, 64), 0), a_if, 1)[0]
    assert code == TC_ACT_REDIRECT
