"""Exponential backoff: the one way every Palisade loop waits between attempts.

``Backoff`` computes delays (doubling up to a maximum, optionally with jitter so many
clients do not retry in lockstep). Retrying a call is :func:`services.common.retry.retry`.
"""

from __future__ import annotations

import asyncio
import random

#: The jitter's source when none is given (seeding one per backoff read the OS's entropy each time).
_RNG = random.Random()


class Backoff:
    """Delays that double from ``initial`` up to ``maximum``; ``reset`` after a success.

    With ``jitter`` each delay is scaled by a random factor in [0.8, 1.2).
    """

    def __init__(
        self, initial: float, maximum: float, *, jitter: bool = False, rng: random.Random | None = None
    ) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {initial} and {maximum}")
        self._initial = initial
        self._max = maximum
        self._next = initial
        self._jitter = jitter
        self._rng = rng or _RNG

    def reset(self) -> None:
        self._next = self._initial

    def next(self) -> float:
        """The delay to wait now; the following one doubles (up to the maximum)."""
        delay = self._next
        self._next = min(self._next * 2, self._max)
        return delay * (0.8 + 0.4 * self._rng.random()) if self._jitter else delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.next())
