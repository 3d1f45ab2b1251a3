"""The watcher service shell: connects to NATS and provisions the k8s stream."""

from __future__ import annotations

from services.common.bus import K8S_STREAM
from services.common.runner import ServiceContext, run_service
from services.watcher.config import WatcherConfig


async def setup(ctx: ServiceContext[WatcherConfig]) -> None:
    bus = await ctx.bus()
    await bus.ensure_stream(K8S_STREAM)
    await ctx.server.set_serving(True)


def main(argv: list[str] | None = None) -> int:
    return run_service("watcher", WatcherConfig, setup, argv)
