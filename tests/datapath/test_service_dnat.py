"""The DNAT of a connection to a service frontend, byte for byte: frames with real checksums through
from_container (BPF_PROG_TEST_RUN, whose packets carry full checksums, never offloaded ones), and the
frame that comes out checked: the backend's address and port, a valid IPv4 header checksum and a
valid TCP/UDP checksum over the new pseudo-header; and the replies, reverse-NATed on their way into
the client by local delivery ("deliver", tail-called by the backend's from_container). Guards
lb_rewrite_fast, which writes IPv4 TCP/UDP translations straight into the packet (the checksum
arithmetic is its own), against the helpers' rewrite (lb_rewrite) it replaced on those paths; what
a real receiver accepts is in test_services."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from services.datapath.maps.bpf import prog_test_run_frame
from services.datapath.types import Backend, Frontend, L4Proto, LbService
from testkit.datapathnode import Node, clear_services
from testkit.traffic import TC_ACT_REDIRECT

pytestmark = [pytest.mark.root, pytest.mark.bcc]

VIP = "10.96.78.10"
ETH_LEN, IP_LEN = 14, 20
TCP_SYN = 0x02
TCP_SYN_ACK = 0x12


@pytest.fixture
def svc(net: Node) -> Iterator[Node]:
    yield net
    clear_services(net.dp)


def ones_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(int(word) for word in struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def checksum(data: bytes) -> int:
    return ~ones_sum(data) & 0xFFFF


def pseudo_header(ip: bytes, l4_len: int) -> bytes:
    return ip[12:20] + struct.pack("!BBH", 0, ip[9], l4_len)


def frame(
    src: str, dst: str, sport: int, dport: int, proto: int, *, udp_checksum: bool = True, tcp_flags: int = TCP_SYN
) -> bytes:
    """An Ethernet frame with a valid IPv4 header checksum and a valid TCP/UDP checksum (a UDP
    datagram may go without one, as IPv4 allows: ``udp_checksum`` False)."""
    payload = b"dnat-check-payload-" * 2 + b"x"  # odd length: the checksum's last byte padded
    if proto == socket.IPPROTO_TCP:
        l4 = struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, tcp_flags, 65535, 0, 0) + payload
        csum_off = 16
    else:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
        csum_off = 6
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, IP_LEN + len(l4), 1, 0, 64, proto, 0, socket.inet_aton(src), socket.inet_aton(dst)
    )
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    if proto == socket.IPPROTO_TCP or udp_checksum:
        value = checksum(pseudo_header(ip, len(l4)) + l4) or 0xFFFF
        l4 = l4[:csum_off] + struct.pack("!H", value) + l4[csum_off + 2 :]
    return b"\x02" * 6 + b"\x04" * 6 + struct.pack("!H", 0x0800) + ip + l4


def parts(out: bytes) -> tuple[bytes, bytes]:
    ip = out[ETH_LEN : ETH_LEN + IP_LEN]
    total = struct.unpack("!H", ip[2:4])[0]
    return ip, out[ETH_LEN + IP_LEN : ETH_LEN + total]


@pytest.mark.parametrize(
    ("proto", "l4proto", "front_port", "back_port"),
    [
        (socket.IPPROTO_TCP, L4Proto.TCP, 80, 8080),
        (socket.IPPROTO_TCP, L4Proto.TCP, 8080, 8080),
        (socket.IPPROTO_UDP, L4Proto.UDP, 53, 5353),
        (socket.IPPROTO_UDP, L4Proto.UDP, 5353, 5353),
    ],
)
def test_dnat_leaves_the_backend_address_and_port_with_valid_checksums(
    svc: Node, proto: int, l4proto: L4Proto, front_port: int, back_port: int
) -> None:
    dp, a, b = svc.dp, svc.a, svc.b
    dp.lb_upsert(LbService(Frontend(VIP, front_port, l4proto), (Backend(b.v4, back_port),)))
    sent = frame(a.v4, VIP, 41000 + front_port % 1000, front_port, proto)
    for _ in range(2):  # the connection's first packet (a backend chosen), then an established one
        code, out = prog_test_run_frame(dp.template.from_container_fd, sent, a.net.host_ifindex)
        assert code == TC_ACT_REDIRECT  # delivered to b, which local delivery forwards (TTL one less)
        ip, l4 = parts(out)
        assert socket.inet_ntoa(ip[16:20]) == b.v4 and socket.inet_ntoa(ip[12:16]) == a.v4
        assert struct.unpack("!H", l4[2:4])[0] == back_port
        assert struct.unpack("!H", l4[0:2])[0] == 41000 + front_port % 1000
        assert ones_sum(ip) == 0xFFFF, "IPv4 header checksum"
        assert ones_sum(pseudo_header(ip, len(l4)) + l4) == 0xFFFF, "TCP/UDP checksum"
        header = 20 if proto == socket.IPPROTO_TCP else 8
        assert l4[header:] == sent[ETH_LEN + IP_LEN + header :]  # the payload untouched


def test_udp_without_a_checksum_stays_without_one(svc: Node) -> None:
    dp, a, b = svc.dp, svc.a, svc.b
    dp.lb_upsert(LbService(Frontend(VIP, 53, L4Proto.UDP), (Backend(b.v4, 5353),)))
    sent = frame(a.v4, VIP, 42053, 53, socket.IPPROTO_UDP, udp_checksum=False)
    code, out = prog_test_run_frame(dp.template.from_container_fd, sent, a.net.host_ifindex)
    assert code == TC_ACT_REDIRECT
    ip, l4 = parts(out)
    assert socket.inet_ntoa(ip[16:20]) == b.v4 and struct.unpack("!H", l4[2:4])[0] == 5353
    assert ones_sum(ip) == 0xFFFF
    assert l4[6:8] == b"\0\0"


@pytest.mark.parametrize(
    ("proto", "l4proto", "front_port", "back_port"),
    [
        (socket.IPPROTO_TCP, L4Proto.TCP, 80, 8080),
        (socket.IPPROTO_UDP, L4Proto.UDP, 5353, 5353),
    ],
)
def test_replies_delivered_to_the_client_come_from_the_frontend_with_valid_checksums(
    svc: Node, proto: int, l4proto: L4Proto, front_port: int, back_port: int
) -> None:
    dp, a, b = svc.dp, svc.a, svc.b
    dp.lb_upsert(LbService(Frontend(VIP, front_port, l4proto), (Backend(b.v4, back_port),)))
    client_port = 43000 + front_port % 1000
    opened = frame(a.v4, VIP, client_port, front_port, proto)
    # The connection opened: DNAT at a, then b's ingress by local delivery (both sides' entries).
    assert prog_test_run_frame(dp.template.from_container_fd, opened, a.net.host_ifindex)[0] == TC_ACT_REDIRECT
    reply = frame(b.v4, a.v4, back_port, client_port, proto, tcp_flags=TCP_SYN_ACK)
    for _ in range(2):
        code, out = prog_test_run_frame(dp.template.from_container_fd, reply, b.net.host_ifindex)
        assert code == TC_ACT_REDIRECT  # into a, by local delivery
        ip, l4 = parts(out)
        assert socket.inet_ntoa(ip[12:16]) == VIP and socket.inet_ntoa(ip[16:20]) == a.v4
        assert struct.unpack("!HH", l4[0:4]) == (front_port, client_port)
        assert ones_sum(ip) == 0xFFFF, "IPv4 header checksum"
        assert ones_sum(pseudo_header(ip, len(l4)) + l4) == 0xFFFF, "TCP/UDP checksum"
