"""Probe destinations from inside one pod's network namespace, with real packets.

    python -m services.devstack.prober --netns /run/netns/x --timeout 1.5 < targets.json

Reads a JSON list of {"id", "ip", "port", "protocol"} on stdin and prints a JSON object
{id: allowed}. A target may give "name" instead of "ip": the prober resolves it first, as the
pod's resolver would, through the server ``--resolver`` names (an A query over UDP, retried once),
and connects to the answer's first address; a name that does not resolve is not reached.
TCP: the connection is established and the server's greeting arrives. UDP: the server's echo
arrives. SCTP: the association comes up or, on kernels without SCTP, the server's INIT-ACK
answers a raw INIT (see :mod:`services.devstack.sctp`).
Every target is probed concurrently, so denied ones cost one timeout in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from typing import Any

import dns.asyncquery
import dns.exception
import dns.message
import dns.rcode
import dns.rdatatype

from services.devstack import sctp
from services.devstack.netnsexec import enter


async def probe_tcp(ip: str, port: int, timeout: float) -> bool:
    # Several short attempts rather than one long one: a first SYN lost while the
    # neighbour entry resolves would otherwise wait for the kernel's 1 s retransmit.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), min(remaining, 0.4))
            break
        except TimeoutError:
            continue
        except OSError:
            return False
    try:
        data = await asyncio.wait_for(reader.readline(), timeout)
        return bool(data)
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


async def probe_udp(ip: str, port: int, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bool] = loop.create_future()

    class Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: Any) -> None:
            if not got.done():
                got.set_result(True)

        def error_received(self, exc: Exception) -> None:
            pass

    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    transport, _ = await loop.create_datagram_endpoint(Client, remote_addr=(ip, port), family=family)
    try:
        # A few datagrams, in case the first is lost while neighbours resolve.
        for _ in range(3):
            transport.sendto(b"probe")
            try:
                return await asyncio.wait_for(asyncio.shield(got), timeout / 3)
            except TimeoutError:
                continue
        return False
    finally:
        transport.close()


async def probe_sctp(ip: str, port: int, timeout: float) -> bool:
    if not sctp.kernel_has_sctp():
        return await sctp.probe(ip, port, timeout)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (ip, port)), timeout)
        return True
    except (OSError, TimeoutError):
        return False
    finally:
        sock.close()


async def resolve(resolver: str, name: str, timeout: float) -> list[str]:
    """The IPv4 addresses ``name`` has, asked of ``resolver`` as a stub resolver does; [] if none came."""
    query = dns.message.make_query(name, dns.rdatatype.A)
    for _ in range(2):  # as a stub resolver: a second try when the first is lost
        try:
            response = await dns.asyncquery.udp(query, resolver, timeout=timeout / 2)
        except (dns.exception.Timeout, OSError):
            continue
        if response.rcode() != dns.rcode.NOERROR:
            return []
        return [rd.address for rrset in response.answer if rrset.rdtype == dns.rdatatype.A for rd in rrset]
    return []


PROBES = {"TCP": probe_tcp, "UDP": probe_udp, "SCTP": probe_sctp}


async def run(targets: list[dict[str, Any]], timeout: float, resolver: str = "") -> dict[str, bool]:
    async def one(t: dict[str, Any]) -> tuple[str, bool]:
        ip = str(t.get("ip") or "")
        if not ip:
            if not resolver:
                raise RuntimeError(f"target {t['id']!r} names {t.get('name')!r}: give --resolver")
            found = await resolve(resolver, str(t["name"]), timeout)
            if not found:
                return str(t["id"]), False
            ip = found[0]
        return str(t["id"]), await PROBES[str(t["protocol"]).upper()](ip, int(t["port"]), timeout)

    return dict(await asyncio.gather(*(one(t) for t in targets)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.devstack.prober")
    p.add_argument("--netns", required=True)
    p.add_argument("--timeout", type=float, default=1.5)
    p.add_argument("--resolver", default="", help="the DNS server targets given by name are resolved through")
    args = p.parse_args(argv)
    targets = json.load(sys.stdin)
    enter(args.netns)
    try:
        result = asyncio.run(run(targets, args.timeout, args.resolver))
    except RuntimeError as exc:
        print(f"prober: {exc}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
