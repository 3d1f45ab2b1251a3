"""Watcher throughput: deltas published per second from a large initial list.

    .venv/bin/python -m bench.bench_watcher [--objects 10000] [--inflight 256]

Starts its own nats-server (JetStream, file storage) and its own list/watch API
server (in a child process, as a real API server would be a process of its own), then
runs the watcher with the Kubernetes source in-process and prints one JSON object:

- ``first_sync``: from start to the synced marker acked (every delta of the
  initial list acked by JetStream before it): ``deltas_per_second`` is the figure.
- ``restart``: a second watcher over the same stream and cluster (nothing
  changed): reading the stream back, listing, diffing, publishing nothing.

The garbage collector is tuned as the service tunes it (``--default-gc`` to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.bus import Bus
from services.common.gctuning import tune_gc
from services.watcher.kube import KubeSettings, KubeSource, load_client_configuration
from services.watcher.metrics import WatcherMetrics
from services.watcher.pipeline import Watcher
from testkit.apiserver import FakeApiServer
from testkit.harness import NatsServer, creds


def make_pod(i: int) -> dict[str, Any]:
    """A pod of realistic size: labels, a container with ports, status with IPs and conditions."""
    ns = f"ns-{i % 50}"
    ip = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"app-{i}-7d9f8c6b5-x{i % 97:02d}",
            "namespace": ns,
            "labels": {"app": f"app-{i % 200}", "tier": "backend", "pod-template-hash": "7d9f8c6b5"},
            "annotations": {"prometheus.io/scrape": "true"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"app-{i}", "uid": "x"}],
        },
        "spec": {
            "nodeName": f"node-{i % 20}",
            "serviceAccountName": "default",
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example.com/app:1.2.3",
                    "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                }
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": f"192.168.0.{i % 20}",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:00Z"}],
        },
    }


def _serve(objects: int, conn: Connection) -> None:
    """Child process: populate and serve the cluster until told to stop."""

    async def serve() -> None:
        api = FakeApiServer()
        for i in range(objects):
            api.create("pods", make_pod(i))
        await api.start()
        conn.send((api.url, api.token))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await api.stop()

    asyncio.run(serve())


class ApiServerProcess:
    """The list/watch server in its own process, as a real API server would be: serving the
    list costs the watcher no CPU time of its own process (it still shares the machine)."""

    def __init__(self, objects: int) -> None:
        self._conn, child = multiprocessing.Pipe()
        self._proc = multiprocessing.Process(target=_serve, args=(objects, child), daemon=True)

    def __enter__(self) -> tuple[str, str]:
        self._proc.start()
        url, token = self._conn.recv()
        return str(url), str(token)

    def __exit__(self, *exc: object) -> None:
        self._conn.send("stop")
        self._proc.join(10)


def write_kubeconfig(path: Path, url: str, token: str) -> Path:
    server = FakeApiServer(token=token)
    server.port = int(url.rpartition(":")[2])
    return server.write_kubeconfig(path)


async def run_once(bus: Bus, kubeconfig: Path, inflight: int, page_size: int, timeout: float) -> dict[str, float]:
    registry = CollectorRegistry()
    metrics = WatcherMetrics(registry)
    settings = KubeSettings(page_size=page_size)
    watcher = Watcher(
        bus, KubeSource(load_client_configuration(str(kubeconfig)), settings=settings), metrics, max_inflight=inflight
    )
    started = time.perf_counter()
    task = asyncio.create_task(watcher.run())
    try:
        try:
            await asyncio.wait_for(watcher.synced.wait(), timeout)
        except TimeoutError:
            raise SystemExit(
                f"the watcher did not sync within {timeout:.0f}s; is nats-server still running "
                "(publishing waits for it forever)? Raise --timeout for very large lists"
            ) from None
        synced_at = time.perf_counter()
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    published = sum(
        registry.get_sample_value("palisade_watcher_deltas_published_total", {"kind": "pod", "op": op}) or 0
        for op in ("upsert", "delete")
    )
    seconds = synced_at - started
    return {
        "deltas_published": published,
        "seconds_to_synced": round(seconds, 3),
        "deltas_per_second": round(published / seconds, 1) if published else 0.0,
    }


async def bench(objects: int, inflight: int, page_size: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="palisade-bench-") as tmp:
        nats = NatsServer(Path(tmp) / "nats")
        nats.start()
        try:
            with ApiServerProcess(objects) as (url, token):
                kubeconfig = write_kubeconfig(Path(tmp) / "kubeconfig", url, token)
                async with await Bus.connect([nats.url], name="bench", tls=creds()) as bus:
                    first = await run_once(bus, kubeconfig, inflight, page_size, timeout)
                    restart = await run_once(bus, kubeconfig, inflight, page_size, timeout)
        finally:
            nats.stop()
    return {
        "benchmark": "watcher_initial_list",
        "objects": objects,
        "publish_inflight": inflight,
        "list_page_size": page_size,
        "first_sync": first,
        "restart": restart,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=10_000, help="pods in the initial list")
    parser.add_argument("--inflight", type=int, default=256, help="subjects published concurrently")
    parser.add_argument("--page-size", type=int, default=500, help="objects per list page")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before giving up")
    parser.add_argument(
        "--default-gc", action="store_true", help="keep CPython's GC thresholds instead of the service's tuning"
    )
    args = parser.parse_args(argv)
    if not args.default_gc:
        tune_gc()  # as the service does
    result = asyncio.run(bench(args.objects, args.inflight, args.page_size, args.timeout))
    result["gc_thresholds"] = list(gc.get_threshold())
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
