"""Shared pieces of the watcher tests: a stream reader, in-process watchers, sources, polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from palisade.v1 import k8s_pb2
from services.common.bus import Bus
from services.common.subjects import STATUS_SUBJECT_PREFIX, SYNCED_SUBJECT
from services.watcher.kube import KubeSettings, KubeSource, load_client_configuration
from services.watcher.manifests import ManifestSource
from services.watcher.metrics import WatcherMetrics
from services.watcher.pipeline import Watcher
from services.watcher.source import Source

#: Upper bound for anything to show up; a safety net that fails a stuck test, not a speed assertion.
WAIT = 20.0


FAST_KUBE = KubeSettings(watch_timeout=60, backoff_initial=0.05, backoff_max=0.5, missing_retry=0.3, page_size=50)


async def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Wait until ``check()`` holds; fail naming ``what`` if it never does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


@dataclass
class StreamReader:
    """A plain ordered consumer over palisade.k8s.> decoding each subject's payload type."""

    deltas: list[tuple[str, k8s_pb2.K8sDelta]] = field(default_factory=list)
    last: dict[str, k8s_pb2.K8sDelta] = field(default_factory=dict)
    markers: list[k8s_pb2.SyncedMarker] = field(default_factory=list)
    statuses: list[k8s_pb2.SourceStatus] = field(default_factory=list)
    _sub: Any = None

    async def on_msg(self, msg: Msg) -> None:
        if msg.subject == SYNCED_SUBJECT:
            self.markers.append(k8s_pb2.SyncedMarker.FromString(msg.data))
        elif msg.subject.startswith(STATUS_SUBJECT_PREFIX):
            self.statuses.append(k8s_pb2.SourceStatus.FromString(msg.data))
        else:
            delta = k8s_pb2.K8sDelta.FromString(msg.data)
            self.deltas.append((msg.subject, delta))
            self.last[msg.subject] = delta

    def current(self) -> dict[str, dict[str, Any]]:
        """subject -> object of every subject whose last delta is an upsert: the state a consumer rebuilds.

        An object stored aside (``object_ref``) shows as ``{"object_ref": name}``.
        """
        return {
            s: json.loads(d.object_json) if not d.object_ref else {"object_ref": d.object_ref}
            for s, d in self.last.items()
            if d.op == k8s_pb2.DELTA_OP_UPSERT
        }

    def tombstones(self) -> set[str]:
        return {s for s, d in self.last.items() if d.op == k8s_pb2.DELTA_OP_DELETE}

    def ops(self, subject: str) -> list[int]:
        return [d.op for s, d in self.deltas if s == subject]

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


@dataclass
class Running:
    watcher: Watcher
    metrics: WatcherMetrics
    registry: CollectorRegistry
    task: asyncio.Task[None]

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def running(bus: Bus, source: Source) -> AsyncIterator[Running]:
    """Run a watcher in this process until the block ends."""
    registry = CollectorRegistry()
    metrics = WatcherMetrics(registry)
    watcher = Watcher(bus, source, metrics, max_inflight=64)
    task = asyncio.create_task(watcher.run())
    try:
        yield Running(watcher, metrics, registry, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def kube_source(kubeconfig: Path, settings: KubeSettings = FAST_KUBE) -> KubeSource:
    return KubeSource(load_client_configuration(str(kubeconfig)), settings=settings)


def manifest_source(folder: Path) -> ManifestSource:
    return ManifestSource(folder, poll_interval=0.05)
