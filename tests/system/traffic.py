"""Counted TCP connections from inside one pod, for fault tests: what was allowed got through, what was denied did not.

    python -m tests.system.traffic --netns /run/netns/x --allowed 10.0.0.2:8080 --denied 10.0.0.3:5432

Keeps opening connections to each target (several in flight per target) until its stdin
closes, then prints {"allowed_ok", "allowed_failed", "denied_blocked", "denied_admitted"}.
An allowed connection fails when it does not open within ALLOWED_TIMEOUT; a denied one is
admitted when it opens at all (a policy's drop makes it time out after DENIED_TIMEOUT).
The first line, "ready", says the counting has begun.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter

from services.devstack.netnsexec import enter

ALLOWED_TIMEOUT = 3.0
DENIED_TIMEOUT = 0.3
IN_FLIGHT = 8


async def _connect(ip: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def _worker(target: str, allowed: bool, counts: Counter[str], stop: asyncio.Event) -> None:
    ip, _, port = target.rpartition(":")
    timeout = ALLOWED_TIMEOUT if allowed else DENIED_TIMEOUT
    while not stop.is_set():
        opened = await _connect(ip.strip("[]"), int(port), timeout)
        if allowed:
            counts["allowed_ok" if opened else "allowed_failed"] += 1
        else:
            counts["denied_admitted" if opened else "denied_blocked"] += 1
        if allowed and opened:
            await asyncio.sleep(0.01)  # a steady trickle, not a flood


async def run(allowed: list[str], denied: list[str]) -> Counter[str]:
    counts: Counter[str] = Counter(allowed_ok=0, allowed_failed=0, denied_blocked=0, denied_admitted=0)
    stop = asyncio.Event()
    workers = [
        asyncio.create_task(_worker(t, ok, counts, stop))
        for ok, targets in ((True, allowed), (False, denied))
        for t in targets
        for _ in range(IN_FLIGHT)
    ]
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    stop.set()
    await asyncio.gather(*workers)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.system.traffic")
    p.add_argument("--netns", required=True)
    p.add_argument("--allowed", action="append", default=[], metavar="IP:PORT")
    p.add_argument("--denied", action="append", default=[], metavar="IP:PORT")
    args = p.parse_args(argv)
    enter(args.netns)
    json.dump(dict(asyncio.run(run(args.allowed, args.denied))), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
