"""Datapath order latency: a regeneration order's arrival -> ReportRealized delivered, for N endpoints.

Runs the datapath's own order consumer, endpoint manager and reporter over the
real BPF facade (pinned maps in a temporary bpffs directory, programs attached to
host-only veths; needs root and bcc) or, with ``--fake``, over the in-memory
fake. ``--endpoints`` endpoints share ``--identities`` identities, each identity
starting with ``--entries`` policy entries. Each order changes every identity
(``--churn`` entries removed and as many added), so every endpoint's map is
written; the time is taken from handing the order to the consumer to the
ReportRealized call for all endpoints returning. Prints one JSON object.

    sudo .venv/bin/python -m bench.bench_datapath_orders --endpoints 100 --orders 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from palisade.v1 import common_pb2, policy_pb2
from services.datapath import types as dt
from services.datapath import wire
from services.datapath.datapath import Datapath, DatapathAPI
from services.datapath.fake import FakeDatapath
from services.datapath.manager import EndpointManager
from services.datapath.netns import PodLink, PodPlug
from services.datapath.orders import OrderConsumer, Reporter
from services.datapath.state import EndpointStore
from testkit.builders import policy_entry

NODE = "bench-node"
INGRESS = common_pb2.DIRECTION_INGRESS


class Policy:
    """PolicyPort in process: answers Resync from a table, times ReportRealized."""

    def __init__(self, endpoints: int) -> None:
        self.policies: dict[int, list[common_pb2.PolicyEntry]] = {}
        self.endpoints = endpoints
        self.sent_at: dict[int, float] = {}
        self.latencies: list[float] = []
        self.done: dict[int, asyncio.Event] = {}
        self._realized: dict[int, set[int]] = {}

    async def resync(self, node: str, identities: Sequence[int] = ()) -> dt.ResyncState:
        out = policy_pb2.ResyncResponse(revision=1, sequence=0)
        for identity, entries in self.policies.items():
            if identities and identity not in identities:
                continue
            out.policies.append(
                common_pb2.IdentityPolicy(
                    identity=identity, enforcement=common_pb2.Enforcement(ingress=True), entries=entries
                )
            )
        return wire.resync_from_proto(out)

    async def report(self, reports: Sequence[policy_pb2.RealizedReport], node: str = "") -> None:
        now = time.perf_counter()
        for r in reports:
            seen = self._realized.setdefault(r.revision, set())
            seen.add(r.endpoint_id)
            if len(seen) == self.endpoints and r.revision in self.sent_at and r.revision in self.done:
                self.latencies.append(now - self.sent_at[r.revision])
                self.done[r.revision].set()


class Ipam:
    """IpamPort in process: sequential addresses, one identity per label set."""

    def __init__(self) -> None:
        self.next_ip = 2
        self.ids: dict[tuple[tuple[str, str, str], ...], int] = {}

    async def allocate_identity(self, labels: Sequence[dt.Label], node: str, owner: str) -> int:
        key = tuple(sorted((x.source, x.key, x.value) for x in labels))
        return self.ids.setdefault(key, 256 + len(self.ids))

    async def release_identity(self, identity: int, node: str, owner: str) -> None:
        return None

    async def resolve_pod(self, namespace: str, name: str) -> int:
        raise LookupError(name)

    async def allocate_ip(
        self,
        node: str,
        owner: str,
        family: int,
        ip: str = "",
        ports: Sequence[dt.PortRecord] = (),
        *,
        outside_pool: bool = False,
    ) -> dt.Address:
        n = self.next_ip
        self.next_ip += 1
        addr = ip or f"10.250.{n // 250}.{n % 250 + 1}"
        return dt.Address(ip=addr, cidr="10.250.0.0/16", gateway="10.250.0.1", family=4)

    async def release_ip(self, node: str, ip: str, owner: str) -> None:
        return None

    async def allocations(self, node: str) -> list[dt.IpAllocation]:
        return []


class DummyLinks:
    """PodNetwork with a host-only veth pair per endpoint (real ifindexes for tc), no namespaces."""

    def __init__(self, real: bool) -> None:
        self.real = real
        self.names: list[str] = []
        self.count = 0

    def plug(self, *, netns: str, create: bool, host_ifname: str, pod_ifname: str = "eth0") -> PodPlug:
        return PodPlug(self._link(netns, host_ifname), 2)

    def address(self, plug: PodPlug, addresses: Sequence[dt.Address]) -> PodLink:
        return plug.link

    def _link(self, netns: str, host_ifname: str) -> PodLink:
        self.count += 1
        if not self.real:
            return PodLink(netns, False, host_ifname, 1000 + self.count)
        from pyroute2 import IPRoute

        name = f"pbd{secrets.token_hex(4)}"
        with IPRoute() as ipr:
            ipr.link("add", ifname=name, kind="veth", peer={"ifname": name + "p"})
            index = int(ipr.link_lookup(ifname=name)[0])
            ipr.link("set", index=index, state="up")
        self.names.append(name)
        return PodLink(netns, False, name, index)

    def adopt(self, *, netns: str, host_ifname: str, ips: Sequence[str]) -> PodLink:
        raise NotImplementedError("the benchmark creates its own links")

    def teardown(self, link: PodLink) -> None:
        return None

    def alive(self, link: PodLink) -> bool:
        return True

    def exists(self, netns: str) -> bool:
        return True

    def remove_all(self) -> None:
        if not self.real:
            return
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for name in self.names:
                for index in ipr.link_lookup(ifname=name):
                    ipr.link("del", index=index)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="palisade-bench-"))
    bpffs = f"/sys/fs/bpf/palisade-bench-{secrets.token_hex(4)}"
    datapath: DatapathAPI = (
        FakeDatapath.open(str(tmp / "bpf")) if args.fake else await asyncio.to_thread(Datapath.open, bpffs)
    )
    links = DummyLinks(real=not args.fake)
    policy = Policy(args.endpoints)
    ipam = Ipam()
    reporter = Reporter(NODE, policy)
    manager = EndpointManager(
        node=NODE,
        datapath=datapath,
        network=links,
        store=EndpointStore(tmp / "state"),
        ipam=ipam,
        policy=policy,
        reporter=reporter,
    )
    consumer = OrderConsumer(NODE, policy, manager)
    tasks = [asyncio.create_task(t) for t in (manager.run(), reporter.run(), consumer.run())]
    try:
        # Every identity admits every other on `entries` ports.
        identities = [256 + i for i in range(args.identities)]
        for i, identity in enumerate(identities):
            policy.policies[identity] = [
                policy_entry(INGRESS, identities[(i + k) % len(identities)], 1000 + k) for k in range(args.entries)
            ]
        await asyncio.wait_for(consumer.synced.wait(), 60)
        for n in range(args.endpoints):
            app = f"app{n % args.identities}"
            await manager.create(
                dt.EndpointRequest(namespace="bench", pod=f"pod-{n}", labels=(dt.Label("k8s", "app", app),))
            )
        await reporter.flushed()

        port = 20000
        for sequence in range(1, args.orders + 1):
            revision = sequence + 1
            diffs = []
            for identity in sorted(set(ep.identity for ep in manager.endpoints.values())):
                current = policy.policies.setdefault(identity, [])
                removed, kept = current[: args.churn], current[args.churn :]
                added = [policy_entry(INGRESS, identity, port + k) for k in range(args.churn)]
                policy.policies[identity] = kept + added
                diffs.append(
                    common_pb2.IdentityPolicyDiff(
                        identity=identity,
                        enforcement=common_pb2.Enforcement(ingress=True),
                        add=added,
                        remove=removed,
                    )
                )
            port += args.churn
            order = policy_pb2.RegenerationOrder(node=NODE, sequence=sequence, revision=revision, diffs=diffs)
            policy.done[revision] = asyncio.Event()
            policy.sent_at[revision] = time.perf_counter()
            consumer.offer(order)
            await asyncio.wait_for(policy.done[revision].wait(), 60)
        # The kernel maps hold what was ordered.
        ep = next(iter(manager.endpoints.values()))
        _, entries = await asyncio.to_thread(datapath.dump_policy, ep.id)
        assert len(entries) == len(policy.policies[ep.identity]), "map does not hold the ordered entries"
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if isinstance(datapath, Datapath):
            await asyncio.to_thread(datapath.teardown)
        await asyncio.to_thread(links.remove_all)

    lat = sorted(x * 1000 for x in policy.latencies)
    p50 = statistics.median(lat)
    p95 = lat[min(len(lat) - 1, int(len(lat) * 0.95))]
    return {
        "datapath": "fake" if args.fake else "bpf",
        "endpoints": args.endpoints,
        "identities": args.identities,
        "entries_per_identity": args.entries,
        "churn_per_identity": args.churn,
        "orders": args.orders,
        "order_to_report_ms_p50": round(p50, 2),
        "order_to_report_ms_p95": round(p95, 2),
        "order_to_report_ms_max": round(lat[-1], 2),
        "summary": [
            {
                "metric": f"order -> ReportRealized, {args.endpoints} endpoints, p50",
                "value": round(p50, 2),
                "unit": "ms",
            },
            {
                "metric": f"order -> ReportRealized, {args.endpoints} endpoints, p95",
                "value": round(p95, 2),
                "unit": "ms",
            },
        ],
        "plots": [
            {
                "name": "datapath_order_latency",
                "title": f"Order arrival to ReportRealized ({args.endpoints} endpoints)",
                "xlabel": "ms",
                "ylabel": "orders",
                "kind": "hist",
                "series": {"order -> report": lat},
            }
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--identities", type=int, default=10)
    parser.add_argument("--entries", type=int, default=50)
    parser.add_argument("--churn", type=int, default=5)
    parser.add_argument("--orders", type=int, default=30)
    parser.add_argument("--fake", action="store_true", help="use the in-memory datapath (no root needed)")
    args = parser.parse_args()
    import os

    if not args.fake and os.geteuid() != 0:
        args.fake = True  # the real maps need root; say so in the output
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
