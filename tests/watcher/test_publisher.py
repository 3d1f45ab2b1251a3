"""The publisher keeps per-subject order and the synced barrier through a NATS outage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from palisade.v1 import k8s_pb2
from services.common.bus import Bus
from services.common.subjects import SYNCED_SUBJECT
from services.watcher.publisher import Publisher
from tests.harness import NatsServer
from tests.watcher.conftest import StreamReader, eventually

Reader = Callable[[], Awaitable[StreamReader]]


async def test_order_and_barrier_survive_a_nats_outage(nats_server: NatsServer, bus: Bus, reader: Reader) -> None:
    publisher = Publisher(bus.publish, max_inflight=4)
    task = asyncio.create_task(publisher.run())
    acked: list[str] = []
    try:
        await asyncio.to_thread(nats_server.stop)
        subjects = [f"palisade.k8s.pod.t.p{i}" for i in range(10)]

        def record(subject: str, version: int) -> Callable[[], None]:
            return lambda: acked.append(f"{subject}@{version}")

        for version in range(20):
            for subject in subjects:
                delta = k8s_pb2.K8sDelta(name=subject, resource_version=str(version))
                publisher.submit(subject, delta, record(subject, version))
        publisher.submit_barrier(SYNCED_SUBJECT, k8s_pb2.SyncedMarker(source="test"), lambda: acked.append("marker"))
        assert publisher.pending == 201

        await asyncio.to_thread(nats_server.start)
        await asyncio.wait_for(publisher.wait_idle(), 60)
        assert publisher.pending == 0
        # Every message acked, each subject in submission order, the barrier last.
        assert len(acked) == 201 and acked[-1] == "marker"
        for subject in subjects:
            mine = [a for a in acked if a.startswith(subject + "@")]
            assert mine == [f"{subject}@{v}" for v in range(20)]

        # The compacted stream holds each subject's last version, and the marker after all of them.
        stream = await reader()
        await eventually(lambda: bool(stream.markers), "marker replayed")
        assert {s: d.resource_version for s, d in stream.last.items()} == {s: "19" for s in subjects}
        assert len(stream.deltas) == len(subjects)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
