"""Wires a source to the bus: stream state -> reconciler <- source events, reconciler -> publisher -> NATS.

watcher = Watcher(bus, source, WatcherMetrics())
await watcher.run()   # until cancelled; watcher.synced is set once the marker is on the bus
"""

from __future__ import annotations

import asyncio

from google.protobuf.message import Message

from palisade.v1 import common_pb2, k8s_pb2
from services.common.bus import K8S_STREAM, Bus
from services.common.largeobjects import LargeObjects
from services.common.log import get_logger
from services.watcher.metrics import WatcherMetrics
from services.watcher.published import load_published
from services.watcher.publisher import Publisher
from services.watcher.reconciler import Reconciler
from services.watcher.source import Source, SourceEvent

log = get_logger("watcher")


class Watcher:
    def __init__(self, bus: Bus, source: Source, metrics: WatcherMetrics, *, max_inflight: int = 256) -> None:
        self._bus = bus
        self.source = source
        self.large = LargeObjects(bus)
        #: The stored large object each subject's last published delta references.
        self._refs: dict[str, str] = {}
        self.publisher = Publisher(self._send, max_inflight=max_inflight)
        self.reconciler = Reconciler(
            source=source.name,
            status_token=source.status_token,
            kinds=source.kinds,
            publisher=self.publisher,
            metrics=metrics,
        )
        metrics.pending.set_function(lambda: self.publisher.pending)
        self._events: asyncio.Queue[SourceEvent] = asyncio.Queue()

    @property
    def synced(self) -> asyncio.Event:
        return self.reconciler.synced

    def fill_status(self, status: common_pb2.ServiceStatus) -> None:
        self.reconciler.fill_status(status)

    async def run(self) -> None:
        await self._bus.ensure_streams(K8S_STREAM)
        # Before the source says anything: what an earlier run left on the stream, so that
        # objects deleted while no watcher ran get their tombstones from the first lists.
        published = await load_published(self._bus, self.source.kinds, self.large)
        self.reconciler.seed(published.objects)
        self.source.seed(published.objects)
        self._refs = dict(published.refs)
        await self.large.collect(self._refs.values())
        log.info("source starting", source=self.source.name)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.publisher.run(), name="watcher-publisher")
            tg.create_task(self._apply(), name="watcher-reconciler")
            tg.create_task(self.source.run(self._events.put_nowait), name="watcher-source")

    async def _send(self, subject: str, message: Message) -> int:
        """Publish one message; a delta too large for a message goes to the object store first."""
        if not isinstance(message, k8s_pb2.K8sDelta):
            return await self._bus.publish(subject, message)
        message = await self.large.externalize(message)
        seq = await self._bus.publish(subject, message)
        old = self._refs.pop(subject, None)
        if message.object_ref:
            self._refs[subject] = message.object_ref
        if old is not None and old != message.object_ref:
            await self.large.forget(old)
        return seq

    async def _apply(self) -> None:
        while True:
            event = await self._events.get()
            self.reconciler.handle(event)
