"""Startup retries with exponential backoff, shared by the NATS and etcd helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.backoff import Backoff
from services.common.log import get_logger

T = TypeVar("T")

#: Longest wait between two startup attempts, seconds.
MAX_STARTUP_BACKOFF = 5.0

log = get_logger("retry")


class StartupError(RuntimeError):
    """A dependency could not be reached; the message says which and what to do."""


async def with_retries(
    what: str,
    address: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    retries: int,
    backoff: float,
    hint: str,
) -> T:
    """Call ``attempt`` until it succeeds, ``retries`` times at most, doubling the wait from ``backoff`` up to 5 s."""
    delays = Backoff(backoff, max(backoff, MAX_STARTUP_BACKOFF))
    last: BaseException | None = None
    for n in range(1, max(1, retries) + 1):
        try:
            return await attempt()
        except Exception as exc:  # client libraries wrap socket errors in their own types
            last = exc
        log.warning("dependency not reachable yet", what=what, address=address, attempt=n, error=str(last))
        if n < retries:
            await delays.sleep()
    raise StartupError(f"cannot reach {what} at {address} after {retries} attempts ({last}); {hint}")


async def tcp_probe(host: str, port: int, timeout: float = 2.0) -> None:
    """Open and close a TCP connection, raising OSError if nothing listens."""
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
