"""The one way Palisade retries: attempts, a deadline, a final action, and throttled logs.

:func:`retry` awaits a call until it returns, waiting with :class:`Backoff` between
attempts. It stops at the first of ``attempts`` failures or the ``deadline`` (seconds
from the first attempt, checked before each wait), and then takes its final action:
``give_up`` names the exception to raise (the last error by default). Exceptions of
the ``final`` types, or of none of the ``only`` types, are raised at once: retrying
cannot help them. Failures are logged on the first attempt and every ``log_every``-th.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from services.common.backoff import Backoff
from services.common.log import Logger, get_logger

T = TypeVar("T")

#: Longest wait between two startup attempts, seconds.
MAX_STARTUP_BACKOFF = 5.0

log = get_logger("retry")

#: Waits ``delay`` seconds between attempts; returns True when the backoff should start over
#: (what failed has come back, as a reconnected bus).
Wait = Callable[[float], Awaitable[bool]]


class StartupError(RuntimeError):
    """A dependency could not be reached; the message says which and what to do."""


def should_log(attempt: int, every: int) -> bool:
    """The throttle of repeated failures: the first attempt, then every ``every``-th."""
    return attempt == 1 or (every > 0 and attempt % every == 0)


async def _sleep(delay: float) -> bool:
    await asyncio.sleep(delay)
    return False


def raise_if_cancelled() -> None:
    """Raise CancelledError when this task was asked to stop.

    Python 3.11's ``asyncio.wait_for`` (which nats.py's requests use) can swallow a cancellation
    that arrives as its inner awaitable finishes (fixed in 3.12): the caller gets a result, or a
    timeout, and a loop around it would go on after its task was cancelled, and its owner, awaiting
    it, would wait forever. A loop that goes on after such a call asks here first.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def retry(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int = 0,
    deadline: float | None = None,
    initial: float = 0.2,
    maximum: float = 5.0,
    final: tuple[type[BaseException], ...] = (),
    only: tuple[type[BaseException], ...] = (Exception,),
    give_up: Callable[[Exception, int], BaseException] | None = None,
    log_every: int = 1,
    message: str = "retrying",
    logger: Logger | None = None,
    describe: Callable[[BaseException], str] = str,
    wait: Wait = _sleep,
    fields: Mapping[str, object] | None = None,
) -> T:
    """Await ``call()`` until it returns; see the module's docstring for when it stops.

    ``attempts`` 0 and ``deadline`` None retry without end. ``give_up(error, attempt)``
    is the final action when either runs out. ``wait`` replaces the plain sleep
    between attempts. Logged failures carry ``what``, ``attempt``, ``error`` and ``fields``.
    """
    backoff = Backoff(initial, maximum)
    ends = None if deadline is None else time.monotonic() + deadline
    n = 0
    while True:
        n += 1
        if n > 1:
            raise_if_cancelled()
        try:
            return await call()
        except final:
            raise
        except Exception as exc:
            if not isinstance(exc, only):
                raise
            delay = backoff.next()
            if (attempts and n >= attempts) or (ends is not None and time.monotonic() + delay > ends):
                if give_up is None:
                    raise
                raise give_up(exc, n) from None
            if should_log(n, log_every):
                (logger or log).warning(message, what=what, attempt=n, error=describe(exc), **(fields or {}))
            if await wait(delay):
                backoff.reset()


async def tcp_probe(host: str, port: int, timeout: float = 2.0) -> None:
    """Open and close a TCP connection, raising OSError if nothing listens."""
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def reach(
    what: str, address: str, attempt: Callable[[], Awaitable[T]], *, retries: int, backoff: float, hint: str
) -> T:
    """Reach a dependency at startup: ``retries`` attempts, doubling the wait from ``backoff`` up to 5 s,
    then a :class:`StartupError` that names it and says what to do."""
    retries = max(1, retries)

    def unreachable(exc: Exception, n: int) -> StartupError:
        log.warning("dependency not reachable yet", what=what, address=address, attempt=n, error=str(exc))
        return StartupError(f"cannot reach {what} at {address} after {retries} attempts ({exc}); {hint}")

    return await retry(
        what,
        attempt,
        attempts=retries,
        initial=backoff,
        maximum=max(backoff, MAX_STARTUP_BACKOFF),
        give_up=unreachable,
        message="dependency not reachable yet",
        fields={"address": address},
    )
