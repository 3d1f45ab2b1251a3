"""The servers a dev-node pod runs on its ports: TCP greets with the pod's name then echoes, UDP answers
with the name.

    python -m services.devstack.podserver --netns /run/netns/x --name shop/db --tcp 5432 --udp 9125

SCTP listens with the kernel's SCTP where it has it; otherwise raw sockets answer each
INIT to a served port with an INIT-ACK (see :mod:`services.devstack.sctp`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

from services.devstack import sctp as raw_sctp
from services.devstack.netnsexec import enter


async def serve(name: str, tcp: list[int], udp: list[int], sctp: list[int]) -> None:
    greeting = f"{name}\n".encode()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(greeting)
            await writer.drain()
            # Then echo what the client sends: a long connection can prove it still works both ways.
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            self.transport.sendto(greeting, addr)  # type: ignore[attr-defined]

    loop = asyncio.get_running_loop()
    servers = []
    for port in tcp:
        servers.append(await asyncio.start_server(on_conn, host=None, port=port, reuse_address=True))
    for port in udp:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
        await loop.create_datagram_endpoint(Echo, sock=sock)
    if sctp and not raw_sctp.kernel_has_sctp():
        raw_sctp.Listener(sctp).start()
        sctp = []
    for port in sctp:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", port))
        s.listen(16)
        servers.append(await asyncio.start_server(on_conn, sock=s))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.devstack.podserver")
    p.add_argument("--netns", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--tcp", type=int, action="append", default=[])
    p.add_argument("--udp", type=int, action="append", default=[])
    p.add_argument("--sctp", type=int, action="append", default=[])
    args = p.parse_args(argv)
    enter(args.netns)
    asyncio.run(serve(args.name, sorted(set(args.tcp)), sorted(set(args.udp)), sorted(set(args.sctp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
