"""A separate allocator process for race tests: ``python -m tests.ipam.worker identities|ips ...``.

Each worker runs its own allocators against the shared etcd and prints one JSON
line with what it got. With ``--hold`` it prints, then keeps its node lease alive
until killed (to test what a dead process leaves behind).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.labels import LabelSet
from services.common.store import connect_etcd
from services.ipam.config import IPAMMode
from services.ipam.errors import IpamError
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Store
from services.ipam.leases import NodeLeases
from services.ipam.model import IdRange
from services.ipam.replica import ReplicaLease
from testkit.harness import creds

T = TypeVar("T")


def shared_labels(i: int) -> LabelSet:
    return LabelSet.of([f"k8s:app=shared-{i}", "k8s:io.kubernetes.pod.namespace=race"])


def own_labels(worker: str, i: int) -> LabelSet:
    return LabelSet.of([f"k8s:app={worker}-{i}", "k8s:io.kubernetes.pod.namespace=race"])


async def _gather_limited(jobs: list[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    sem = asyncio.Semaphore(limit)

    async def run(job: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await job()

    return await asyncio.gather(*(run(j) for j in jobs))


async def identities(args: argparse.Namespace, store: Store, leases: NodeLeases) -> dict[str, object]:
    rng = random.Random(args.seed)
    cluster = IdRange(256, 256 + args.range_size - 1) if args.range_size else None
    # Each worker records its creations as a replica does, so the races run the service's transactions.
    replica = ReplicaLease(store, 60, name=args.name)
    if cluster is not None:
        allocator = IdentityAllocator(store, leases, rng=rng, cluster_range=cluster, replica=replica)
    else:
        allocator = IdentityAllocator(store, leases, rng=rng, replica=replica)
    await allocator.load()
    wanted = [("shared", i, shared_labels(i)) for i in range(args.shared)]
    wanted += [("own", i, own_labels(args.name, i)) for i in range(args.own)]
    rng.shuffle(wanted)

    def job(kind: str, i: int, labels: LabelSet) -> Callable[[], Awaitable[tuple[str, int]]]:
        async def go() -> tuple[str, int]:
            result = await allocator.allocate(labels, args.node, f"{args.name}/{kind}-{i}")
            return str(labels), result.identity.id

        return go

    got = await _gather_limited([job(*w) for w in wanted], args.concurrency)
    return {"identities": dict(got)}


async def ips(args: argparse.Namespace, store: Store) -> dict[str, object]:
    clusters = [ipaddress.ip_network(c) for c in args.cidrs.split(",")]
    ipalloc = IPAllocator(
        store, clusters, mask_v4=args.mask, mask_v6=120, mode=IPAMMode.CLUSTER_POOL, rng=random.Random(args.seed)
    )
    await ipalloc.load()
    nodes = [f"carve-{k}" for k in range(args.nodes)]
    random.Random(args.seed).shuffle(nodes)

    def node_job(node: str) -> Callable[[], Awaitable[tuple[str, list[str]]]]:
        async def go() -> tuple[str, list[str]]:
            record = await ipalloc.node_cidrs(node)
            return node, [str(c.cidr) for c in record.cidrs]

        return go

    def ip_job(i: int) -> Callable[[], Awaitable[tuple[str, str]]]:
        async def go() -> tuple[str, str]:
            owner = f"{args.name}/ep-{i}"
            return owner, (await ipalloc.allocate(args.node, owner)).ip

        return go

    cidrs = await _gather_limited([node_job(n) for n in nodes], args.concurrency)
    got = await _gather_limited([ip_job(i) for i in range(args.count)], args.concurrency)
    return {"node_cidrs": dict(cidrs), "ips": dict(got)}


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["identities", "ips"])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--node", default="race-node")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--shared", type=int, default=0)
    parser.add_argument("--own", type=int, default=0)
    parser.add_argument("--range-size", type=int, default=0)
    parser.add_argument("--ttl", type=int, default=30)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--cidrs", default="10.96.0.0/16")
    parser.add_argument("--mask", type=int, default=24)
    args = parser.parse_args(argv)
    host, port = args.etcd.rsplit(":", 1)
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    store = Store(client)
    leases = NodeLeases(store, args.ttl)
    try:
        result = await (identities(args, store, leases) if args.mode == "identities" else ips(args, store))
    except IpamError as exc:
        print(json.dumps({"error": exc.code.value, "message": exc.message}), flush=True)
        return 1
    batches, transactions = store.batching
    print(json.dumps({**result, "batches": batches, "transactions": transactions}), flush=True)
    while args.hold:  # keep the node lease alive until killed
        await leases.refresh_all()
        await asyncio.sleep(args.ttl / 4)
    await client.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
