"""The flow hub's ring: bounded by its setting, oldest evicted, replayed by --since/--last, then
followed live; recorded whether or not anyone observes, within its rate while nobody does.

The hub reads the kernel's ring buffer from a worker thread. Here each of its reads is a call the
test answers: the read is handed to the test through a queue and waits for the events the test
gives it (a future), so no thread ever reads data the test is still writing, and the test knows
exactly which read it answers. The hub handles a batch entirely before it reads again, so the
next read's arrival says the previous batch is published: no sleeps, no polling.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest

from palisade.v1 import datapath_pb2
from services.common.config import load_config
from services.datapath import types as dt
from services.datapath.config import DatapathConfig
from services.datapath.flows import FlowFilter, FlowHub

#: Not a timing: a bound after which a hub that stopped reading fails the test instead of hanging it.
STUCK = 30.0


def event(port: int, second: float = 1000.0) -> dt.FlowEvent:
    return dt.FlowEvent(
        time=second,
        endpoint_id=1,
        ifindex=1,
        direction=dt.Direction.INGRESS,
        verdict=dt.Verdict.DENY,
        reason=dt.Reason.DEFAULT_DENY,
        source_identity=300,
        destination_identity=301,
        source_ip="10.0.0.1",
        destination_ip="10.0.0.2",
        source_port=40000,
        destination_port=port,
        protocol=17,
    )


@dataclasses.dataclass
class Read:
    """One read of the hub, waiting for the test's answer."""

    #: "read" (decode all), "take" (decode at most ``limit``, count the rest) or "skip" (count all).
    kind: str
    limit: int
    _answer: concurrent.futures.Future[list[dt.FlowEvent]]

    def give(self, *events: dt.FlowEvent) -> None:
        """The events the kernel had for this read."""
        self._answer.set_result(list(events))


class Kernel:
    """A flow ring buffer whose every read is answered by the test (a FlowSource)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reads: asyncio.Queue[Read] = asyncio.Queue()
        self._lock = threading.Lock()
        self._open: set[concurrent.futures.Future[list[dt.FlowEvent]]] = set()
        self._closed = False

    def _call(self, kind: str, limit: int) -> list[dt.FlowEvent]:
        """In the hub's worker thread: hand the read to the test, wait for its answer."""
        answer: concurrent.futures.Future[list[dt.FlowEvent]] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                return []
            self._open.add(answer)
        self._loop.call_soon_threadsafe(self._reads.put_nowait, Read(kind, limit, answer))
        try:
            return answer.result()
        finally:
            with self._lock:
                self._open.discard(answer)

    def read_flows(self, timeout_ms: int) -> Sequence[dt.FlowEvent]:
        return self._call("read", 0)

    def take_flows(self, timeout_ms: int, limit: int) -> tuple[Sequence[dt.FlowEvent], int]:
        events = self._call("take", limit)
        return events[:limit], len(events[limit:])

    def skip_flows(self, timeout_ms: int) -> int:
        return len(self._call("skip", 0))

    async def next_read(self, kind: str) -> Read:
        """The hub's next read, which must be of this kind."""
        read = await asyncio.wait_for(self._reads.get(), STUCK)
        assert read.kind == kind, f"the hub made a {read.kind} read, not a {kind} read"
        return read

    def close(self) -> None:
        """Release every read still waiting (the hub's task is cancelled; its thread must end)."""
        with self._lock:
            self._closed = True
            for answer in self._open:
                if not answer.done():
                    answer.set_result([])


@pytest.fixture
async def kernel() -> AsyncIterator[Kernel]:
    k = Kernel()
    yield k
    k.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def hubs(kernel: Kernel) -> Iterator[list[asyncio.Task[None]]]:
    """Tasks running hubs; cancelled at the end (the kernel fixture then releases their reads)."""
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    for task in tasks:
        task.cancel()


def start(hub: FlowHub, hubs: list[asyncio.Task[None]]) -> FlowHub:
    hubs.append(asyncio.create_task(hub.run()))
    return hub


def configured(kernel: Kernel, clock: Clock, *flags: str) -> FlowHub:
    cfg = load_config(DatapathConfig, ["--node-name", "n", *flags], env={})
    return FlowHub.configured(kernel, cfg, node="n", pod_of=lambda ep: "x/db", clock=clock)


def ports(events: Sequence[datapath_pb2.FlowEvent]) -> list[int]:
    return [e.destination_port for e in events]


async def subscribe(
    hub: FlowHub, stream: AsyncIterator[datapath_pb2.FlowEvent]
) -> asyncio.Future[datapath_pb2.FlowEvent]:
    """Start ``stream`` (it subscribes on its first step) and return its first item to come."""
    before = hub.clients
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # one loop turn: the task just made runs its first step
    assert hub.clients == before + 1
    return first


