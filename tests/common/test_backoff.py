"""The one backoff and the one retry: delays, attempts, deadline, final action, throttled logs."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from services.common.backoff import Backoff
from services.common.log import Logger
from services.common.retry import StartupError, reach, retry, should_log


def test_delays_double_up_to_the_maximum_and_reset() -> None:
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    backoff.reset()
    assert backoff.next() == pytest.approx(0.1)


def test_jitter_stays_within_twenty_percent() -> None:
    backoff = Backoff(1.0, 1.0, jitter=True, rng=random.Random(7))
    delays = [backoff.next() for _ in range(200)]
    assert all(0.8 <= d < 1.2 for d in delays)
    assert len(set(delays)) > 1


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_bad_bounds_are_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="0 < initial <= maximum"):
        Backoff(initial, maximum)


async def test_retry_without_limits_returns_once_the_call_succeeds() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OSError("not yet")
        return "ok"

    assert await retry("flaky", flaky, initial=0.001, maximum=0.002) == "ok"
    assert calls == 3


async def test_reach_gives_up_after_its_attempts_naming_the_dependency() -> None:
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise OSError("connection refused")

    with pytest.raises(StartupError, match=r"cannot reach etcd at h:1 after 3 attempts \(connection refused\); run it"):
        await reach("etcd", "h:1", down, retries=3, backoff=0.001, hint="run it")
    assert calls == 3


class Recorder(Logger):
    def __init__(self) -> None:
        super().__init__("test")
        self.warnings: list[dict[str, Any]] = []

    def warning(self, msg: str, **fields: Any) -> None:
        self.warnings.append({"msg": msg, **fields})


class Failing:
    """A call that fails ``times`` times with ``error``, then returns its call count."""

    def __init__(self, times: int, error: Exception | None = None) -> None:
        self.times = times
        self.error = error or OSError("down")
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.times:
            raise self.error
        return self.calls


class Waits:
    """Records the waits instead of sleeping; restarts the backoff on the waits listed."""

    def __init__(self, restart_at: tuple[int, ...] = ()) -> None:
        self.delays: list[float] = []
        self.restart_at = restart_at

    async def __call__(self, delay: float) -> bool:
        self.delays.append(delay)
        return len(self.delays) in self.restart_at


async def test_retry_waits_with_backoff_until_the_call_returns() -> None:
    call, waits = Failing(4), Waits()
    assert await retry("x", call, initial=0.1, maximum=0.4, wait=waits) == 5
    assert waits.delays == pytest.approx([0.1, 0.2, 0.4, 0.4])


async def test_a_restarting_wait_starts_the_backoff_over() -> None:
    call, waits = Failing(4), Waits(restart_at=(2,))
    await retry("x", call, initial=0.1, maximum=1.0, wait=waits)
    assert waits.delays == pytest.approx([0.1, 0.2, 0.1, 0.2])


async def test_attempts_run_out_into_the_last_error_or_the_final_action() -> None:
    call = Failing(10)
    with pytest.raises(OSError, match="down"):
        await retry("x", call, attempts=3, wait=Waits())
    assert call.calls == 3

    def give_up(exc: Exception, attempts: int) -> Exception:
        return RuntimeError(f"gave up after {attempts}: {exc}")

    with pytest.raises(RuntimeError, match="gave up after 2: down"):
        await retry("x", Failing(10), attempts=2, give_up=give_up, wait=Waits())


async def test_a_deadline_stops_before_a_wait_that_would_pass_it() -> None:
    call, waits = Failing(10), Waits()
    with pytest.raises(OSError):
        await retry("x", call, deadline=0.0, wait=waits)
    assert (call.calls, waits.delays) == (1, [])
    assert await retry("x", Failing(3), deadline=3600.0, wait=Waits()) == 4


async def test_final_errors_and_errors_outside_only_are_raised_at_once() -> None:
    call = Failing(5, ValueError("bad"))
    with pytest.raises(ValueError):
        await retry("x", call, final=(ValueError,), wait=Waits())
    assert call.calls == 1
    call = Failing(5, KeyError("k"))
    with pytest.raises(KeyError):
        await retry("x", call, only=(OSError,), wait=Waits())
    assert call.calls == 1


async def test_failures_are_logged_on_the_first_attempt_and_every_nth() -> None:
    logger = Recorder()
    await retry("x", Failing(45), log_every=20, logger=logger, message="failed", wait=Waits(), fields={"node": "n1"})
    assert [w["attempt"] for w in logger.warnings] == [1, 20, 40]
    assert logger.warnings[0] == {"msg": "failed", "what": "x", "attempt": 1, "error": "down", "node": "n1"}


@pytest.mark.parametrize(("attempt", "every", "logged"), [(1, 20, True), (2, 20, False), (40, 20, True), (3, 0, False)])
def test_the_log_throttle(attempt: int, every: int, logged: bool) -> None:
    assert should_log(attempt, every) is logged


async def test_a_retry_stops_when_its_task_was_cancelled_even_if_a_call_swallowed_it() -> None:
    """An attempt that swallows the cancellation (as Python 3.11's wait_for can) and fails: the
    retry raises CancelledError instead of trying again, forever."""
    attempts = 0
    started = asyncio.Event()

    async def swallowing() -> None:
        nonlocal attempts
        attempts += 1
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass
        raise TimeoutError("no ack")

    task = asyncio.create_task(retry("publish", swallowing, initial=0.01, maximum=0.01))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert attempts == 1
