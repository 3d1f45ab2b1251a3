"""A small authoritative DNS server answering A/AAAA queries from a table, UDP and TCP.

Its answers are the dev cluster's world DNS server's (:func:`services.devstack.dnsserver.answer`);
this one is served by an asyncio loop the caller runs, its sockets made in a network namespace
(the "outside world" of a test). Names not in the table get NXDOMAIN. The table can change in
place while it serves (an address change at TTL expiry), and it counts the queries it saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Callable

import dns.message

from services.devstack import dnsserver as devdns
from testkit.traffic import socket_in


@dataclasses.dataclass
class Record:
    addresses: list[str]
    ttl: int = 60


class DnsServer:
    def __init__(self, ns: str, address: str, port: int = 53) -> None:
        self.ns = ns
        self.address = address
        self.port = port
        self.table: dict[str, Record] = {}
        self.queries: list[str] = []
        self._udp: socket.socket | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self) -> None:
        family = socket.AF_INET6 if ipaddress.ip_address(self.address).version == 6 else socket.AF_INET
        udp = socket_in(self.ns, family, socket.SOCK_DGRAM)
        udp.bind((self.address, self.port))
        udp.setblocking(False)
        self._udp = udp
        loop = asyncio.get_running_loop()
        loop.add_reader(udp.fileno(), self._on_udp)
        tcp = socket_in(self.ns, family, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((self.address, self.port))
        tcp.listen(64)
        tcp.setblocking(False)
        self._tcp = await asyncio.start_server(self._on_tcp, sock=tcp)

    async def stop(self) -> None:
        if self._udp is not None:
            asyncio.get_running_loop().remove_reader(self._udp.fileno())
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()

    def answer(self, wire: bytes) -> bytes:
        """The response to ``wire`` (b"": not a query, nothing is sent)."""
        got = devdns.answer(self.table, wire)
        if got is None:
            return b""
        self.queries.append(got[0])
        return got[1]

    def _on_udp(self) -> None:
        assert self._udp is not None
        try:
            data, client = self._udp.recvfrom(65535)
        except BlockingIOError:
            return
        reply = self.answer(data)
        if reply:
            self._udp.sendto(reply, client)

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                reply = self.answer(await reader.readexactly(size))
                if not reply:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def stub_query(ns: str, server: str, name: str, timeout: float = 1.0) -> dns.message.Message | None:
    """A lookup as a stub resolver makes it: ``timeout`` for the answer, then one retry."""
    return query(ns, server, name, timeout=timeout) or query(ns, server, name, timeout=timeout)


class SteadyLookups:
    """A client in ``ns`` that resolves ``name`` as a stub resolver does and connects to the answer,
    again and again in a thread while the ``with`` block runs (the kill -9 tests' load): the rounds
    made, and each lookup or connection that failed."""

    def __init__(self, ns: str, server: str, name: str, want: list[str], connect: Callable[[str], bool]) -> None:
        self._args = (ns, server, name)
        self._want = want
        self._connect = connect
        self.rounds = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._run, name="steady-lookups")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rounds += 1
            got = addresses(stub_query(*self._args))  # one client retry
            if got != self._want:
                self.failures.append(f"lookup {self.rounds}")
            elif not self._connect(got[0]):
                self.failures.append(f"connection {self.rounds}")
            time.sleep(0.05)

    def __enter__(self) -> SteadyLookups:
        self._worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._worker.join()

    # On an event loop that serves the lookups (an in-process DNS server): joined off the loop.
    async def __aenter__(self) -> SteadyLookups:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.to_thread(self._worker.join)


def query(
    ns: str, server: str, name: str, *, tcp: bool = False, rdtype: str = "A", timeout: float = 3.0
) -> dns.message.Message | None:
    """A lookup from namespace ``ns`` (as a pod's resolver sends it); None if nothing came back."""
    message = dns.message.make_query(name, rdtype)
    wire = message.to_wire()
    family = socket.AF_INET6 if ipaddress.ip_address(server).version == 6 else socket.AF_INET
    with socket_in(ns, family, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        try:
            if tcp:
                s.connect((server, 53))
                s.sendall(struct.pack("!H", len(wire)) + wire)
                size = struct.unpack("!H", _exact(s, 2))[0]
                raw = _exact(s, size)
            else:
                s.sendto(wire, (server, 53))
                raw = s.recv(65535)
        except OSError:
            return None
    return dns.message.from_wire(raw)


def _exact(s: socket.socket, size: int) -> bytes:
    out = b""
    while len(out) < size:
        chunk = s.recv(size - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def addresses(response: dns.message.Message | None) -> list[str]:
    if response is None:
        return []
    return [rd.address for rrset in response.answer for rd in rrset]
