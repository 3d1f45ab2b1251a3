"""Flow events: one task drains the BPF ring buffer and fans events out to Observe clients.

Each client has a bounded buffer; a client that cannot keep up loses its oldest
events (counted), never slowing the reader or the other clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import common_pb2, datapath_pb2
from services.common.log import get_logger
from services.common.retry import retry
from services.datapath import types as dt

log = get_logger("flows")


class FlowSource(Protocol):
    def read_flows(self, timeout_ms: int) -> Sequence[dt.FlowEvent]: ...
    def skip_flows(self, timeout_ms: int) -> int: ...


def flow_to_proto(event: dt.FlowEvent, node: str, pod: str) -> datapath_pb2.FlowEvent:
    """The wire form of a flow event. Pure."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(event.time * 1e9))
    reason = 0 if event.reason is dt.Reason.INVALID else event.reason.wire
    return datapath_pb2.FlowEvent(
        time=stamp,
        node=node,
        endpoint_id=event.endpoint_id,
        direction=event.direction.wire,  # type: ignore[arg-type]
        verdict=event.verdict.wire,  # type: ignore[arg-type]
        reason=reason,  # type: ignore[arg-type]
        source_identity=event.source_identity,
        destination_identity=event.destination_identity,
        source_ip=event.source_ip,
        destination_ip=event.destination_ip,
        source_port=event.source_port,
        destination_port=event.destination_port,
        protocol=event.protocol,  # type: ignore[arg-type]
        pod=pod,
    )


@dataclasses.dataclass(frozen=True)
class FlowFilter:
    """Which events an Observe client wants."""

    verdicts: frozenset[int] = frozenset()
    #: "namespace/name" of one local pod; empty for all.
    pod: str = ""

    @classmethod
    def from_request(cls, request: datapath_pb2.ObserveRequest) -> FlowFilter:
        return cls(frozenset(int(v) for v in request.verdicts), request.pod)

    def matches(self, event: datapath_pb2.FlowEvent) -> bool:
        if self.verdicts and event.verdict not in self.verdicts:
            return False
        return not self.pod or event.pod == self.pod


class Subscription:
    """One Observe client's buffer."""

    def __init__(self, flt: FlowFilter, size: int) -> None:
        self.filter = flt
        self._queue: asyncio.Queue[datapath_pb2.FlowEvent] = asyncio.Queue(maxsize=size)
        self.lost = 0

    def offer(self, event: datapath_pb2.FlowEvent) -> bool:
        """Buffer ``event`` if it matches; True when the oldest buffered event was dropped for it."""
        if not self.filter.matches(event):
            return False
        dropped = self._queue.full()
        if dropped:
            self._queue.get_nowait()
            self.lost += 1
        self._queue.put_nowait(event)
        return dropped

    async def get(self) -> datapath_pb2.FlowEvent:
        return await self._queue.get()


class FlowHub:
    """Reads flow events and hands each to every matching subscription."""

    def __init__(
        self,
        source: FlowSource,
        *,
        node: str,
        pod_of: Callable[[int], str],
        poll_ms: int = 200,
        buffer: int = 4096,
    ) -> None:
        self._source = source
        self._node = node
        self._pod_of = pod_of
        self._poll_ms = poll_ms
        self._buffer = buffer
        self._subs: set[Subscription] = set()
        self._joined = asyncio.Event()  # a client subscribed: stop skipping
        self._reading = False  # the hub decodes and fans out (it skips while nobody observes)
        self.events = 0
        #: Events dropped from the buffers of Observe clients that could not keep up.
        self.dropped = 0

    async def run(self) -> None:
        while True:
            batch = await retry(
                "read flow events",
                self._read,
                initial=0.1,
                maximum=5.0,
                log_every=100,
                message="reading flow events failed, retrying",
            )
            for event in batch:
                self.publish(flow_to_proto(event, self._node, self._pod_of(event.endpoint_id)))

    async def _read(self) -> Sequence[dt.FlowEvent]:
        """The next batch for the subscribers; none while nobody observes."""
        self._joined.clear()
        if not self._subs:
            # Nobody observing: the events are consumed (so a client that comes gets new
            # ones, not a backlog) and counted, never decoded; then the hub waits for a
            # client or the next poll, whichever comes first.
            self._reading = False
            self.events += await asyncio.to_thread(self._source.skip_flows, 0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._joined.wait(), self._poll_ms / 1000)
            return ()
        self._reading = True
        return await asyncio.to_thread(self._source.read_flows, self._poll_ms)

    def publish(self, event: datapath_pb2.FlowEvent) -> None:
        self.events += 1
        for sub in self._subs:
            if sub.offer(event):
                self.dropped += 1

    async def stream(self, flt: FlowFilter, limit: int = 0) -> AsyncGenerator[datapath_pb2.FlowEvent, None]:
        """Events matching ``flt`` from the hub's next read on (it stops skipping at once for the
        first client); stops after ``limit`` (0: until the caller stops)."""
        sub = Subscription(flt, self._buffer)
        self._subs.add(sub)
        self._joined.set()
        sent = 0
        try:
            while not limit or sent < limit:
                yield await sub.get()
                sent += 1
        finally:
            self._subs.discard(sub)
            if sub.lost:
                log.info("observe client lost events", lost=sub.lost)

    @property
    def subscribers(self) -> int:
        """Clients being served: subscribed, with the hub reading for them (no longer skipping)."""
        return len(self._subs) if self._reading else 0


VERDICTS = {common_pb2.VERDICT_ALLOW, common_pb2.VERDICT_DENY}
