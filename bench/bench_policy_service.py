"""Policy service latency: a policy delta on NATS -> regeneration orders for every node on NATS.

Starts its own nats-server and a ``python -m services.policy`` process, loads
``--policies`` NetworkPolicies and ``--identities`` pod identities spread over
``--nodes`` nodes (published on the bus as the watcher and ipam would), then
changes one existing policy at a time and times, at a NATS subscriber, from
publishing the delta to receiving the order of the last node. Prints one JSON
object.

    .venv/bin/python bench/bench_policy_service.py --policies 1000 --identities 2000 --nodes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.stats import percentile
from palisade.v1 import common_pb2, identity_pb2, k8s_pb2, policy_pb2
from services.common.bus import ALL_STREAMS, Bus
from services.common.subjects import (
    REGEN_ALL,
    SYNCED_SUBJECT,
    identity_subject,
    ipcache_subject,
    k8s_subject,
)
from testkit.harness import NatsServer, ServiceProcess, creds

ROOT = Path(__file__).resolve().parent.parent

NAMESPACES = 20


def identity_update(number: int, namespace: str, app: str) -> identity_pb2.IdentityUpdate:
    labels = [
        common_pb2.Label(source="k8s", key="app", value=app),
        common_pb2.Label(source="k8s", key="io.kubernetes.pod.namespace", value=namespace),
        common_pb2.Label(source="k8s", key="io.cilium.k8s.policy.cluster", value="default"),
    ]
    return identity_pb2.IdentityUpdate(
        identity=identity_pb2.Identity(id=number, labels=labels, kind=identity_pb2.IDENTITY_KIND_CLUSTER)
    )


def policy_doc(index: int, apps_per_ns: int, port: int) -> dict[str, Any]:
    """Policy ``index``: in its namespace, app a<k> accepts ``port`` from app a<k+1>."""
    k = index % apps_per_ns
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"p{index}", "namespace": f"ns{index % NAMESPACES}"},
        "spec": {
            "podSelector": {"matchLabels": {"app": f"a{k}"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"app": f"a{(k + 1) % apps_per_ns}"}}}],
                    "ports": [{"port": port, "protocol": "TCP"}],
                }
            ],
        },
    }


def policy_delta(doc: dict[str, Any]) -> tuple[str, k8s_pb2.K8sDelta]:
    meta = doc["metadata"]
    delta = k8s_pb2.K8sDelta(
        kind=k8s_pb2.K8S_KIND_NETWORK_POLICY,
        op=k8s_pb2.DELTA_OP_UPSERT,
        namespace=meta["namespace"],
        name=meta["name"],
        object_json=json.dumps(doc).encode(),
        source="bench",
    )
    return k8s_subject("networkpolicy", meta["namespace"], meta["name"]), delta


async def load_world(bus: Bus, args: argparse.Namespace, apps_per_ns: int) -> None:
    for i in range(args.identities):
        number = 256 + i
        namespace = f"ns{i % NAMESPACES}"
        app = f"a{(i // NAMESPACES) % apps_per_ns}"
        await bus.publish(identity_subject(number), identity_update(number, namespace, app))
        ip = f"10.{i // 65536 + 1}.{(i // 256) % 256}.{i % 256}"
        entry = identity_pb2.IpcacheEntry(
            prefix=f"{ip}/32", identity=number, node=f"node-{i % args.nodes}", namespace=namespace, pod=f"pod-{i}"
        )
        await bus.publish(ipcache_subject(entry.prefix), entry)
    for j in range(args.policies):
        subject, delta = policy_delta(policy_doc(j, apps_per_ns, 1000 + j % 1000))
        await bus.publish(subject, delta)
    await bus.publish(SYNCED_SUBJECT, k8s_pb2.SyncedMarker(kinds=["networkpolicy"], source="bench"))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apps_per_ns = max(1, args.identities // NAMESPACES)
    with tempfile.TemporaryDirectory(prefix="palisade-bench-") as tmp:
        nats = NatsServer(Path(tmp) / "nats")
        nats.start()
        proc: ServiceProcess | None = None
        try:
            bus = await Bus.connect([nats.url], name="bench", retries=5, backoff=0.05, tls=creds())
            await bus.ensure_streams(*ALL_STREAMS)
            load_started = time.perf_counter()
            await load_world(bus, args, apps_per_ns)
            published = time.perf_counter() - load_started

            latest: dict[str, int] = {}
            arrived: dict[str, float] = {}
            changed = asyncio.Event()

            async def on_order(msg: Any) -> None:
                order = policy_pb2.RegenerationOrder()
                order.ParseFromString(msg.data)
                if order.revision > latest.get(order.node, 0):
                    latest[order.node] = order.revision
                    arrived[order.node] = time.perf_counter()
                    changed.set()

            await bus.nc.subscribe(REGEN_ALL, cb=on_order)
            await bus.nc.flush()

            proc = ServiceProcess("policy", Path(tmp), ["--nats-url", nats.url, "--log-level", "warning"])
            started = time.perf_counter()
            proc.start(wait=False)
            await asyncio.to_thread(proc.wait_serving, 600.0)
            ready = time.perf_counter() - started

            async def all_nodes_above(revision: int) -> float:
                while True:
                    if len(latest) == args.nodes and all(r > revision for r in latest.values()):
                        return max(arrived.values())
                    changed.clear()
                    await asyncio.wait_for(changed.wait(), 60)

            await all_nodes_above(0)
            samples: list[float] = []
            for n in range(args.samples):
                index = (n * 37) % args.policies
                port = 20000 + n
                subject, delta = policy_delta(policy_doc(index, apps_per_ns, port))
                before = max(latest.values())
                sent = time.perf_counter()
                await bus.publish(subject, delta)
                done = await all_nodes_above(before)
                samples.append((done - sent) * 1000.0)
            await bus.close()
        finally:
            if proc is not None:
                proc.terminate()
            nats.stop()
    p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
    return {
        "summary": [
            {"metric": "policy delta -> orders on every node, p50", "value": round(p50, 3), "unit": "ms"},
            {"metric": "policy delta -> orders on every node, p99", "value": round(p99, 3), "unit": "ms"},
            {"metric": "start -> SERVING with the world loaded", "value": round(ready, 3), "unit": "s"},
        ],
        "plots": [
            {
                "name": "policy_service_delta_to_orders",
                "title": f"Delta to orders ({args.policies} policies, {args.identities} identities, "
                f"{args.nodes} nodes)",
                "xlabel": "ms",
                "ylabel": "samples",
                "kind": "hist",
                "series": {"delta to orders": [round(v, 3) for v in samples]},
            }
        ],
        "benchmark": "policy_service_delta_to_orders",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "policies": args.policies,
        "identities": args.identities,
        "nodes": args.nodes,
        "samples": len(samples),
        "delta_to_orders_ms": {
            "p50": round(p50, 3),
            "p90": round(percentile(samples, 0.90), 3),
            "p99": round(p99, 3),
            "mean": round(statistics.fmean(samples), 3),
            "max": round(max(samples), 3),
        },
        "world_publish_s": round(published, 3),
        "startup_to_serving_s": round(ready, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", type=int, default=1000)
    parser.add_argument("--identities", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    # The bus helper warns when its connection closes at the end; that is expected here.
    logging.getLogger("palisade").setLevel(logging.ERROR)
    if min(args.policies, args.identities, args.nodes, args.samples) < 1:
        parser.error("--policies, --identities, --nodes and --samples must be at least 1")
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
