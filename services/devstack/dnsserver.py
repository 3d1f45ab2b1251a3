"""The dev cluster's outside-world DNS server: ``python -m services.devstack.dnsserver --zone FILE --listen ADDR``.

An authoritative server for the names its zone file lists (A and AAAA records from a table,
over UDP and TCP); any other name is NXDOMAIN. It stands for the DNS of the world outside the
cluster (and for cluster DNS: pods resolve through it), never for Palisade: a pod's query
reaches it through the pod's node, whose DNS proxy judges it when a DNS rule selects it.

The zone file is YAML (see :func:`parse_zone`) and is read at every query (parsed again when
it changed), so whoever edits it (a user, a test) changes the world while it serves: an
address changed at TTL expiry, many addresses for one name. A file that cannot be used is
logged with what is wrong and what to do, and the last valid table keeps being served.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import signal
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import yaml

from services.common.log import get_logger, setup_logging

log = get_logger("devdns")

#: TTL of a name whose entry gives none, in seconds.
DEFAULT_TTL = 30


class ZoneError(ValueError):
    """The zone file is not a table of names: the message names the entry and what to write."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What one name resolves to: its addresses (IPv4 and IPv6 together) and their TTL in seconds."""

    addresses: tuple[str, ...]
    ttl: int = DEFAULT_TTL


class Entry(Protocol):
    """What :func:`answer` reads of a name's entry (a :class:`Record`, or a test's own)."""

    @property
    def addresses(self) -> Sequence[str]: ...

    @property
    def ttl(self) -> int: ...


Table = Mapping[str, Entry]


def parse_zone(text: str, source: str = "zone") -> dict[str, Record]:
    """The table of a zone file (pure). Its form::

        names:
          api.example.test: {addresses: [192.0.2.10], ttl: 5}
          s3.example.test:
            addresses: [203.0.113.1, 203.0.113.2, 2001:db8::1]

    Names compare case-insensitively, without the trailing dot. An unknown key, a name with no
    address or a bad address or TTL raises :class:`ZoneError` naming it.
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ZoneError(f"{source}: not YAML ({exc}); write a mapping with the key 'names'") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or set(doc) - {"names"}:
        extra = sorted(set(doc) - {"names"}) if isinstance(doc, dict) else []
        raise ZoneError(f"{source}: unknown key(s) {extra}: the file holds one mapping, 'names'")
    names = doc.get("names") or {}
    if not isinstance(names, dict):
        raise ZoneError(f"{source}: names: a mapping of name to {{addresses: [...], ttl: N}}")
    table: dict[str, Record] = {}
    for raw_name, entry in names.items():
        where = f"{source}: names.{raw_name}"
        name = str(raw_name).rstrip(".").lower()
        if not name:
            raise ZoneError(f"{where}: an empty name")
        table[name] = _record(entry, where)
    return table


def _record(entry: Any, where: str) -> Record:
    if not isinstance(entry, dict) or set(entry) - {"addresses", "ttl"}:
        raise ZoneError(f"{where}: write {{addresses: [IP, ...], ttl: SECONDS}} (unknown or missing keys)")
    addresses = entry.get("addresses")
    if not isinstance(addresses, list) or not addresses:
        raise ZoneError(f"{where}.addresses: a non-empty list of IP addresses")
    parsed = []
    for i, address in enumerate(addresses):
        try:
            parsed.append(str(ipaddress.ip_address(str(address))))
        except ValueError:
            raise ZoneError(f"{where}.addresses[{i}]: {address!r} is not an IP address") from None
    ttl = entry.get("ttl", DEFAULT_TTL)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 0 <= ttl <= 2**31 - 1:
        raise ZoneError(f"{where}.ttl: {ttl!r}: seconds, a whole number from 0")
    return Record(tuple(parsed), ttl)


def render_zone(table: Table, comment: str = "") -> str:
    """A zone file holding ``table`` (what :func:`parse_zone` reads back)."""
    names = {name: {"addresses": list(r.addresses), "ttl": r.ttl} for name, r in table.items()}
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    return head + yaml.safe_dump({"names": names}, sort_keys=False)


def answer(table: Table, wire: bytes) -> tuple[str, bytes] | None:
    """The question's name and the response to the query ``wire`` (pure); None when it is no query.

    A name of the table: its addresses of the asked family (A: IPv4, AAAA: IPv6; none of that
    family is an empty answer, NOERROR); any other name: NXDOMAIN.
    """
    try:
        query = dns.message.from_wire(wire)
    except dns.exception.DNSException:
        return None
    if not query.question:
        return None
    response = dns.message.make_response(query)
    response.flags |= dns.flags.AA
    question = query.question[0]
    name = question.name.to_text(omit_final_dot=True).lower()
    record = table.get(name)
    if record is None:
        response.set_rcode(dns.rcode.NXDOMAIN)
        return name, response.to_wire()
    if question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        version = 4 if question.rdtype == dns.rdatatype.A else 6
        found = [a for a in record.addresses if ipaddress.ip_address(a).version == version]
        if found:
            rdtype = "A" if version == 4 else "AAAA"
            response.answer.append(dns.rrset.from_text_list(question.name, record.ttl, "IN", rdtype, found))
    return name, response.to_wire()


class ZoneFile:
    """The table of a zone file, parsed again when its bytes changed (read at every call: a zone file is
    small, and no edit is missed however quickly it follows the last)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: bytes | None = None
        self._table: dict[str, Record] = {}

    def table(self) -> Table:
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            if self._seen is not None:
                log.error("zone file unreadable; serving its last table", path=str(self.path), error=str(exc))
                self._seen = None
            return self._table
        if raw != self._seen:
            self._seen = raw
            try:
                self._table = parse_zone(raw.decode("utf-8", errors="replace"), str(self.path))
                log.info("zone loaded", path=str(self.path), names=len(self._table))
            except ZoneError as exc:
                log.error("zone file not used; serving its last valid table", error=str(exc))
        return self._table


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, zone: ZoneFile) -> None:
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        got = answer(self.zone.table(), data)
        if got is not None and self.transport is not None:
            log.debug("query answered", name=got[0], client=addr[0], protocol="udp")
            self.transport.sendto(got[1], addr)


async def serve(zone: ZoneFile, address: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Answer on ``address``:``port`` (UDP and TCP) until cancelled."""

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                got = answer(zone.table(), await reader.readexactly(size))
                if got is None:
                    break
                log.debug("query answered", name=got[0], protocol="tcp")
                writer.write(struct.pack("!H", len(got[1])) + got[1])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(zone), local_addr=(address, port))
    tcp = await asyncio.start_server(on_tcp, host=address, port=port, reuse_address=True)
    zone.table()
    log.info("DNS server listening", address=address, port=port, zone=str(zone.path))
    if ready is not None:
        ready.set()
    try:
        await asyncio.Future()
    finally:
        udp.close()
        tcp.close()


async def _main(args: argparse.Namespace) -> None:
    task = asyncio.create_task(serve(ZoneFile(Path(args.zone)), args.listen, args.port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.devstack.dnsserver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--zone", required=True, help="the zone file (YAML: names: {NAME: {addresses: [...], ttl: N}})")
    p.add_argument("--listen", required=True, help="the address to answer on")
    p.add_argument("--port", type=int, default=53)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    setup_logging(args.log_level, "json")
    try:
        asyncio.run(_main(args))
    except OSError as exc:
        print(f"dnsserver: cannot listen on {args.listen}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
