"""Wires a source to the bus: stream state -> reconciler <- source events, reconciler -> publisher -> NATS.

watcher = Watcher(bus, source, WatcherMetrics())
await watcher.run()   # until cancelled; watcher.synced is set once the marker is on the bus
"""

from __future__ import annotations

import asyncio

from palisade.v1 import common_pb2
from services.common.bus import K8S_STREAM, Bus
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
        self.publisher = Publisher(bus.publish, max_inflight=max_inflight)
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
        await self._bus.ensure_stream(K8S_STREAM)
        # Before the source says anything: what an earlier run left on the stream, so that
        # objects deleted while no watcher ran get their tombstones from the first lists.
        published = await load_published(self._bus, self.source.kinds)
        self.reconciler.seed(published)
        self.source.seed(published)
        log.info("source starting", source=self.source.name)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.publisher.run(), name="watcher-publisher")
            tg.create_task(self._apply(), name="watcher-reconciler")
            tg.create_task(self.source.run(self._events.put_nowait), name="watcher-source")

    async def _apply(self) -> None:
        while True:
            event = await self._events.get()
            self.reconciler.handle(event)
