"""Flow events: one task drains the BPF ring buffer and fans events out to Observe clients.

Each client has a bounded buffer; a client that cannot keep up loses its oldest
events (counted), never slowing the reader or the other clients.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import common_pb2, datapath_pb2
from services.common import fqdn
from services.common.log import get_logger
from services.common.retry import retry
from services.datapath import types as dt
from services.datapath.config import DatapathConfig

log = get_logger("flows")


class FlowSource(Protocol):
    def read_flows(self, timeout_ms: int) -> Sequence[dt.FlowEvent]: ...
    def skip_flows(self, timeout_ms: int) -> int: ...
    def take_flows(self, timeout_ms: int, limit: int) -> tuple[Sequence[dt.FlowEvent], int]: ...


def flow_to_proto(
    event: dt.FlowEvent, node: str, pod: str, pod_at: Callable[[str], str] = lambda ip: ""
) -> datapath_pb2.FlowEvent:
    """The wire form of a flow event; ``pod`` is the local endpoint's, ``pod_at`` names the owner of
    the remote address (the ipcache's). Pure."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(event.time * 1e9))
    reason = 0 if event.reason is dt.Reason.INVALID else event.reason.wire
    egress = event.direction is dt.Direction.EGRESS
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
        source_pod=pod if egress else pod_at(event.source_ip),
        destination_pod=pod_at(event.destination_ip) if egress else pod,
    )


def _namespace(pod: str) -> str:
    return pod.partition("/")[0] if "/" in pod else ""


@dataclasses.dataclass(frozen=True)
class FlowFilter:
    """Which events an Observe client wants: every non-empty field must match (hubble-like)."""

    verdicts: frozenset[int] = frozenset()
    #: "namespace/name" of pods the flow comes from or goes to; empty for all.
    pods: frozenset[str] = frozenset()
    namespaces: frozenset[str] = frozenset()
    from_pods: frozenset[str] = frozenset()
    to_pods: frozenset[str] = frozenset()
    from_identities: frozenset[int] = frozenset()
    to_identities: frozenset[int] = frozenset()
    ports: frozenset[int] = frozenset()
    protocols: frozenset[int] = frozenset()
    #: Names or matchPatterns, one of which must select a source or destination name of the flow.
    #: Checked by :meth:`matches_names` once the names are known (the hub's events carry none).
    fqdns: frozenset[str] = frozenset()

    @classmethod
    def from_request(cls, request: datapath_pb2.ObserveRequest) -> FlowFilter:
        f = request.filter
        pods = set(f.pods) | ({request.pod} if request.pod else set())
        return cls(
            verdicts=frozenset(int(v) for v in [*request.verdicts, *f.verdicts]),
            pods=frozenset(pods),
            namespaces=frozenset(f.namespaces),
            from_pods=frozenset(f.from_pods),
            to_pods=frozenset(f.to_pods),
            from_identities=frozenset(f.from_identities),
            to_identities=frozenset(f.to_identities),
            ports=frozenset(f.ports),
            protocols=frozenset(int(p) for p in f.protocols),
            fqdns=frozenset(fqdn.normalize(x) for x in f.fqdns),
        )

    def problems(self) -> list[str]:
        """What is wrong with the filter's values, each naming the field and the fix."""
        out = []
        for field in ("pods", "from_pods", "to_pods"):
            for pod in sorted(getattr(self, field)):
                if pod.count("/") != 1 or pod.startswith("/") or pod.endswith("/"):
                    out.append(f"{field}: {pod!r} is not namespace/name")
        out += [f"ports: {p} is not a port (1-65535)" for p in sorted(self.ports) if not 0 < p < 65536]
        for selector in sorted(self.fqdns):
            try:
                fqdn.validate_pattern(selector)
            except fqdn.FqdnError as exc:
                out.append(f"fqdns: {exc}")
        return out

    def matches_names(self, event: datapath_pb2.FlowEvent) -> bool:
        """Whether one of :attr:`fqdns` (if any) selects a source or destination name of ``event``."""
        if not self.fqdns:
            return True
        names = [*event.source_names, *event.destination_names]
        return any(fqdn.matches(s, n) for s in self.fqdns for n in names)

    def matches(self, event: datapath_pb2.FlowEvent) -> bool:
        """Every field but :attr:`fqdns` (see :meth:`matches_names`)."""
        if self.verdicts and event.verdict not in self.verdicts:
            return False
        if self.pods and event.source_pod not in self.pods and event.destination_pod not in self.pods:
            return False
        if self.namespaces and not (
            _namespace(event.source_pod) in self.namespaces or _namespace(event.destination_pod) in self.namespaces
        ):
            return False
        if self.from_pods and event.source_pod not in self.from_pods:
            return False
        if self.to_pods and event.destination_pod not in self.to_pods:
            return False
        if self.from_identities and event.source_identity not in self.from_identities:
            return False
        if self.to_identities and event.destination_identity not in self.to_identities:
            return False
        if self.ports and event.destination_port not in self.ports and event.source_port not in self.ports:
            return False
        return not self.protocols or event.protocol in self.protocols


