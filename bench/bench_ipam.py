"""Identity and IP allocation throughput of ipam's allocators against a local etcd.

    .venv/bin/python bench/bench_ipam.py [--identities 2000] [--ips 2000] [--concurrency 1,32]

Starts its own single-member etcd on free loopback ports (fresh data dir) and
prints one JSON object: per concurrency level, new identities per second (each a
create-if-absent transaction plus the reference), references on existing
identities per second, and IP allocations and releases per second on one node.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from services.common.labels import LabelSet
from services.common.store import connect_etcd
from services.ipam.config import IPAMMode
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Store
from services.ipam.leases import NodeLeases
from tests.harness import EtcdServer, creds


async def _timed(jobs: Sequence[Callable[[], Awaitable[object]]], concurrency: int) -> float:
    """Run the jobs with at most ``concurrency`` in flight; returns operations per second."""
    queue = list(reversed(jobs))

    async def worker() -> None:
        while queue:
            await queue.pop()()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return round(len(jobs) / (time.perf_counter() - start), 1)


async def bench_level(store: Store, level: int, identities: int, ips: int) -> dict[str, float]:
    tag = f"c{level}"
    allocator = IdentityAllocator(store, NodeLeases(store, 60))
    await allocator.load()
    labels = [
        LabelSet.of([f"k8s:app=bench-{tag}-{i}", "k8s:io.kubernetes.pod.namespace=bench"]) for i in range(identities)
    ]
    new = [
        functools.partial(allocator.allocate, labels[i], "node-a", f"pod/bench/{tag}-{i}") for i in range(identities)
    ]
    # The same label sets from a second node: finds the identity, takes one more reference.
    existing = [
        functools.partial(allocator.allocate, labels[i], "node-b", f"pod/bench/{tag}-{i}") for i in range(identities)
    ]
    ipalloc = IPAllocator(
        store, [ipaddress.ip_network("10.0.0.0/8")], mask_v4=16, mask_v6=112, mode=IPAMMode.CLUSTER_POOL
    )
    await ipalloc.load()
    node = f"ip-node-{tag}"
    await ipalloc.node_cidrs(node)
    allocate = [functools.partial(ipalloc.allocate, node, f"pod/bench/ip-{i}") for i in range(ips)]
    result = {
        "identity_new_per_s": await _timed(new, level),
        "identity_existing_ref_per_s": await _timed(existing, level),
        "ip_allocate_per_s": await _timed(allocate, level),
    }
    got = [a.ip for a in ipalloc.list(node)[0]]
    assert len(got) == ips == len(set(got)), "an address was handed out twice"
    result["ip_release_per_s"] = await _timed([functools.partial(ipalloc.release, node, ip) for ip in got], level)
    return result


async def bench(endpoint: str, identities: int, ips: int, levels: list[int]) -> dict[str, object]:
    host, port = endpoint.rsplit(":", 1)
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    store = Store(client)
    try:
        return {f"concurrency_{level}": await bench_level(store, level, identities, ips) for level in levels}
    finally:
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=2000, help="identities allocated per concurrency level")
    parser.add_argument("--ips", type=int, default=2000, help="addresses allocated per concurrency level")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated numbers of requests in flight")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="palisade-bench-") as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        etcd.start()
        try:
            results = asyncio.run(bench(etcd.endpoint, args.identities, args.ips, levels))
        finally:
            etcd.stop()
    out = {
        "benchmark": "ipam",
        "identities": args.identities,
        "ips": args.ips,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "results": results,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
