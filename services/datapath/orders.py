"""Regeneration orders: from ``palisade.regen.<node>`` to the endpoints, and realized revisions back.

Three parts:

* :class:`Sequencer` (pure): reassembles chunked orders, drops duplicates, and
  decides when a gap in the per-node sequence (or a ``fetch`` order) needs a full
  :meth:`PolicyService.Resync`. Orders that arrive after a gap are held and applied
  on top of the resync if they are newer than it. A ``replace`` order (the first
  after the policy service starts) is the whole state, like a resync answer: it is
  applied as one even after a gap, and needs no resync.
* :class:`OrderConsumer` (one task): follows the subject into a queue, translating
  each order into the datapath's own types as it arrives (``wire``), runs the
  sequencer, fetches resyncs over gRPC (retrying while PolicyService is away) and
  hands complete orders to the endpoint manager, which owns the maps.
* :class:`Reporter` (one task): sends ``(node, endpoint, identity, revision)`` with
  ``ReportRealized``, coalescing per endpoint and retrying until it is delivered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import policy_pb2, policy_pb2_grpc
from services.common.bus import Bus, Follower, regen_subject
from services.common.errors import clip
from services.common.log import get_logger
from services.common.retry import retry
from services.datapath import types as dt
from services.datapath import wire
from services.datapath.errors import OrderError

log = get_logger("orders")


# --- sequencing ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Apply:
    batch: dt.OrderBatch


@dataclasses.dataclass(frozen=True)
class NeedResync:
    #: "gap", "fetch" — for logs and metrics.
    reason: str
    sequence: int


Action = Apply | NeedResync


def merge_diffs(diffs: Iterable[dt.IdentityPolicyDiff]) -> tuple[dt.IdentityPolicyDiff, ...]:
    """Fold the diffs of one order (possibly from several chunks) into one diff per identity. Pure.

    Adds and removes are concatenated in arrival order; ``full`` holds if any part
    was full; the last part's enforcement wins.
    """
    merged: dict[int, dt.IdentityPolicyDiff] = {}
    for diff in diffs:
        into = merged.get(diff.identity)
        if into is None:
            merged[diff.identity] = diff
            continue
        merged[diff.identity] = dt.IdentityPolicyDiff(
            diff.identity, diff.enforcement, into.add + diff.add, into.remove + diff.remove, into.full or diff.full
        )
    return tuple(merged.values())


class Sequencer:
    """Per-node order sequencing. Pure: no I/O, no clock; feed it orders and resync results."""

    def __init__(self) -> None:
        #: Sequence of the last order applied (or of the last resync); None before the first resync.
        self.last: int | None = None
        self._chunks: dict[int, dict[int, dt.Order]] = {}
        self._arrived: dict[int, float] = {}
        self._held: dict[int, dt.OrderBatch] = {}
        self.gaps = 0

    def offer(self, order: dt.Order, now: float = 0.0) -> list[Action]:
        if self.last is not None and order.sequence <= self.last:
            return []  # already applied (redelivery, or covered by a resync)
        if order.fetch:
            return [NeedResync("fetch", order.sequence)]
        batch = self._assemble(order, now)
        if batch is None:
            return []
        if self.last is None:
            self._held[batch.sequence] = batch
            return []
        if batch.replace:
            # The whole state at its sequence: what came before it no longer matters.
            self._forget_through(batch.sequence)
            self.last = batch.sequence
            return [Apply(batch), *self._drain()]
        if batch.sequence == self.last + 1:
            self.last = batch.sequence
            return [Apply(batch), *self._drain()]
        self._held[batch.sequence] = batch
        self.gaps += 1
        return [NeedResync("gap", batch.sequence)]

    def resynced(self, sequence: int) -> list[Action]:
        """The node's state now corresponds to ``sequence``: apply what is held beyond it."""
        self.last = sequence
        self._forget_through(sequence)
        actions = self._drain()
        if self._held:
            first = min(self._held)
            self.gaps += 1
            actions.append(NeedResync("gap", first))
        return actions

    def _forget_through(self, sequence: int) -> None:
        for seq in [s for s in self._held if s <= sequence]:
            del self._held[seq]
        for seq in [s for s in self._chunks if s <= sequence]:
            del self._chunks[seq]
            self._arrived.pop(seq, None)

    def _drain(self) -> list[Action]:
        actions: list[Action] = []
        assert self.last is not None
        while self.last + 1 in self._held:
            batch = self._held.pop(self.last + 1)
            self.last = batch.sequence
            actions.append(Apply(batch))
        return actions

    def _assemble(self, order: dt.Order, now: float) -> dt.OrderBatch | None:
        if order.chunks <= 1:
            return dt.OrderBatch(
                order.sequence,
                order.revision,
                merge_diffs(order.diffs),
                now,
                removed=order.removed,
                replace=order.replace,
            )
        parts = self._chunks.setdefault(order.sequence, {})
        self._arrived.setdefault(order.sequence, now)
        parts[order.chunk] = order
        if len(parts) < order.chunks:
            return None
        del self._chunks[order.sequence]
        arrived = self._arrived.pop(order.sequence, now)
        ordered = [parts[k] for k in sorted(parts)]
        diffs = merge_diffs(d for part in ordered for d in part.diffs)
        removed = tuple(dict.fromkeys(i for part in ordered for i in part.removed))
        replace = any(part.replace for part in ordered)
        return dt.OrderBatch(order.sequence, order.revision, diffs, arrived, removed=removed, replace=replace)


