"""The publisher keeps per-subject order and the synced barrier through a NATS outage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from palisade.v1 import k8s_pb2
from services.common.bus import Bus
from services.common.subjects import SYNCED_SUBJECT
from services.watcher.publisher import Publisher
from testkit.harness import NatsServer
from tests.watcher.helpers import StreamReader, eventually

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


async def test_a_message_that_cannot_be_sent_is_reported_and_blocks_nothing(bus: Bus, reader: Reader) -> None:
    publisher = Publisher(bus.publish, max_inflight=4)
    failures: list[tuple[str, str]] = []
    publisher.on_failed = lambda subject, reason: failures.append((subject, reason))
    task = asyncio.create_task(publisher.run())
    stream = await reader()
    try:
        huge = k8s_pb2.K8sDelta(name="huge", object_json=b"x" * (bus.max_payload + 1))
        publisher.submit("palisade.k8s.pod.t.huge", huge)
        publisher.submit("palisade.k8s.pod.t.other", k8s_pb2.K8sDelta(name="other"))
        await asyncio.wait_for(publisher.wait_idle(), 30)
        assert publisher.pending == 0
        assert [s for s, _ in failures] == ["palisade.k8s.pod.t.huge"]
        assert "MaxPayloadError" in failures[0][1] and "skipped until it changes" in failures[0][1]
        assert "palisade.k8s.pod.t.huge" in publisher.failed
        await eventually(lambda: "palisade.k8s.pod.t.other" in stream.last, "the other subject published")

        # A later message of the failed subject that fits clears the failure.
        publisher.submit("palisade.k8s.pod.t.huge", k8s_pb2.K8sDelta(name="huge"))
        await asyncio.wait_for(publisher.wait_idle(), 30)
        assert failures[-1] == ("palisade.k8s.pod.t.huge", "") and not publisher.failed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_cancellation_a_publish_swallowed_still_stops_the_publisher() -> None:
    """Python 3.11's asyncio.wait_for (under nats.py's publish) can swallow a cancellation that
    arrives as the ack does: the publish returns. The publisher must stop anyway, not wait for a
    next item that never comes (a watcher's shutdown hung on it)."""
    started = asyncio.Event()

    async def swallowing(subject: str, message: object) -> int:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # as wait_for may, when the inner future finishes as the cancellation lands
        return 1

    publisher = Publisher(swallowing, max_inflight=4)
    task = asyncio.create_task(publisher.run())
    publisher.submit_barrier(SYNCED_SUBJECT, k8s_pb2.SyncedMarker(source="test"))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done, "the publisher went on waiting for items after it was cancelled"
    assert task.cancelled()
