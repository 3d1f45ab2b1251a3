"""Where the time of a multi-step operation goes: milliseconds per named step, as log fields.

watch = Stopwatch()
await allocate()
watch.lap("ipam")
await attach()
watch.lap("attach")
log.info("endpoint created", **watch.fields())   # ipam_ms=.. attach_ms=.. total_ms=..
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Stopwatch:
    """Laps of one operation; a step lapped twice adds up."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self.laps: dict[str, float] = {}

    def lap(self, step: str) -> float:
        """Close ``step`` (the time since the previous lap); returns its seconds."""
        now = self._clock()
        seconds = now - self._last
        self._last = now
        self.laps[step] = self.laps.get(step, 0.0) + seconds
        return seconds

    def record(self, step: str, seconds: float) -> None:
        """Add ``seconds`` to ``step`` without closing a lap (a step timed apart, e.g. run concurrently)."""
        self.laps[step] = self.laps.get(step, 0.0) + seconds

    def total(self) -> float:
        """Seconds since the stopwatch started."""
        return self._clock() - self._start

    def fields(self) -> dict[str, float]:
        """``<step>_ms`` per step and ``total_ms``, rounded to 0.1 ms."""
        out = {f"{step}_ms": round(seconds * 1000, 1) for step, seconds in self.laps.items()}
        out["total_ms"] = round(self.total() * 1000, 1)
        return out
