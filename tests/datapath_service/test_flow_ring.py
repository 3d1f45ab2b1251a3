"""The flow hub's ring: recorded whether or not anyone observes, within its rate while nobody does."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.datapath import types as dt
from services.datapath.flows import FlowFilter, FlowHub


class Source:
    """Flow events handed out as the datapath's reader does: read decodes, skip only counts."""

    def __init__(self) -> None:
        self.pending: list[dt.FlowEvent] = []
        self._loop = asyncio.get_running_loop()
        #: Set once the hub took everything added (it reads in a worker thread).
        self.drained = asyncio.Event()

    def add(self, n: int, port: int) -> None:
        self.drained.clear()
        self.pending += [
            dt.FlowEvent(
                time=1000.0 + len(self.pending) / 1000,
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
            for _ in range(n)
        ]

    def read_flows(self, timeout_ms: int) -> Sequence[dt.FlowEvent]:
        out, self.pending = self.pending, []
        if out:
            self._loop.call_soon_threadsafe(self.drained.set)
        return out

    def take_flows(self, timeout_ms: int, limit: int) -> tuple[Sequence[dt.FlowEvent], int]:
        out = self.read_flows(timeout_ms)
        return out[:limit], len(out[limit:])

    def skip_flows(self, timeout_ms: int) -> int:
        n, self.pending = len(self.pending), []
        if n:
            self._loop.call_soon_threadsafe(self.drained.set)
        return n


async def taken(source: Source, hub: FlowHub, events: int) -> None:
    """The hub took and handled (published or skipped) ``events`` events in all."""
    await source.drained.wait()
    for _ in range(10_000):  # a bound, not a timing: each step lets the hub's task run
        if hub.events >= events:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"the hub handled {hub.events} events, not {events}")


async def test_the_ring_records_up_to_its_rate_a_second_while_nobody_observes() -> None:
    now = [0.0]
    source = Source()
    hub = FlowHub(source, node="n", pod_of=lambda ep: "x/db", poll_ms=10, ring=100, ring_rate=5, clock=lambda: now[0])
    task = asyncio.create_task(hub.run())
    try:
        source.add(7, 1)  # one read: the second's share is decoded, the rest counted
        await taken(source, hub, 7)
        source.add(4, 2)  # over the rate: counted, not recorded
        await taken(source, hub, 11)
        assert [e.destination_port for e in hub.ring.history(FlowFilter())] == [1] * 5
        assert (hub.events, hub.ring_skipped) == (11, 6)
        now[0] = 1.5  # the next second
        source.add(2, 3)
        await taken(source, hub, 13)
        assert [e.destination_port for e in hub.ring.history(FlowFilter())] == [1] * 5 + [3] * 2
        # an observer gets every event, whatever the rate
        stream = hub.stream(FlowFilter(), limit=8)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the stream subscribes on its first step
        source.add(8, 4)
        got = [await first] + [e async for e in stream]
        assert [e.destination_port for e in got] == [4] * 8
        assert len(hub.ring) == 15 and hub.ring_skipped == 6
    finally:
        task.cancel()
