"""The one task that owns the policy state, and the one that publishes its orders.

Everything that reads or changes :class:`PolicyCore` is a job on one queue,
run by :meth:`Controller.run` one at a time; nothing else touches the core, so
there is no lock. Changes queued together are folded into one engine batch and
committed once (one order per node per batch, Cilium-style coalescing). The
commit's orders, the imported policies and the state to persist go, in order, to
:meth:`Controller.run_publisher`, which saves policies and state, then publishes;
a job marked ``durable`` is answered only after that, so a revision or sequence
returned to a client is never lost by a crash.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from palisade.v1 import policy_pb2
from services.common.errors import Code, PalisadeError
from services.common.log import get_logger
from services.policy import metrics
from services.policy.engine.core import Commit, PolicyCore
from services.policy.engine.orders import PlannedOrder, PolicyEpoch
from services.policy.engine.realized import EndpointKey, Lag
from services.policy.engine.registry import ApiChange
from services.policy.engine.sources import Source
from services.policy.wire import DiffProtos, encode

log = get_logger("controller")

T = TypeVar("T")
Op = Callable[[PolicyCore, float], T]


class NotLeading(PalisadeError):
    """This replica stopped leading before the change was persisted and published: it was not applied."""

    code = Code.UNAVAILABLE


class JobKind(enum.StrEnum):
    #: Changes engine state: folded into the open batch.
    CHANGE = "change"
    #: Touches only the realized table: may run inside an open batch.
    REALIZED = "realized"
    #: Needs committed state: the open batch is committed first.
    READ = "read"


class OrderSink(Protocol):
    """Where committed state goes: imported policies and the epoch (revision, sequences) first, then the orders."""

    async def save_policies(self, changes: Sequence[ApiChange]) -> None: ...

    async def save_epoch(self, epoch: PolicyEpoch) -> None: ...

    async def publish_orders(self, node: str, messages: Sequence[policy_pb2.RegenerationOrder]) -> None: ...


@dataclass(slots=True)
class _Job(Generic[T]):
    op: Op[T]
    kind: JobKind
    durable: bool
    future: asyncio.Future[T] | None
    arrived: float


@dataclass(slots=True)
class _Outbox:
    orders: list[PlannedOrder] = field(default_factory=list)
    epoch: PolicyEpoch | None = None
    api: list[ApiChange] = field(default_factory=list)
    answers: list[tuple[asyncio.Future[Any], Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.orders or self.epoch is not None or self.api or self.answers)


@dataclass(slots=True)
class _Waiter:
    revision: int
    future: asyncio.Future[None]
    #: The endpoints found behind so far (the last still behind at the last check): see
    #: :meth:`RealizedTable.settled`.
    left: list[EndpointKey] | None = None


@dataclass(frozen=True, slots=True)
class Encoding:
    max_order_bytes: int
    max_order_chunks: int


class Controller:
    def __init__(
        self,
        core: PolicyCore,
        sink: OrderSink,
        *,
        encoding: Encoding,
        max_batch: int = 512,
        clock: Callable[[], float] = time.time,
        leading: Callable[[], bool] = lambda: True,
        on_change: Callable[[PolicyCore], None] | None = None,
    ) -> None:
        self._core = core
        #: Called after each batch with a change, on the owner task (reads the state, never waits).
        self._on_change = on_change
        #: Whether this replica leads: only a leader persists and publishes what it planned.
        self._leading = leading
        self._sink = sink
        self._encoding = encoding
        self._max_batch = max_batch
        self._clock = clock
        self._jobs: asyncio.Queue[_Job[Any]] = asyncio.Queue()
        self._outboxes: asyncio.Queue[_Outbox] = asyncio.Queue()
        self._waiters: list[_Waiter] = []

    @property
    def core(self) -> PolicyCore:
        """For synchronous read-only snapshots on the event loop (status provider) only."""
        return self._core

    # --- submitting work -------------------------------------------------------------------

    def post(self, op: Op[Any], kind: JobKind = JobKind.CHANGE) -> None:
        """Queue a job nobody waits for (bus input)."""
        self._jobs.put_nowait(_Job(op, kind, False, None, self._clock()))

    async def call(self, op: Op[T], kind: JobKind = JobKind.READ, *, durable: bool = False) -> T:
        """Run ``op`` on the state and return its result (after its orders are out if durable)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.put_nowait(_Job(op, kind, durable, future, self._clock()))
        return await future

    async def wait_for_revision(self, revision: int, timeout: float) -> list[Lag]:
        """Wait until no endpoint is behind ``revision``, or one failed to realize it.

        Returns the endpoints still behind (empty: realized), those that failed with their error.
        """
        loop = asyncio.get_running_loop()

        def register(core: PolicyCore, now: float) -> asyncio.Future[None] | None:
            settled, left = core.wait_settled(revision)
            if settled:
                return None
            waiter = _Waiter(revision, loop.create_future(), left)
            self._waiters.append(waiter)
            return waiter.future

        future = await self.call(register)
        try:
            if future is not None:
                await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            pass
        finally:
            if future is not None:
                future.cancel()  # the owner drops cancelled waiters (also when the client went away)
        return await self.call(lambda core, now: core.wait_state(revision))

    # --- the owner -------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            jobs = [await self._jobs.get()]
            while len(jobs) < self._max_batch and not self._jobs.empty():
                jobs.append(self._jobs.get_nowait())
            self._run_jobs(jobs)

    def _run_jobs(self, jobs: list[_Job[Any]]) -> None:
        started = time.perf_counter()
        outbox = _Outbox()
        for job in jobs:
            if job.future is not None and job.future.done():
                continue  # the caller went away (deadline, cancel): do not act for nobody
            if job.kind is JobKind.READ and self._core.batch_open:
                self._commit(outbox)
            try:
                result = job.op(self._core, job.arrived)
            except Exception as exc:
                if job.future is None:
                    log.error("input failed", error=repr(exc), exc_info=True)
                elif not job.future.done():
                    job.future.set_exception(exc)
                continue
            if job.future is None or job.future.done():
                continue
            if job.durable:
                outbox.answers.append((job.future, result))
            else:
                job.future.set_result(result)
        self._commit(outbox)
        self._check_waiters()
        if any(job.kind is JobKind.CHANGE for job in jobs):
            if self._on_change is not None:
                self._on_change(self._core)
            counts = self._core.registry.counts()
            for source in Source:
                for rejected in (False, True):
                    state = "rejected" if rejected else "accepted"
                    metrics.POLICIES.labels(source.value, state).set(counts.get((source, rejected), 0))
        metrics.COMPUTE_SECONDS.observe(time.perf_counter() - started)
        if outbox:
            self._outboxes.put_nowait(outbox)

    def _commit(self, outbox: _Outbox) -> None:
        commit: Commit = self._core.commit(self._clock())
        outbox.orders.extend(commit.orders)
        outbox.api.extend(commit.api)
        if commit.epoch is not None:
            outbox.epoch = commit.epoch
        metrics.REVISION.set(commit.revision)

    def _check_waiters(self) -> None:
        if not self._waiters:
            return
        keep = []
        for waiter in self._waiters:
            if waiter.future.done():
                continue
            # After every batch: one lookup while the endpoint found behind last time still is.
            settled, waiter.left = self._core.wait_settled(waiter.revision, waiter.left)
            if settled:
                waiter.future.set_result(None)
            else:
                keep.append(waiter)
        self._waiters = keep

    # --- the publisher ---------------------------------------------------------------------

    async def run_publisher(self) -> None:
        while True:
            boxes = [await self._outboxes.get()]
            while not self._outboxes.empty():
                boxes.append(self._outboxes.get_nowait())
            try:
                await self._publish(boxes)
            except NotLeading as exc:
                # Planned by a leader that has since stepped down: never sent. The new leader
                # sends every node its whole state; callers waiting on this work get an error.
                log.warning("planned orders dropped: no longer the leader", boxes=len(boxes), reason=str(exc))
                for box in boxes:
                    for future, _ in box.answers:
                        if not future.done():
                            future.set_exception(NotLeading(str(exc)))

    async def _publish(self, boxes: list[_Outbox]) -> None:
        if not self._leading() and any(box.orders or box.epoch is not None or box.api for box in boxes):
            raise NotLeading(
                "policy replica stepped down from leader before this change was applied; retry: it goes to the "
                "new leader"
            )
        started = time.perf_counter()
        api = [change for b in boxes for change in b.api]
        if api:
            await self._sink.save_policies(api)
        epoch = next((b.epoch for b in reversed(boxes) if b.epoch is not None), None)
        if epoch is not None:
            await self._sink.save_epoch(epoch)
        per_node: dict[str, list[policy_pb2.RegenerationOrder]] = {}
        converted = DiffProtos()
        for box in boxes:
            for order in box.orders:
                messages = encode(
                    order,
                    max_bytes=self._encoding.max_order_bytes,
                    max_chunks=self._encoding.max_order_chunks,
                    converted=converted,
                )
                _count(order, messages)
                per_node.setdefault(order.node, []).extend(messages)
        # Nodes are independent; within a node the order of messages is the sequence order.
        await asyncio.gather(*(self._sink.publish_orders(node, msgs) for node, msgs in per_node.items()))
        if per_node:
            metrics.PUBLISH_SECONDS.observe(time.perf_counter() - started)
        for box in boxes:
            for future, result in box.answers:
                if not future.done():
                    future.set_result(result)


def _count(order: PlannedOrder, messages: list[policy_pb2.RegenerationOrder]) -> None:
    if messages[0].fetch:
        form = "fetch"
    elif len(messages) > 1:
        form = "chunked"
    elif order.replace:
        form = "replace"
    elif order.is_bump:
        form = "bump"
    else:
        form = "diff"
    metrics.ORDERS.labels(form).inc()
    for m in messages:
        metrics.ORDER_BYTES.observe(m.ByteSize())
