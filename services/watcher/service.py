"""The watcher service: one source (Kubernetes API or manifest folder) published to NATS.

Health stays NOT_SERVING until the synced marker is on the bus.
"""

from __future__ import annotations

from pathlib import Path

from palisade.v1 import identity_pb2
from services.common.bus import IPCACHE_STREAM, Bus
from services.common.gctuning import freeze_loaded, tune_gc
from services.common.runner import ServiceContext, run_service
from services.common.subjects import IPCACHE_ALL
from services.watcher.config import SourceKind, WatcherConfig
from services.watcher.kube import KubeSettings, KubeSource, load_client_configuration
from services.watcher.manifests import ManifestSource
from services.watcher.metrics import WatcherMetrics
from services.watcher.pipeline import Watcher
from services.watcher.source import Source


def build_source(cfg: WatcherConfig) -> Source:
    if cfg.source_kind() is SourceKind.KUBERNETES:
        settings = KubeSettings(
            watch_timeout=cfg.watch_timeout,
            backoff_initial=cfg.backoff_initial,
            backoff_max=cfg.backoff_max,
            missing_retry=cfg.missing_kind_retry,
            page_size=cfg.list_page_size,
        )
        return KubeSource(load_client_configuration(cfg.kubeconfig), settings=settings)
    return ManifestSource(
        Path(cfg.manifests).resolve(),
        poll_interval=cfg.manifests_poll,
        notify=cfg.manifests_notify,
        dev_nodes=cfg.dev_node_addresses(),
        service_cidr=cfg.service_cidr,
    )


async def follow_pod_addresses(bus: Bus, source: ManifestSource) -> None:
    """A dev cluster's EndpointSlices need the pods' addresses, which ipam gives (the ipcache)."""
    by_prefix: dict[str, tuple[str, str]] = {}
    by_pod: dict[tuple[str, str], set[str]] = {}

    async def on_entry(subject: str, entry: identity_pb2.IpcacheEntry) -> None:
        ip = entry.prefix.split("/")[0]
        old = by_prefix.pop(ip, None)
        if old is not None:
            by_pod.get(old, set()).discard(ip)
            source.set_pod_addresses(*old, tuple(sorted(by_pod.get(old, ()))))
        if entry.deleted or not entry.pod:
            return
        pod = (entry.namespace, entry.pod)
        by_prefix[ip] = pod
        by_pod.setdefault(pod, set()).add(ip)
        source.set_pod_addresses(*pod, tuple(sorted(by_pod[pod])))

    await bus.follow(IPCACHE_ALL, identity_pb2.IpcacheEntry, on_entry)


async def setup(ctx: ServiceContext[WatcherConfig]) -> None:
    tune_gc()
    source = build_source(ctx.config)
    bus = await ctx.bus()
    watcher = Watcher(bus, source, WatcherMetrics(), max_inflight=ctx.config.publish_inflight)
    ctx.server.status.provider = watcher.fill_status

    async def serve_when_synced() -> None:
        await watcher.synced.wait()
        freeze_loaded()
        await ctx.server.set_serving(True)

    ctx.spawn(watcher.run(), "watcher")
    if isinstance(source, ManifestSource) and ctx.config.service_cidr:
        await bus.ensure_streams(IPCACHE_STREAM)
        await follow_pod_addresses(bus, source)
    ctx.spawn(serve_when_synced(), "watcher-ready")


def main(argv: list[str] | None = None) -> int:
    return run_service("watcher", WatcherConfig, setup, argv)