class PolicyPort(Protocol):
    """What the datapath needs from PolicyService."""

    async def resync(self, node: str, identities: Sequence[int] = ()) -> dt.ResyncState: ...

    async def report(self, reports: Sequence[policy_pb2.RealizedReport], node: str = "") -> None: ...


class GrpcPolicyClient:
    """PolicyService over gRPC."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self._stub = policy_pb2_grpc.PolicyServiceStub(channel)
        self._timeout = timeout

    async def resync(self, node: str, identities: Sequence[int] = ()) -> dt.ResyncState:
        """The node's state (or the named identities'); :class:`OrderError` if it holds a bad entry."""
        request = policy_pb2.ResyncRequest(node=node, identities=list(identities))
        response: policy_pb2.ResyncResponse = await self._stub.Resync(request, timeout=self._timeout)
        return wire.resync_from_proto(response)

    async def report(self, reports: Sequence[policy_pb2.RealizedReport], node: str = "") -> None:
        request = policy_pb2.ReportRealizedRequest(reports=list(reports), node=node)
        await self._stub.ReportRealized(request, timeout=self._timeout)


def rpc_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


class Reporter:
    """Delivers realized revisions to PolicyService, newest per endpoint, retrying until it is reachable."""

    def __init__(self, node: str, policy: PolicyPort, backoff_max: float = 5.0, heartbeat: float = 10.0) -> None:
        self._node = node
        self._policy = policy
        self._backoff_max = backoff_max
        #: With nothing to report for this long, an empty report says the node is alive.
        self._heartbeat = heartbeat
        self._pending: dict[int, policy_pb2.RealizedReport] = {}
        #: Deleted endpoints to report, by (endpoint id, pod); sent before the live reports of a batch,
        #: so an id reused by a new endpoint is reported after its old endpoint went.
        self._gone: dict[tuple[int, str], policy_pb2.RealizedReport] = {}
        #: Endpoints forgotten while a delivery is out (None when none is): their reports in it are not put back.
        self._forgotten_in_flight: set[int] | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        #: Arrival times (time.monotonic()) of the orders whose reports wait in ``_pending``.
        self._orders: list[float] = []
        self.delivered = 0
        #: Called with each delivered batch (benchmarks measure order-to-report latency with it).
        self.on_delivered: Callable[[Sequence[policy_pb2.RealizedReport]], None] | None = None
        #: Called once per order given to :meth:`add`, with the seconds from its arrival to the
        #: delivery of the report that carries it.
        self.on_order_realized: Callable[[float], None] | None = None

    def add(self, items: Iterable[dt.Realized], arrived: float | None = None) -> None:
        """Queue realized revisions; ``arrived`` is when the order they realize reached the node (monotonic)."""
        now = Timestamp()
        now.FromNanoseconds(time.time_ns())
        given = False
        for item in items:
            given = True
            old = self._pending.get(item.endpoint_id)
            if old is not None and old.revision > item.revision and old.identity == item.identity:
                continue
            self._pending[item.endpoint_id] = policy_pb2.RealizedReport(
                node=self._node,
                endpoint_id=item.endpoint_id,
                identity=item.identity,
                revision=item.revision,
                pod=item.pod,
                realized_at=now,
                error=clip(item.error),
            )
        if given and arrived is not None:
            self._orders.append(arrived)
        if self._pending:
            self._idle.clear()
            self._wake.set()

    def forget(self, endpoint_id: int) -> None:
        """Drop an unsent report of a deleted endpoint."""
        self._pending.pop(endpoint_id, None)
        if self._forgotten_in_flight is not None:
            self._forgotten_in_flight.add(endpoint_id)

    def deleted(self, endpoint_id: int, identity: int, pod: str) -> None:
        """An endpoint was deleted: drop its unsent report and tell PolicyService to forget it.

        Without this, an endpoint the ipcache does not know would hold WaitForRevision forever.
        """
        self.forget(endpoint_id)
        now = Timestamp()
        now.FromNanoseconds(time.time_ns())
        self._gone[(endpoint_id, pod)] = policy_pb2.RealizedReport(
            node=self._node, endpoint_id=endpoint_id, identity=identity, pod=pod, realized_at=now, deleted=True
        )
        self._idle.clear()
        self._wake.set()

    async def flushed(self) -> None:
        """Wait until everything added so far was delivered."""
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that
                # comes as the wake does, and the reporter would outlive its service.
                async with asyncio.timeout(self._heartbeat):
                    await self._wake.wait()
            except TimeoutError:
                await self._beat()
                continue
            self._wake.clear()
            await retry(
                "report realized",
                self._deliver,
                initial=0.05,
                maximum=self._backoff_max,
                message="report realized failed, retrying",
                describe=rpc_error,
            )

    async def _deliver(self) -> None:
        """Send everything pending as one batch; on failure put it back (behind anything newer) and raise."""
        if not self._pending and not self._gone:
            self._idle.set()
            return
        gone, self._gone = self._gone, {}
        batch, self._pending = self._pending, {}
        orders, self._orders = self._orders, []
        live = sorted(batch.values(), key=lambda r: r.endpoint_id)
        reports = [gone[k] for k in sorted(gone)] + live
        forgotten: set[int] = set()
        self._forgotten_in_flight = forgotten
        try:
            await self._policy.report(reports, self._node)
        except Exception:
            for key, report in gone.items():
                self._gone.setdefault(key, report)
            for report in live:
                # Put back unless a newer one arrived meanwhile, or its endpoint was deleted meanwhile:
                # sent after its deletion, it would bring back an endpoint that never reports again,
                # and WaitForRevision would wait on it for good.
                if report.endpoint_id not in forgotten:
                    self._pending.setdefault(report.endpoint_id, report)
            self._orders = orders + self._orders
            raise
        finally:
            self._forgotten_in_flight = None
        self.delivered += len(reports)
        log.debug("realized reported", reports=len(reports), revision=max(r.revision for r in reports))
        if self.on_delivered is not None:
            self.on_delivered(reports)
        if self.on_order_realized is not None:
            done = time.monotonic()
            for arrived in orders:
                self.on_order_realized(max(0.0, done - arrived))
        if not self._pending and not self._gone:
            self._idle.set()

    async def _beat(self) -> None:
        try:
            await self._policy.report([], self._node)
        except Exception as exc:  # the next beat, or the next report, tries again
            log.debug("heartbeat not delivered", error=rpc_error(exc))


class PolicyApplier(Protocol):
    """The endpoint manager, as the order consumer sees it."""

    async def apply_order(self, batch: dt.OrderBatch) -> None: ...

    async def apply_resync(self, state: dt.ResyncState) -> None: ...


class OrderConsumer:
    """Follows this node's orders and keeps the endpoint manager at the newest policy."""

    def __init__(
        self,
        node: str,
        policy: PolicyPort,
        applier: PolicyApplier,
        *,
        backoff_max: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node = node
        self._policy = policy
        self._applier = applier
        self._backoff_max = backoff_max
        self._clock = clock
        #: Orders with the time (``clock``) they reached the node.
        self._queue: asyncio.Queue[tuple[dt.Order, float]] = asyncio.Queue()
        self.sequencer = Sequencer()
        #: Set once the first full resync was applied.
        self.synced = asyncio.Event()
        self.resyncs = 0
        #: Incremental orders applied.
        self.applied = 0
        #: Replace orders applied (each stands for a resync the policy service pushed).
        self.replaces = 0
        self._follower: Follower | None = None

    @property
    def sequence(self) -> int:
        return self.sequencer.last or 0

    async def subscribe(self, bus: Bus) -> None:
        """Start receiving new orders (queued until :meth:`run` takes them)."""

        async def on_order(subject: str, order: policy_pb2.RegenerationOrder) -> None:
            self.offer(order)

        # Only new orders: the current state comes from the resync that run() starts with,
        # and whatever arrives meanwhile waits in the queue.
        self._follower = await bus.follow(
            regen_subject(self._node), policy_pb2.RegenerationOrder, on_order, deliver_new=True
        )

    def offer(self, order: policy_pb2.RegenerationOrder) -> None:
        """Queue an order as received from the bus, translated; one that cannot be read asks for a resync."""
        try:
            typed = wire.order_from_proto(order)
        except OrderError as exc:
            # Nothing of it is applied; the node's whole state replaces it.
            log.error("order rejected, resyncing", sequence=order.sequence, error=str(exc))
            typed = dt.Order(sequence=order.sequence, revision=order.revision, node=order.node, fetch=True)
        self._queue.put_nowait((typed, self._clock()))

    async def stop(self) -> None:
        if self._follower is not None:
            await self._follower.stop()

    async def run(self) -> None:
        actions: list[Action] = [NeedResync("startup", 0)]
        while True:
            if not actions:
                order, arrived = await self._queue.get()
                if order.node and order.node != self._node:
                    log.warning("order for another node ignored", order_node=order.node, node=self._node)
                    continue
                actions = self.sequencer.offer(order, arrived)
                continue
            action, actions = actions[0], actions[1:]
            if isinstance(action, Apply):
                await self._applier.apply_order(action.batch)
                if action.batch.replace:
                    self.replaces += 1
                    log.info(
                        "replace order applied",
                        sequence=action.batch.sequence,
                        revision=action.batch.revision,
                        identities=len(action.batch.diffs),
                    )
                else:
                    self.applied += 1
                continue
            # A resync supersedes whatever else was planned; the sequencer re-derives it.
            log.info("resync needed", reason=action.reason, sequence=action.sequence, last=self.sequence)
            state = await self._fetch()
            await self._applier.apply_resync(state)
            self.resyncs += 1
            actions = self.sequencer.resynced(state.sequence)
            self.synced.set()
            log.info("resync applied", sequence=state.sequence, revision=state.revision, identities=len(state.policies))

    async def _fetch(self) -> dt.ResyncState:
        return await retry(
            "resync",
            lambda: self._policy.resync(self._node),
            initial=0.1,
            maximum=self._backoff_max,
            log_every=10,
            message="resync failed, retrying; pinned maps keep enforcing meanwhile",
            describe=rpc_error,
        )