async def test_the_ring_holds_its_settings_size_and_evicts_the_oldest(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    hub = start(configured(kernel, clock, "--flow-ring-size", "5", "--flow-ring-rate", "0"), hubs)
    (await kernel.next_read("read")).give(*(event(p) for p in (1, 2, 3)))
    (await kernel.next_read("read")).give(*(event(p) for p in (4, 5, 6, 7)))
    await kernel.next_read("read")  # both batches are published
    assert hub.ring.size == 5 and len(hub.ring) == 5
    assert ports(hub.ring.history(FlowFilter())) == [3, 4, 5, 6, 7]
    assert hub.events == 7


async def test_no_ring_keeps_nothing_and_skips_while_nobody_observes(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    hub = start(configured(kernel, clock, "--flow-ring-size", "0"), hubs)
    (await kernel.next_read("skip")).give(event(1), event(2))
    await kernel.next_read("skip")
    assert len(hub.ring) == 0 and hub.ring.history(FlowFilter()) == []
    assert (hub.events, hub.ring_skipped) == (2, 0)


async def test_since_and_last_replay_the_ring_then_end(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    hub = start(configured(kernel, clock, "--flow-ring-size", "100", "--flow-ring-rate", "0"), hubs)
    (await kernel.next_read("read")).give(*(event(p, second=1000.0 + p) for p in range(1, 7)))
    await kernel.next_read("read")

    async def replay(flt: FlowFilter | None = None, **kw: int) -> list[int]:
        return ports([e async for e in hub.stream(flt or FlowFilter(), follow=False, **kw)])

    assert await replay(last=2) == [5, 6]  # the newest, oldest first
    assert await replay(last=100) == [1, 2, 3, 4, 5, 6]
    assert await replay(since_ns=1004 * 10**9) == [4, 5, 6]  # at or after
    assert await replay(since_ns=1004 * 10**9, last=2) == [5, 6]
    assert await replay(FlowFilter(ports=frozenset({2, 5})), last=100) == [2, 5]
    assert await replay(FlowFilter(ports=frozenset({2, 5})), last=1) == [5]  # the last N that match
    assert await replay(last=3, limit=2) == [4, 5]
    assert hub.clients == 0  # a replay without follow never subscribed


async def test_follow_gives_the_history_its_end_then_live_flows(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    hub = start(configured(kernel, clock, "--flow-ring-size", "100", "--flow-ring-rate", "0"), hubs)
    (await kernel.next_read("read")).give(event(1), event(2), event(3))
    live = await kernel.next_read("read")  # in flight while the client comes
    stream = hub.stream(FlowFilter(ports=frozenset({2, 3, 4, 5})), last=1, follow=True, limit=3)
    first = await subscribe(hub, stream)
    assert hub.subscribers == 1  # a read that decodes everything is in flight: the client is served
    got = [await first, await anext(stream)]
    assert ports(got[:1]) == [3] and got[1].history_end and got[1].node == "n"
    live.give(event(4), event(1), event(5))  # 1 does not match
    rest = [e async for e in stream]
    assert ports(rest) == [4, 5]  # then the limit ends the stream
    await kernel.next_read("read")
    assert hub.clients == 0 and ports(hub.ring.history(FlowFilter())) == [1, 2, 3, 4, 1, 5]


async def test_the_ring_records_up_to_its_rate_a_second_while_nobody_observes(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    hub = start(configured(kernel, clock, "--flow-ring-size", "100", "--flow-ring-rate", "5"), hubs)
    take = await kernel.next_read("take")
    assert take.limit == 5  # the second's share
    take.give(*(event(1) for _ in range(7)))  # decoded up to the share, the rest counted
    (await kernel.next_read("skip")).give(*(event(2) for _ in range(4)))  # over the rate: counted
    clock.now = 1.5  # the next second
    take = await kernel.next_read("take")
    assert ports(hub.ring.history(FlowFilter())) == [1] * 5
    assert (hub.events, hub.ring_skipped) == (11, 6)
    assert take.limit == 5
    take.give(event(3), event(3))
    take = await kernel.next_read("take")
    assert take.limit == 3  # what is left of the second's share
    assert ports(hub.ring.history(FlowFilter())) == [1] * 5 + [3] * 2
    assert (hub.events, hub.ring_skipped) == (13, 6)


async def test_an_observer_gets_every_event_whatever_the_rate(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    hub = start(configured(kernel, clock, "--flow-ring-size", "10", "--flow-ring-rate", "2"), hubs)
    (await kernel.next_read("take")).give(event(1), event(1))
    skip = await kernel.next_read("skip")  # over the rate: nobody observes, nothing is decoded
    stream = hub.stream(FlowFilter(), limit=8)
    first = await subscribe(hub, stream)
    assert hub.subscribers == 0  # the skip in flight began before the client came
    skip.give(event(2))  # consumed by that skip: not the client's
    read = await kernel.next_read("read")  # the client woke the hub from its pause at once
    assert hub.subscribers == 1
    read.give(*(event(4) for _ in range(8)))
    got = [await first] + [e async for e in stream]
    assert ports(got) == [4] * 8
    assert hub.clients == 0
    # The hub read again as soon as it had handed out the batch, before the client left.
    (await kernel.next_read("read")).give()
    await kernel.next_read("skip")  # alone again, and over the rate
    assert len(hub.ring) == 10 and ports(hub.ring.history(FlowFilter())) == [1, 1] + [4] * 8
    assert (hub.events, hub.ring_skipped) == (11, 1)


async def test_a_client_coming_during_a_take_for_the_ring_is_served_from_the_next_read(
    kernel: Kernel, clock: Clock, hubs: list[asyncio.Task[None]]
) -> None:
    """A take for the ring alone decodes its share and only counts the rest: a client that comes
    meanwhile is not yet served (the hub says so), and every event of the next read is its."""
    hub = start(configured(kernel, clock, "--flow-ring-size", "100", "--flow-ring-rate", "2"), hubs)
    take = await kernel.next_read("take")
    stream = hub.stream(FlowFilter(), limit=5)
    first = await subscribe(hub, stream)
    assert hub.subscribers == 0
    take.give(event(1), event(1), event(1))  # the share (2) is decoded and published, 1 counted
    read = await kernel.next_read("read")
    assert hub.subscribers == 1
    read.give(event(2), event(2), event(2))
    got = [await first] + [e async for e in stream]
    assert ports(got) == [1, 1, 2, 2, 2]
    assert (hub.events, hub.ring_skipped) == (6, 1)
