"""SCTP's first handshake step on raw sockets, for kernels without SCTP (RFC 9260).

An association starts INIT -> INIT-ACK; a policy that drops SCTP to a port drops the
INIT (or its answer), so "the INIT-ACK came back" is exactly "SCTP to this port is
allowed". Kernels built without SCTP cannot open SCTP sockets, but raw IP sockets of
protocol 132 work, and a kernel without SCTP never answers an INIT itself (no ABORT),
so the prober and the pod servers speak this step themselves: packets with real
CRC32c checksums, through the same veths and BPF programs as any other traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

IPPROTO_SCTP = 132
INIT = 1
INIT_ACK = 2
ABORT = 6
STATE_COOKIE = 7

_HEADER = struct.Struct("!HHI")  # source port, destination port, verification tag (then the CRC32c)
_INIT_BODY = struct.Struct("!IIHHI")  # initiate tag, a_rwnd, outbound streams, inbound streams, initial TSN


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC32c (Castagnoli), SCTP's checksum."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Packet:
    """One SCTP packet with one chunk: what an INIT or INIT-ACK exchange needs."""

    sport: int
    dport: int
    vtag: int
    chunk_type: int
    #: INIT and INIT-ACK: the sender's initiate tag (the vtag its peer must use).
    initiate_tag: int = 0
    #: INIT-ACK's State Cookie parameter.
    cookie: bytes = b""

    def encode(self) -> bytes:
        if self.chunk_type in (INIT, INIT_ACK):
            body = _INIT_BODY.pack(self.initiate_tag, 65535, 1, 1, self.initiate_tag)
            if self.chunk_type == INIT_ACK:
                param = struct.pack("!HH", STATE_COOKIE, 4 + len(self.cookie)) + self.cookie
                body += param + b"\0" * (-len(param) % 4)
        else:
            body = b""
        chunk = struct.pack("!BBH", self.chunk_type, 0, 4 + len(body)) + body
        without = _HEADER.pack(self.sport, self.dport, self.vtag) + b"\0\0\0\0" + chunk
        # The checksum covers the packet with its own field zeroed and goes on the wire little-endian.
        return without[:8] + struct.pack("<I", crc32c(without)) + without[12:]


def decode(data: bytes) -> Packet | None:
    """The packet's first chunk, or None when it is not a well-formed SCTP packet with a good checksum."""
    if len(data) < 16:
        return None
    (checksum,) = struct.unpack("<I", data[8:12])
    if crc32c(data[:8] + b"\0\0\0\0" + data[12:]) != checksum:
        return None
    sport, dport, vtag = _HEADER.unpack(data[:8])
    chunk_type, _, length = struct.unpack("!BBH", data[12:16])
    if length < 4 or 12 + length > len(data):
        return None
    initiate_tag, cookie = 0, b""
    if chunk_type in (INIT, INIT_ACK):
        if length < 4 + _INIT_BODY.size:
            return None
        initiate_tag = _INIT_BODY.unpack(data[16 : 16 + _INIT_BODY.size])[0]
        params = data[16 + _INIT_BODY.size : 12 + length]
        while len(params) >= 4:
            ptype, plen = struct.unpack("!HH", params[:4])
            if plen < 4:
                break
            if ptype == STATE_COOKIE:
                cookie = params[4:plen]
            params = params[plen + (-plen % 4) :]
    return Packet(sport, dport, vtag, chunk_type, initiate_tag, cookie)


def answer(init: Packet) -> Packet:
    """The INIT-ACK a listener sends back for ``init``."""
    return Packet(
        sport=init.dport,
        dport=init.sport,
        vtag=init.initiate_tag,
        chunk_type=INIT_ACK,
        initiate_tag=_tag(),
        cookie=os.urandom(16),
    )


def kernel_has_sctp() -> bool:
    """Whether this kernel opens SCTP sockets (then the real protocol is used instead)."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, IPPROTO_SCTP).close()
    except OSError:
        return False
    return True


def _tag() -> int:
    return int.from_bytes(os.urandom(4), "big") | 1  # never 0: 0 means "no tag yet"


def _payload(family: int, data: bytes) -> bytes:
    # An IPv4 raw socket hands over the IP header too; an IPv6 one does not.
    return data[(data[0] & 0x0F) * 4 :] if family == socket.AF_INET and data else data


async def _recv(sock: socket.socket) -> tuple[bytes, str]:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[bytes, str]] = loop.create_future()

    def readable() -> None:
        try:
            data, addr = sock.recvfrom(65535)
        except BlockingIOError:
            return
        except OSError as exc:
            if not got.done():
                got.set_exception(exc)
            return
        if not got.done():
            got.set_result((data, str(addr[0])))

    loop.add_reader(sock.fileno(), readable)
    try:
        return await got
    finally:
        loop.remove_reader(sock.fileno())


async def probe(ip: str, port: int, timeout: float, attempts: int = 3) -> bool:
    """Send an INIT to ``ip``:``port``; True when the matching INIT-ACK comes back within ``timeout``."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_RAW, IPPROTO_SCTP)
    sock.setblocking(False)
    tag = _tag()
    sport = 32768 + tag % 28000
    init = Packet(sport, port, 0, INIT, initiate_tag=tag).encode()
    want = ipaddress.ip_address(ip)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        for attempt in range(attempts):
            # A few INITs, as SCTP retransmits one: the first may be lost while neighbours resolve.
            sock.sendto(init, (ip, 0))
            until = min(deadline, loop.time() + timeout / attempts) if attempt < attempts - 1 else deadline
            while (left := until - loop.time()) > 0:
                try:
                    data, source = await asyncio.wait_for(_recv(sock), left)
                except TimeoutError:
                    break
                got = decode(_payload(family, data))
                if (
                    got is not None
                    and got.chunk_type == INIT_ACK
                    and ipaddress.ip_address(source) == want
                    and (got.sport, got.dport, got.vtag) == (port, sport, tag)
                ):
                    sock.sendto(Packet(sport, port, got.initiate_tag, ABORT).encode(), (ip, 0))
                    return True
        return False
    finally:
        sock.close()


class Listener:
    """Answers every INIT to one of ``ports`` with an INIT-ACK, on IPv4 and IPv6 (asyncio readers)."""

    def __init__(self, ports: Iterable[int]) -> None:
        self.ports = frozenset(ports)
        self._socks: list[tuple[int, socket.socket]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for family in (socket.AF_INET, socket.AF_INET6):
            sock = socket.socket(family, socket.SOCK_RAW, IPPROTO_SCTP)
            sock.setblocking(False)
            self._socks.append((family, sock))
            loop.add_reader(sock.fileno(), self._readable, family, sock)

    def _readable(self, family: int, sock: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                data, addr = sock.recvfrom(65535)
                got = decode(_payload(family, data))
                if got is not None and got.chunk_type == INIT and got.vtag == 0 and got.dport in self.ports:
                    with contextlib.suppress(OSError):
                        sock.sendto(answer(got).encode(), (addr[0], 0))

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for _, sock in self._socks:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._socks = []
