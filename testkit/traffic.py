"""Real packets between pod namespaces: echo servers, TCP/UDP/ICMP clients, raw SCTP (INIT, servers).

Sockets are created on a thread that entered the pod's namespace
(:func:`services.datapath.netns.in_netns`) and used from the test thread;
a socket stays in the namespace it was created in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from services.datapath.netns import in_netns
from services.devstack import sctp
from services.devstack.sctp import INIT, Packet
from testkit.datapathnode import Pod

#: How long an allowed exchange may take before the test calls it failed (generous: loaded CI).
ALLOW_TIMEOUT = 5.0
#: How long to wait before concluding a packet was dropped; drops are also checked in counters.
DENY_TIMEOUT = 0.6

IPPROTO_SCTP = 132
ETH_P_ALL = 0x0003


def family_of(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET


def socket_in(ns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    return in_netns(ns, socket.socket, family, kind, proto)


class EchoServer:
    """TCP and UDP echo on the given ports, IPv4 and IPv6, in one namespace, served by one thread."""

    def __init__(self, ns: str, tcp_ports: Iterable[int], udp_ports: Iterable[int]) -> None:
        self.ns = ns
        self._sel = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        for family, any_addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            for port in tcp_ports:
                s = self._bound(family, socket.SOCK_STREAM, any_addr, port)
                s.listen(64)
                self._sel.register(s, selectors.EVENT_READ, "accept")
            for port in udp_ports:
                s = self._bound(family, socket.SOCK_DGRAM, any_addr, port)
                self._sel.register(s, selectors.EVENT_READ, "udp")
        self._thread = threading.Thread(target=self._serve, name=f"echo-{ns}", daemon=True)
        self._thread.start()

    def _bound(self, family: int, kind: int, addr: str, port: int) -> socket.socket:
        s = socket_in(self.ns, family, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port))
        s.setblocking(False)
        self._socks.append(s)
        return s

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if key.data == "accept":
                        conn, _ = sock.accept()
                        conn.setblocking(False)
                        self._socks.append(conn)
                        self._sel.register(conn, selectors.EVENT_READ, "tcp")
                    elif key.data == "udp":
                        data, peer = sock.recvfrom(65535)
                        sock.sendto(data, peer)
                    else:
                        data = sock.recv(65535)
                        if not data:
                            self._sel.unregister(sock)
                            sock.close()
                        else:
                            sock.sendall(data)
                except OSError:
                    with contextlib.suppress(Exception):
                        self._sel.unregister(sock)
                    sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self._socks:
            s.close()
        self._sel.close()


def tcp_connects(ns: str, ip: str, port: int, timeout: float = ALLOW_TIMEOUT) -> bool:
    """Whether a TCP connection from ``ns`` opens (the handshake passed both ways); nothing is sent."""
    with socket_in(ns, family_of(ip), socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
            return True
        except OSError:
            return False


def tcp_exchange(ns: str, ip: str, port: int, timeout: float = ALLOW_TIMEOUT) -> bool:
    """Connect from ``ns`` and get one message echoed: the handshake and data passed both ways."""
    with socket_in(ns, family_of(ip), socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
            s.sendall(b"palisade")
            return recv_exact(s, 8) == b"palisade"
        except OSError:
            return False


def udp_exchange(ns: str, ip: str, port: int, timeout: float = ALLOW_TIMEOUT) -> bool:
    """Send one datagram from ``ns`` and get it echoed back (the reply crossed both veths too)."""
    payload = os.urandom(8)
    with socket_in(ns, family_of(ip), socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        try:
            s.sendto(payload, (ip, port))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                data, _ = s.recvfrom(65535)
                if data == payload:
                    return True
        except OSError:
            return False
    return False


def recv_exact(s: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = s.recv(size - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def close_to_time_wait(s: socket.socket) -> None:
    """Close a TCP connection and wait for the server's FIN: the client's end is then in TIME_WAIT, so
    the same 4-tuple can be connected again at once (never while it is still closing)."""
    if s.type == socket.SOCK_STREAM:
        try:
            s.shutdown(socket.SHUT_WR)
            while s.recv(256):
                pass
        except OSError:
            pass
    s.close()


class Stream:
    """A long-lived TCP connection whose liveness is probed with echoed messages."""

    def __init__(self, ns: str, ip: str, port: int) -> None:
        self.sock = socket_in(ns, family_of(ip), socket.SOCK_STREAM)
        self.sock.settimeout(ALLOW_TIMEOUT)
        self.sock.connect((ip, port))
        self._n = 0

    def ping(self, timeout: float = ALLOW_TIMEOUT) -> bool:
        self._n += 1
        msg = f"m{self._n:07d}".encode()
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(msg)
            return recv_exact(self.sock, len(msg)) == msg
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def streams(*targets: tuple[str, str, int]) -> Iterator[list[Stream]]:
    opened = [Stream(*t) for t in targets]
    try:
        yield opened
    finally:
        for s in opened:
            s.close()


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def icmp_echo(ns: str, ip: str, timeout: float = ALLOW_TIMEOUT) -> bool:
    """One ICMP/ICMPv6 echo request from ``ns`` over a raw socket; True if the reply came back."""
    v6 = ipaddress.ip_address(ip).version == 6
    ident = int.from_bytes(os.urandom(2), "big")
    req_type, reply_type = (128, 129) if v6 else (8, 0)
    proto = socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP
    header = struct.pack("!BBHHH", req_type, 0, 0, ident, 1) + b"palisade"
    packet = header if v6 else header[:2] + struct.pack("!H", _checksum(header)) + header[4:]
    with socket_in(ns, family_of(ip), socket.SOCK_RAW, proto) as s:
        s.settimeout(timeout)
        s.sendto(packet, (ip, 0))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                data, _ = s.recvfrom(65535)
                icmp = data if v6 else data[(data[0] & 0x0F) * 4 :]
                if len(icmp) >= 8 and icmp[0] == reply_type and struct.unpack("!H", icmp[4:6])[0] == ident:
                    return True
        except OSError:
            return False
    return False


def sctp_init_packet(sport: int, dport: int, initiate_tag: int) -> bytes:
    """An SCTP common header plus an INIT chunk (RFC 9260 3.3.2), with a valid CRC32c."""
    return Packet(sport, dport, 0, INIT, initiate_tag=initiate_tag).encode()


def sctp_init_crosses(
    src_ns: str, dst_ns: str, dst_ip: str, dport: int, *, dst_ifname: str = "eth0", timeout: float = ALLOW_TIMEOUT
) -> bool:
    """Send a raw SCTP INIT from ``src_ns``; True if it is captured arriving on ``dst_ns``'s interface.

    The kernel here has no SCTP sockets, so the INIT is crafted on a raw IP
    socket and observed with an AF_PACKET socket on the destination's eth0:
    the packet itself crosses both veths and both programs.
    """
    tag = int.from_bytes(os.urandom(4), "big") | 1
    sport = 30000 + (tag % 20000)
    packet = sctp_init_packet(sport, dport, tag)

    def ours(l4: bytes) -> bool:
        if len(l4) < 20:
            return False
        (initiate_tag,) = struct.unpack("!I", l4[16:20])  # after the common header and the chunk header
        return struct.unpack("!HH", l4[:4]) == (sport, dport) and initiate_tag == tag

    return _sctp_capture(src_ns, dst_ns, dst_ip, packet, ours, dst_ifname=dst_ifname, timeout=timeout) is not None


class SctpListener:
    """SCTP servers in one namespace, on raw sockets (the kernel here has no SCTP), as the dev cluster's
    pod servers run them (:class:`services.devstack.sctp.Listener`): every INIT to one of ``ports``
    is answered with an INIT-ACK, on IPv4 and IPv6. An INIT whose CRC32c is wrong is not answered
    (``decode`` checks it), so an answer proves the checksum the receiver saw. One thread serves it."""

    def __init__(self, ns: str, ports: Iterable[int]) -> None:
        self.ports = frozenset(ports)
        self._sel = selectors.DefaultSelector()
        self._socks = [
            socket_in(ns, family, socket.SOCK_RAW, IPPROTO_SCTP) for family in (socket.AF_INET, socket.AF_INET6)
        ]
        for sock in self._socks:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"sctp-{ns}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with contextlib.suppress(OSError):
                    data, addr = sock.recvfrom(65535)
                    if sock.family == socket.AF_INET:
                        data = data[(data[0] & 0x0F) * 4 :]  # an IPv4 raw socket hands over the IP header
                    got = sctp.decode(data)
                    if got is not None and got.chunk_type == INIT and got.vtag == 0 and got.dport in self.ports:
                        sock.sendto(sctp.answer(got).encode(), (addr[0], 0))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._socks:
            sock.close()
        self._sel.close()


def sctp_exchange(ns: str, ip: str, port: int, timeout: float = ALLOW_TIMEOUT) -> bool:
    """An SCTP INIT from ``ns`` to ``ip``:``port`` and its INIT-ACK back, as the dev cluster's prober
    sends it (:func:`services.devstack.sctp.probe`): true only if the answer comes from ``ip`` with the
    ports reversed, our tag and a correct CRC32c."""
    answered: bool = in_netns(ns, asyncio.run, sctp.probe(ip, port, timeout))
    return answered


def sctp_packet(sport: int, dport: int, vtag: int, data_len: int, *, checksum: bool = True) -> bytes:
    """An SCTP packet with one DATA chunk of ``data_len`` payload bytes (random), with its CRC32c
    (``checksum`` false: a zero checksum field, as a sender leaving it to the offload has it)."""
    payload = os.urandom(data_len)
    chunk = struct.pack("!BBHIHHI", 0, 0x03, 16 + data_len, 1, 0, 0, 0) + payload + bytes(-data_len % 4)
    packet = struct.pack("!HHI", sport, dport, vtag) + bytes(4) + chunk
    if not checksum:
        return packet
    return packet[:8] + struct.pack("<I", sctp.crc32c(packet)) + packet[12:]


def sctp_crc_ok(l4: bytes) -> bool:
    """Whether an SCTP packet's CRC32c matches its contents."""
    (stored,) = struct.unpack("<I", l4[8:12])
    return bool(stored == sctp.crc32c(l4[:8] + bytes(4) + l4[12:]))