class FlowRing:
    """The node's recent flow events, oldest first, at most ``size`` (the oldest go first)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._events: collections.deque[datapath_pb2.FlowEvent] = collections.deque(maxlen=size or 1)

    def add(self, event: datapath_pb2.FlowEvent) -> None:
        if self.size:
            self._events.append(event)

    def __len__(self) -> int:
        return len(self._events) if self.size else 0

    def history(self, flt: FlowFilter, *, since_ns: int = 0, last: int = 0) -> list[datapath_pb2.FlowEvent]:
        """The recorded events matching ``flt``, at or after ``since_ns`` (0: all), the ``last`` newest of
        them (0: all), oldest first."""
        if not self.size:
            return []
        out: list[datapath_pb2.FlowEvent] = []
        for event in reversed(self._events):
            if since_ns and event.time.ToNanoseconds() < since_ns:
                break  # events are appended in time order
            if flt.matches(event):
                out.append(event)
                if last and len(out) >= last:
                    break
        out.reverse()
        return out


@dataclasses.dataclass(frozen=True, order=True)
class FlowCountKey:
    """Flows counted per verdict, reason and direction (the metrics' labels)."""

    verdict: str
    reason: str
    direction: str


def count_key(raw: tuple[int, int, int]) -> FlowCountKey:
    """The labels of a (verdict, reason, direction) count, as the wire names them."""
    verdict, reason, direction = raw
    return FlowCountKey(
        common_pb2.Verdict.Name(verdict).removeprefix("VERDICT_").lower(),  # type: ignore[arg-type]
        datapath_pb2.FlowReason.Name(reason).removeprefix("FLOW_REASON_").lower(),  # type: ignore[arg-type]
        common_pb2.Direction.Name(direction).removeprefix("DIRECTION_").lower(),  # type: ignore[arg-type]
    )


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
        pod_at: Callable[[str], str] = lambda ip: "",
        poll_ms: int = 200,
        buffer: int = 4096,
        ring: int = 0,
        ring_rate: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._node = node
        self._pod_of = pod_of
        self._pod_at = pod_at
        #: Recent events, kept whether or not anyone observes (when its size is not 0).
        self.ring = FlowRing(ring)
        #: At most this many events a second are decoded for the ring alone (0: no limit); a flood
        #: beyond it is counted, not recorded (decoding costs the agent's CPU, which the packets share).
        self._ring_rate = ring_rate
        self._clock = clock
        self._window = 0.0
        self._window_events = 0
        #: Events not recorded in the ring for the rate.
        self.ring_skipped = 0
        #: Events decoded, per (verdict, reason, direction) wire numbers (labelled at scrape time:
        #: this is on the path of every event).
        self.counts: collections.Counter[tuple[int, int, int]] = collections.Counter()
        self._poll_ms = poll_ms
        self._buffer = buffer
        self._subs: set[Subscription] = set()
        self._joined = asyncio.Event()  # a client subscribed: stop skipping
        #: The read in flight hands every event it consumes to the subscribers. A skip (nobody
        #: observes) or a take for the ring alone (its rate) consumes events it does not decode:
        #: a client that subscribes meanwhile is served from the next read on.
        self._lossless = False
        self.events = 0
        #: Events dropped from the buffers of Observe clients that could not keep up.
        self.dropped = 0

    @classmethod
    def configured(
        cls,
        source: FlowSource,
        cfg: DatapathConfig,
        *,
        node: str,
        pod_of: Callable[[int], str],
        pod_at: Callable[[str], str] = lambda ip: "",
        clock: Callable[[], float] = time.monotonic,
    ) -> FlowHub:
        """The agent's hub: its poll, client buffers and ring (size and rate) from the datapath's settings."""
        return cls(
            source,
            node=node,
            pod_of=pod_of,
            pod_at=pod_at,
            poll_ms=cfg.flow_poll_ms,
            buffer=cfg.observe_buffer,
            ring=cfg.flow_ring_size,
            ring_rate=cfg.flow_ring_rate,
            clock=clock,
        )

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
                self.publish(flow_to_proto(event, self._node, self._pod_of(event.endpoint_id), self._pod_at))

    def _ring_over_rate(self) -> bool:
        if not self._ring_rate:
            return False
        now = self._clock()
        if now - self._window >= 1.0:
            self._window, self._window_events = now, 0
        return self._window_events >= self._ring_rate

    async def _read(self) -> Sequence[dt.FlowEvent]:
        """The next batch for the subscribers and the ring; none while nobody observes and the
        ring has no room (no ring, or it took its share of this second)."""
        self._joined.clear()
        if not self._subs and (not self.ring.size or self._ring_over_rate()):
            # The events are consumed (so a client that comes gets new ones, not a backlog) and
            # counted, never decoded; then the hub waits for a client or the next poll,
            # whichever comes first.
            self._lossless = False
            skipped = await asyncio.to_thread(self._source.skip_flows, 0)
            self.events += skipped
            if self.ring.size:
                self.ring_skipped += skipped
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._joined.wait(), self._poll_ms / 1000)
            return ()
        if self._subs or not self._ring_rate:
            self._lossless = True
            return await asyncio.to_thread(self._source.read_flows, self._poll_ms)
        # For the ring alone: no more than this second's share is decoded.
        self._lossless = False
        share = self._ring_rate - self._window_events
        batch, skipped = await asyncio.to_thread(self._source.take_flows, self._poll_ms, share)
        self.events += skipped
        self.ring_skipped += skipped
        return batch

    def publish(self, event: datapath_pb2.FlowEvent) -> None:
        self.events += 1
        self._window_events += 1
        self.counts[(event.verdict, event.reason, event.direction)] += 1
        self.ring.add(event)
        for sub in self._subs:
            if sub.offer(event):
                self.dropped += 1

    async def stream(
        self,
        flt: FlowFilter,
        limit: int = 0,
        *,
        since_ns: int = 0,
        last: int = 0,
        follow: bool = True,
    ) -> AsyncGenerator[datapath_pb2.FlowEvent, None]:
        """With ``since_ns`` or ``last``: the ring's matching events first (then live ones only if
        ``follow``); else events matching ``flt`` from the hub's next read on (it stops skipping at
        once for the first client). Stops after ``limit`` (0: until the caller stops)."""
        replay = bool(since_ns or last)
        sub: Subscription | None = None
        if follow or not replay:
            sub = Subscription(flt, self._buffer)
            self._subs.add(sub)
            self._joined.set()
        # Taken in the same step as subscribing: no event is both in the history and live, none in neither.
        history = self.ring.history(flt, since_ns=since_ns, last=last) if replay else []
        sent = 0
        try:
            for event in history:
                if limit and sent >= limit:
                    return
                yield event
                sent += 1
            if replay and sub is not None:
                yield datapath_pb2.FlowEvent(node=self._node, history_end=True)
            while sub is not None and (not limit or sent < limit):
                yield await sub.get()
                sent += 1
        finally:
            if sub is not None:
                self._subs.discard(sub)
            if sub is not None and sub.lost:
                log.info("observe client lost events", lost=sub.lost)

    @property
    def clients(self) -> int:
        """Clients subscribed, served or not yet."""
        return len(self._subs)

    @property
    def subscribers(self) -> int:
        """Clients being served: subscribed, and the read in flight hands them every event it
        consumes (it is no skip or rate-limited take begun before they came, which could
        consume their events undecoded); 0 until then."""
        return len(self._subs) if self._lossless else 0


VERDICTS = {common_pb2.VERDICT_ALLOW, common_pb2.VERDICT_DENY, common_pb2.VERDICT_AUDIT}
