"""Coalescing concurrent requests into batches whose members touch disjoint keys.

ipam sends every allocation as one etcd transaction. Under load many are in flight
at once, and each costs a round trip, a raft proposal and a disk sync. A
:class:`Coalescer` lets the first request go at once and gathers those that arrive
while it is in flight into the next batch, which the owner sends as one request
(for etcd: one transaction whose operations are the gathered transactions, nested).

A batch only holds requests whose *footprints* (every key or key range a request
compares, reads or writes) are pairwise disjoint: then applying them together is
the same as applying them one after another in any order, so batching changes no
outcome. A request that overlaps one already in the batch waits for the next batch,
keeping its place in line.

No I/O here: the owner's ``send`` does it. The coalescer keeps a reference to every
batch it starts; a batch always runs to its end, so callers that give up (cancelled)
leave nothing running once the batch is answered.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Generic, TypeVar

from services.common.log import get_logger

log = get_logger("batch")

T = TypeVar("T")
R = TypeVar("R")

#: A key range [start, end); a single key ``k`` is ``(k, k + b"\0")``.
Interval = tuple[bytes, bytes]


def point(key: bytes) -> Interval:
    """The interval of exactly one key."""
    return key, key + b"\0"


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, pairwise disjoint intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[0] < i[1]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


class Footprint:
    """A set of keys: sorted, pairwise disjoint intervals (so their ends are sorted too)."""

    def __init__(self) -> None:
        self._starts: list[bytes] = []
        self._ends: list[bytes] = []

    def overlaps(self, intervals: Sequence[Interval]) -> bool:
        for start, end in intervals:
            # The last interval starting before ``end`` is the only one that can reach past ``start``.
            i = bisect.bisect_left(self._starts, end)
            if i > 0 and self._ends[i - 1] > start:
                return True
        return False

    def add(self, intervals: Sequence[Interval]) -> None:
        """Add intervals, merging those that overlap ones already in."""
        for start, end in intervals:
            lo = bisect.bisect_right(self._ends, start)  # the first that ends after ``start``
            hi = bisect.bisect_left(self._starts, end)  # the first that starts at or after ``end``
            if lo < hi:
                start, end = min(start, self._starts[lo]), max(end, self._ends[hi - 1])
            self._starts[lo:hi] = [start]
            self._ends[lo:hi] = [end]


@dataclasses.dataclass(slots=True)
class _Queued(Generic[T, R]):
    item: T
    #: Merged: sorted and disjoint. Empty: the request touches nothing and fits any batch.
    footprint: list[Interval]
    answer: asyncio.Future[R]


#: Sends a batch; answers one outcome per item, in order: its result, or the exception its caller gets.
Send = Callable[[Sequence[T]], Awaitable[Sequence[R | BaseException]]]


class Coalescer(Generic[T, R]):
    """Batches concurrent :meth:`submit` calls: at most ``in_flight`` batches of ``max_batch`` at once."""

    def __init__(self, send: Send[T, R], *, max_batch: int, in_flight: int = 1) -> None:
        if max_batch < 1 or in_flight < 1:
            raise ValueError(f"a coalescer needs max_batch >= 1 and in_flight >= 1, got {max_batch}, {in_flight}")
        self._send = send
        self._max_batch = max_batch
        self._in_flight = in_flight
        self._waiting: deque[_Queued[T, R]] = deque()
        self._flights: set[asyncio.Task[None]] = set()
        #: Batches sent and requests in them, for metrics and tests.
        self.batches = 0
        self.requests = 0

    async def submit(self, item: T, footprint: Iterable[Interval]) -> R:
        """Send ``item`` in the next batch it fits; returns its own outcome."""
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Queued(item, merged(footprint), answer))
        self._launch()
        return await answer

    def _launch(self) -> None:
        while self._waiting and len(self._flights) < self._in_flight:
            batch = self._take()
            if not batch:
                continue
            task = asyncio.get_running_loop().create_task(self._fly(batch), name="etcd batch")
            self._flights.add(task)
            task.add_done_callback(self._landed)

    def _landed(self, task: asyncio.Task[None]) -> None:
        self._flights.discard(task)
        self._launch()

    def _take(self) -> list[_Queued[T, R]]:
        """The next batch: waiting requests in order that overlap neither one taken nor one kept
        before them (so requests on common keys are sent in the order they came)."""
        batch: list[_Queued[T, R]] = []
        taken = Footprint()
        blocked = Footprint()
        kept: deque[_Queued[T, R]] = deque()
        while self._waiting:
            queued = self._waiting.popleft()
            if queued.answer.done():
                continue  # its caller gave up before it was sent
            fits = not taken.overlaps(queued.footprint) and not blocked.overlaps(queued.footprint)
            if len(batch) < self._max_batch and fits:
                taken.add(queued.footprint)
                batch.append(queued)
            else:
                kept.append(queued)
                blocked.add(queued.footprint)
                if len(batch) >= self._max_batch:
                    break
        kept.extend(self._waiting)
        self._waiting = kept
        return batch

    async def _fly(self, batch: list[_Queued[T, R]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        try:
            outcomes = await self._send([q.item for q in batch])
        except asyncio.CancelledError:
            for queued in batch:
                queued.answer.cancel()
            raise
        except Exception as exc:
            outcomes = [exc] * len(batch)
        if len(outcomes) != len(batch):
            error = RuntimeError(f"a batch of {len(batch)} requests got {len(outcomes)} answers")
            outcomes = [error] * len(batch)
        for queued, outcome in zip(batch, outcomes, strict=True):
            if queued.answer.done():
                continue  # cancelled meanwhile: what it sent stands, as for a request sent alone
            if isinstance(outcome, BaseException):
                queued.answer.set_exception(outcome)
            else:
                queued.answer.set_result(outcome)
