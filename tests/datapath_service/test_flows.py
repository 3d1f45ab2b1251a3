"""The flow hub: a failed read of the ring buffer is retried, and events keep flowing after it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from services.datapath import types as dt
from services.datapath.flows import FlowFilter, FlowHub

EVENT = dt.FlowEvent(
    time=1.0,
    endpoint_id=7,
    ifindex=3,
    direction=dt.Direction.INGRESS,
    verdict=dt.Verdict.DENY,
    reason=dt.Reason.POLICY_DENY,
    source_identity=300,
    destination_identity=301,
    source_ip="10.0.0.1",
    destination_ip="10.0.0.2",
    source_port=40000,
    destination_port=80,
    protocol=6,
)


class FailingOnce:
    """A ring buffer whose first read fails; the next gives one event, later ones nothing."""

    def __init__(self) -> None:
        self.reads = 0
        self._idle = threading.Event()  # never set: an empty read waits its timeout, as the kernel's does

    def read_flows(self, timeout_ms: int) -> Sequence[dt.FlowEvent]:
        self.reads += 1
        if self.reads == 1:
            raise OSError("ring buffer poll failed")
        if self.reads == 2:
            return [EVENT]
        self._idle.wait(timeout_ms / 1000)
        return []

    def skip_flows(self, timeout_ms: int) -> int:
        return 0

    def take_flows(self, timeout_ms: int, most: int) -> tuple[Sequence[dt.FlowEvent], int]:
        return self.read_flows(timeout_ms), 0


async def test_a_failed_read_is_retried_and_the_next_events_reach_the_client() -> None:
    source = FailingOnce()
    hub = FlowHub(source, node="n1", pod_of=lambda endpoint: f"x/pod-{endpoint}", poll_ms=20)
    stream = hub.stream(FlowFilter(), limit=1)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # the client subscribes before the hub reads
    task = asyncio.create_task(hub.run())
    try:
        event = await asyncio.wait_for(first, 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
    assert (event.node, event.pod, event.endpoint_id, event.destination_port) == ("n1", "x/pod-7", 7, 80)
    assert source.reads >= 2 and hub.events == 1