def sctp_arrival(
    src_ns: str, dst_ns: str, dst_ip: str, packet: bytes, *, dst_ifname: str = "eth0", timeout: float = ALLOW_TIMEOUT
) -> bytes | None:
    """Send the SCTP ``packet`` (header and chunks) from ``src_ns`` to ``dst_ip`` on a raw socket; the
    SCTP packet as it arrives on ``dst_ns``'s interface (same source port and verification tag; its
    destination port may differ: a Service translates it), or None if it never does."""
    sport, vtag = struct.unpack("!H", packet[:2])[0], struct.unpack("!I", packet[4:8])[0]

    def ours(l4: bytes) -> bool:
        return len(l4) >= 12 and struct.unpack("!HHI", l4[:8])[::2] == (sport, vtag)

    return _sctp_capture(src_ns, dst_ns, dst_ip, packet, ours, dst_ifname=dst_ifname, timeout=timeout)


def _sctp_capture(
    src_ns: str,
    dst_ns: str,
    dst_ip: str,
    packet: bytes,
    ours: Callable[[bytes], bool],
    *,
    dst_ifname: str,
    timeout: float,
) -> bytes | None:
    """Send the SCTP ``packet`` from ``src_ns`` to ``dst_ip`` on a raw socket while capturing on
    ``dst_ns``'s interface; the first SCTP packet arriving there that ``ours`` accepts, or None by
    ``timeout``."""
    cap = socket_in(dst_ns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    with cap, socket_in(src_ns, family_of(dst_ip), socket.SOCK_RAW, IPPROTO_SCTP) as tx:
        cap.bind((dst_ifname, ETH_P_ALL))
        cap.settimeout(0.05)
        tx.sendto(packet, (dst_ip, 0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                frame = cap.recv(65535)
            except TimeoutError:
                continue
            l4 = _sctp_of(frame)
            if l4 is not None and ours(l4):
                return l4
    return None


def _sctp_of(frame: bytes) -> bytes | None:
    """The SCTP packet in an Ethernet frame (up to the IP packet's end), or None."""
    ethertype = struct.unpack("!H", frame[12:14])[0]
    if ethertype == 0x86DD and frame[14 + 6] == IPPROTO_SCTP:
        return frame[14 + 40 : 14 + 40 + struct.unpack("!H", frame[18:20])[0]]
    if ethertype == 0x0800 and frame[14 + 9] == IPPROTO_SCTP:
        return frame[14 + (frame[14] & 0x0F) * 4 : 14 + struct.unpack("!H", frame[16:18])[0]]
    return None


#: tc verdicts a program returns, and TCP flags, for frames run through BPF_PROG_TEST_RUN.
TC_ACT_OK = 0
TC_ACT_SHOT = 2
#: bpf_redirect_peer's code: from_container passed a packet to another local endpoint, whose
#: ingress policy (run in deliver) passed it too.
TC_ACT_REDIRECT = 7
FIN, SYN, ACK = 0x01, 0x02, 0x10


def tc_frame(src: str, dst: str, sport: int, dport: int, proto: int, tcp_flags: int = 0, ttl: int = 64) -> bytes:
    """A 64-byte IPv4 Ethernet frame for BPF_PROG_TEST_RUN (checksums zero: the programs do not check them)."""
    payload = bytes(64 - 14 - 20 - (20 if proto == socket.IPPROTO_TCP else 8))
    if proto == socket.IPPROTO_TCP:
        l4 = struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, tcp_flags, 65535, 0, 0) + payload
    else:
        l4 = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, ttl, proto, 0, socket.inet_aton(src), socket.inet_aton(dst)
    )
    return b"\x02" * 6 + b"\x04" * 6 + struct.pack("!H", 0x0800) + ip + l4


PACKET_OUTGOING = 4


@contextlib.contextmanager
def host_sent(between: Sequence[Pod], *into: Pod) -> Iterator[Callable[[], int]]:
    """Counts the IP packets among the pods ``between`` that the host sends into the pods ``into``
    through their veths (what the host's forwarding delivers; a packet delivered straight into a
    pod's namespace never shows there), seen by packet sockets on those veths. Other traffic there
    (the host's neighbour discovery) is not counted. ``count()`` returns what came since the last."""
    addresses = {ipaddress.ip_address(ip).packed for pod in between for ip in pod.net.ips}
    taps = []
    try:
        for pod in into:
            tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            taps.append(tap)
            tap.bind((pod.net.host_ifname, 0x0003))
            tap.setblocking(False)

        def count() -> int:
            seen = 0
            for tap in taps:
                while True:
                    try:
                        frame, address = tap.recvfrom(65535)
                    except BlockingIOError:
                        break
                    if address[2] == PACKET_OUTGOING and _between_pods(frame, addresses):
                        seen += 1
            return seen

        yield count
    finally:
        for tap in taps:
            tap.close()


def _between_pods(frame: bytes, addresses: set[bytes]) -> bool:
    ethertype = struct.unpack("!H", frame[12:14])[0]
    if ethertype == 0x0800:
        src, dst = frame[26:30], frame[30:34]
    elif ethertype == 0x86DD:
        src, dst = frame[22:38], frame[38:54]
    else:
        return False
    return src in addresses and dst in addresses
