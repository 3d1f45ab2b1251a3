"""The load of the tuple-reuse soak, run inside one pod's network namespace.

    python -m bench.reuse_load --netns /run/netns/x --direct 10.244.0.3:7000 \
        --service 10.96.0.12:80 --rate 100 --seconds 600
    python -m bench.reuse_load --netns /run/netns/y --denied 10.244.1.4:5432 --seconds 600

Opens ``--rate`` new TCP connections a second to each target (``--direct``: the backend's pod
address, ``--service``: its ClusterIP), each on a port the kernel picks, each expected to open
and deliver the pod server's greeting within ``--timeout``; keeps one long-lived connection
through the ClusterIP, echoing once a second; and, with ``--denied``, keeps opening connections
to a target the policy denies (each must time out). Prints one JSON object of counts at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter

from services.devstack.netnsexec import enter


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


async def _greeted(target: tuple[str, int], timeout: float) -> str:
    """ "" when a connection opened and the server's greeting line came back (the handshake and data
    both ways), else what went wrong: "connect timeout", "greeting timeout", or the error's name."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout)
    except TimeoutError:
        return "connect timeout"
    except OSError as exc:
        return f"connect {type(exc).__name__}"
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
        return "" if line.endswith(b"\n") else "closed before the greeting"
    except TimeoutError:
        return "greeting timeout"
    except OSError as exc:
        return f"greeting {type(exc).__name__}"
    finally:
        writer.close()


#: When (seconds into the run) each allowed connection failed, its path and what went wrong.
FAILURES: list[tuple[float, str, str]] = []
STARTED = time.monotonic()


async def _paced(
    name: str, target: tuple[str, int], rate: float, timeout: float, until: float, counts: Counter[str]
) -> None:
    """``rate`` new connections a second, each in a task of its own (a slow one never delays the next)."""
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        opened = time.monotonic()
        error = await _greeted(target, timeout)
        counts[f"{name}_failed" if error else f"{name}_ok"] += 1
        if error:
            FAILURES.append((round(opened - STARTED, 3), name, error))

    start = time.monotonic()
    n = 0
    while time.monotonic() < until:
        task = asyncio.create_task(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
        n += 1
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
    if pending:
        await asyncio.wait(pending)


async def _denied(target: tuple[str, int], until: float, counts: Counter[str]) -> None:
    while time.monotonic() < until:
        admitted = not await _greeted(target, 0.3)
        counts["denied_admitted" if admitted else "denied_blocked"] += 1
        await asyncio.sleep(0.02)


async def _long_lived(target: tuple[str, int], timeout: float, until: float, counts: Counter[str]) -> None:
    """One connection for the whole run, through the ClusterIP: an echo a second must come back."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout)
    await asyncio.wait_for(reader.readline(), timeout)  # the greeting
    n = 0
    try:
        while time.monotonic() < until:
            n += 1
            msg = f"long-{n}\n".encode()
            try:
                writer.write(msg)
                await writer.drain()
                ok = await asyncio.wait_for(reader.readline(), timeout) == msg
            except (OSError, TimeoutError):
                ok = False
            counts["long_ok" if ok else "long_failed"] += 1
            if not ok:
                return  # a broken long-lived connection stays broken: counted once
            await asyncio.sleep(1)
    finally:
        writer.close()


async def run(args: argparse.Namespace) -> Counter[str]:
    counts: Counter[str] = Counter()
    until = time.monotonic() + args.seconds
    jobs = []
    if args.direct:
        jobs.append(_paced("direct", _split(args.direct), args.rate, args.timeout, until, counts))
    if args.service:
        service = _split(args.service)
        jobs.append(_paced("service", service, args.rate, args.timeout, until, counts))
        jobs.append(_long_lived(service, args.timeout, until, counts))
    if args.denied:
        counts["denied_blocked"] = counts["denied_admitted"] = 0
        jobs.append(_denied(_split(args.denied), until, counts))
    await asyncio.gather(*jobs)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netns", required=True)
    p.add_argument("--direct", help="the backend's pod address and port")
    p.add_argument("--service", help="its ClusterIP and port (also the long-lived connection's)")
    p.add_argument("--denied", help="a target the policy denies (ADDRESS:PORT)")
    p.add_argument("--rate", type=float, default=100.0, help="new connections a second, per path")
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=1.0, help="seconds an allowed connection may take")
    args = p.parse_args(argv)
    enter(args.netns)
    counts = dict(asyncio.run(run(args)))
    print(json.dumps({**counts, "failures": FAILURES[:500]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
