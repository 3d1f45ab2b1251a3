"""The one backoff: doubling delays up to a maximum, reset, jitter bounds, and retry_forever."""

from __future__ import annotations

import random

import pytest

from services.common.backoff import Backoff, retry_forever
from services.common.retry import StartupError, with_retries


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


async def test_retry_forever_returns_once_the_call_succeeds() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OSError("not yet")
        return "ok"

    assert await retry_forever("flaky", flaky, initial=0.001, maximum=0.002) == "ok"
    assert calls == 3


async def test_with_retries_gives_up_after_its_attempts_naming_the_dependency() -> None:
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise OSError("connection refused")

    with pytest.raises(StartupError, match=r"cannot reach etcd at h:1 after 3 attempts \(connection refused\); run it"):
        await with_retries("etcd", "h:1", down, retries=3, backoff=0.001, hint="run it")
    assert calls == 3
