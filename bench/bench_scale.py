"""Control plane at cluster scale: 1,000 simulated nodes, 50,000 pods, 1,000 policies.

    .venv/bin/python -m bench.bench_scale [--quick] [--nodes N --pods N --namespaces N --policies N]

Runs the real nats-server (JetStream), etcd, and the watcher, ipam and policy processes
(mutual TLS, as deployed). The cluster comes in through the watcher's manifest source (a
folder of Namespace, Pod and NetworkPolicy manifests; pods carry ``spec.nodeName`` and
``status.podIP``, as the API server would give them); ipam gives them identities and
ipcache entries in etcd and on the bus; the policy service plans orders. Every node is a
:class:`bench.simnode.SimNode` in this process: its own NATS connection and JetStream
consumer of ``palisade.regen.<node>``, the datapath's own order consumer and reporter, its
own gRPC channel to PolicyService, an in-memory datapath. Its endpoints come from the
ipcache, as a kubelet would create them.

Measured:

* **policy change -> realized on every node**: a CiliumClusterwideNetworkPolicy selecting
  every pod is edited through ``PolicyService.ImportPolicies`` (a new port each time), timed
  until ``WaitForRevision`` says every endpoint of every node reported it (and, seen from
  the nodes, until the last node applied it); the bytes of orders published per change
  (the policy service's ``palisade_policy_order_bytes`` histogram);
* **node join**: a node whose pods are already scheduled starts (connects, subscribes,
  resyncs), timed until its endpoints reported its full state;
* **identity churn**: pods with label sets never seen before are created and deleted
  through the manifest folder at ``--churn-rate`` per second for ``--churn-seconds``,
  timed from the manifest write to their ipcache entry, then to the cluster converged;
* the policy service's RSS (and peak), and how long the initial load took.

No root needed; everything started is stopped, and the temporary directory removed, on
exit. ``--quick`` is a smoke run at 20 nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.output import logger, terminate_cleanly
from bench.simnode import SimNode
from bench.stats import cpu_seconds, peak_rss_mib, rss_mib, stats_ms, target
from palisade.v1 import common_pb2, common_pb2_grpc, identity_pb2, policy_pb2, policy_pb2_grpc
from services.common import etcdconfig, natsconfig
from services.common.bus import ALL_STREAMS, Bus
from services.common.gctuning import freeze_loaded, tune_gc
from services.common.grpcserver import open_channel
from services.common.subjects import IPCACHE_ALL
from services.common.trust import Credentials, ensure_pki
from services.datapath.orders import GrpcPolicyClient
from services.devstack.processes import Child, binary
from testkit.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_CIDR = "10.64.0.0/10"  # room for 1,000+ nodes' /24s; apart from the dev stack's and the tests'
APPS = 10  # label sets per namespace: identities = namespaces x APPS
TEAMS = 10
CHANGE_POLICY = "scale-change"
# Slots of a node's /24: base pods from 1, churn pods from CHURN_SLOT (cycling through CHURN_SLOTS).
CHURN_SLOT, CHURN_SLOTS = 150, 100


log = logger("scale")


# -- the world -------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    nodes: int
    pods: int
    namespaces: int
    policies: int

    def node(self, i: int) -> str:
        return f"sim-{i:04d}"

    def ip(self, node: int, slot: int) -> str:
        return str(ipaddress.ip_network(CLUSTER_CIDR).network_address + node * 256 + slot)

    def pod(self, p: int) -> dict[str, Any]:
        """Pod ``p``: namespace p % namespaces, app (p // namespaces) % APPS, on node p % nodes."""
        node, slot = p % self.nodes, 1 + p // self.nodes
        ns = p % self.namespaces
        return pod_object(f"ns-{ns}", f"pod-{p}", {"app": f"a{(p // self.namespaces) % APPS}"}, self.node(node),
                          self.ip(node, slot))  # fmt: skip

    def namespace(self, k: int) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": f"ns-{k}", "labels": {"team": f"t{k % TEAMS}"}}}  # fmt: skip

    def policy(self, j: int) -> dict[str, Any]:
        """Policy ``j``: in namespace j % namespaces; selects one app, lets another app (or a team) in."""
        k, round_ = j % self.namespaces, j // self.namespaces
        app = round_ % APPS
        peer: dict[str, Any] = (
            {"podSelector": {"matchLabels": {"app": f"a{(app + 1) % APPS}"}}}
            if round_ % 2 == 0
            else {"namespaceSelector": {"matchLabels": {"team": f"t{(k + 1) % TEAMS}"}}}
        )
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"pol-{j}", "namespace": f"ns-{k}"},
            "spec": {
                "podSelector": {"matchLabels": {"app": f"a{app}"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [peer], "ports": [{"port": 8000 + j % 1000, "protocol": "TCP"}]}],
            },
        }


def pod_object(ns: str, name: str, labels: dict[str, str], node: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


def change_policy(n: int) -> dict[str, Any]:
    """Change ``n``: every pod of the cluster opens a new port."""
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": CHANGE_POLICY},
        "spec": {
            "endpointSelector": {},
            "ingress": [{"toPorts": [{"ports": [{"port": str(20000 + n), "protocol": "TCP"}]}]}],
        },
    }


def write_docs(path: Path, docs: list[dict[str, Any]]) -> None:
    """Write atomically: the watcher never reads half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    # libyaml's emitter when there is one: a quarter of the pure-Python one's CPU (this process
    # also runs the simulated nodes).
    tmp.write_text(yaml.dump_all(docs, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False))
    tmp.rename(path)


def write_world(world: World, folder: Path) -> None:
    write_docs(folder / "namespaces.yaml", [world.namespace(k) for k in range(world.namespaces)])
    write_docs(folder / "policies.yaml", [world.policy(j) for j in range(world.policies)])
    per_file = 1000
    for start in range(0, world.pods, per_file):
        write_docs(folder / f"pods-{start // per_file:03d}.yaml",
                   [world.pod(p) for p in range(start, min(world.pods, start + per_file))])  # fmt: skip


# -- the processes -------------------------------------------------------------------------------


@dataclass
class Stack:
    tmp: Path
    tls: Path
    manifests: Path
    children: dict[str, Child] = field(default_factory=dict)
    policy_metrics: int = 0

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.children['nats'].tcp_port}"

    def address(self, name: str) -> str:
        return self.children[name].grpc_address

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            with contextlib.suppress(Exception):
                child.stop()


def start_stack(tmp: Path, world: World, log_level: str) -> Stack:
    tls = ensure_pki(tmp / "tls")
    stack = Stack(tmp, tls, tmp / "manifests")
    stack.manifests.mkdir()
    logs = tmp / "logs"
    logs.mkdir()
    nats_port, etcd_port, etcd_peer = free_port(), free_port(), free_port()
    conf = natsconfig.write(
        tmp / "nats.conf", listen=f"127.0.0.1:{nats_port}", store_dir=str(tmp / "nats"),
        tls=Credentials.load(tls, "nats"),
    )  # fmt: skip
    stack.children["nats"] = Child("nats", [binary("nats-server"), "-c", str(conf)], logs / "nats.log",
                                   tcp_port=nats_port)  # fmt: skip
    etcd = f"127.0.0.1:{etcd_port}"
    stack.children["etcd"] = Child(
        "etcd",
        [binary("etcd"), "--name", "scale", "--data-dir", str(tmp / "etcd"), "--log-level", "warn",
         "--quota-backend-bytes", str(4 << 30),
         *etcdconfig.flags(Credentials.load(tls, "etcd"), "scale", etcd, f"127.0.0.1:{etcd_peer}")],
        logs / "etcd.log",
        tcp_port=etcd_port,
    )  # fmt: skip
    for name in ("nats", "etcd"):
        stack.children[name].start(ROOT)
        stack.children[name].wait_ready(30)
    time.sleep(0.5)  # etcd accepts before it has elected itself; ipam retries anyway
    probe = Credentials.load(tls, "cli")
    common = ["--nats-url", stack.nats_url, "--etcd-endpoints", etcd, "--log-level", log_level, "--log-format", "json"]
    plan = [
        ("watcher", ["--source", "manifests", "--manifests", str(stack.manifests)]),
        ("ipam", ["--cluster-cidrs", CLUSTER_CIDR]),
        ("policy", []),  # given this stack's ipam below, once it listens
    ]
    # The cluster is in the folder before the watcher starts: its initial list is the whole world.
    write_world(world, stack.manifests)
    for name, extra in plan:
        address = f"127.0.0.1:{free_port()}"
        metrics = free_port()
        if name == "policy":
            stack.policy_metrics = metrics
        if name == "policy":
            # Its own stack's ipam (for the CIDR identities of policies), never a default port
            # some other stack on the machine may hold.
            extra = [*extra, "--ipam-address", stack.address("ipam")]
        cmd = [sys.executable, "-m", f"services.{name}", "--grpc-listen", address,
               "--metrics-listen", f"127.0.0.1:{metrics}", *common, *extra]  # fmt: skip
        child = Child(name, cmd, logs / f"{name}.log", grpc_address=address,
                      env={"PALISADE_TLS_DIR": str(tls)}, credentials=probe)  # fmt: skip
        stack.children[name] = child
        child.start(ROOT)
        started = time.perf_counter()
        child.wait_ready(1800)
        log(f"{name} SERVING after {time.perf_counter() - started:.1f}s")
    return stack


def metric_sum(port: int, name: str) -> float:
    """The sum of a Prometheus series family ``name`` (every label set) from a metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the simulated cluster -------------------------------------------------------------------------


class Cluster:
    """The simulated nodes, and the ipcache (followed once here) telling each its endpoints."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.nodes: dict[str, SimNode] = {}
        self.pods: dict[str, tuple[str, int]] = {}  # "ns/name" -> (node, identity)
        self.seen: dict[str, float] = {}  # pod -> when its ipcache entry arrived
        self._stack = contextlib.AsyncExitStack()
        self._channels: list[grpc.aio.Channel] = []
        self._buses: list[Bus] = []
        self.watch_bus: Bus | None = None

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A thousand connections, closed together and within a bound (the servers stop after anyway).
        try:
            async with asyncio.timeout(120):
                await self._stack.aclose()
                buses = [*self._buses, *([self.watch_bus] if self.watch_bus else [])]
                await asyncio.gather(*(bus.close() for bus in buses), return_exceptions=True)
                await asyncio.gather(*(channel.close() for channel in self._channels), return_exceptions=True)
        except TimeoutError:
            log("the simulated nodes did not stop within 120s; their servers are stopped next")

    async def follow_ipcache(self) -> None:
        creds = Credentials.load(self.stack.tls, "policy")  # a reader of the ipcache
        self.watch_bus = await Bus.connect([self.stack.nats_url], name="scale-ipcache", tls=creds)
        await self.watch_bus.ensure_streams(*ALL_STREAMS)

        async def on_entry(subject: str, entry: identity_pb2.IpcacheEntry) -> None:
            if not entry.pod:
                return
            pod = f"{entry.namespace}/{entry.pod}"
            if entry.deleted:
                old = self.pods.pop(pod, None)
                if old is not None and old[0] in self.nodes:
                    self.nodes[old[0]].remove_endpoint(pod)
                return
            self.pods[pod] = (entry.node, entry.identity)
            self.seen.setdefault(pod, time.monotonic())
            if entry.node in self.nodes:
                self.nodes[entry.node].add_endpoint(pod, entry.identity)

        await self.watch_bus.follow(IPCACHE_ALL, identity_pb2.IpcacheEntry, on_entry)

    async def add_node(self, name: str) -> SimNode:
        """A node as its datapath starts: its own bus connection and channel, its pods, then its orders."""
        creds = Credentials.load(self.stack.tls, "datapath")
        bus = await Bus.connect([self.stack.nats_url], name=f"datapath-{name}", tls=creds)
        self._buses.append(bus)
        channel = open_channel(self.stack.address("policy"), "policy", creds)
        self._channels.append(channel)
        node = SimNode(name, bus, GrpcPolicyClient(channel, timeout=60))
        for pod, (where, identity) in self.pods.items():
            if where == name:
                node.add_endpoint(pod, identity)
        self.nodes[name] = node
        await self._stack.enter_async_context(node)
        return node

    def behind(self, revision: int) -> list[str]:
        return [n.name for n in self.nodes.values() if n.revision < revision and n.endpoints]


async def wait_for(check: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


async def wait_realized(api: Api, revision: int, timeout: float) -> None:
    answer = await api.policy.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=revision, timeout_seconds=timeout), timeout=timeout + 30
    )
    if not answer.realized:
        behind = ", ".join(f"{b.node}/{b.pod or b.endpoint_id}@{b.realized_revision}" for b in answer.behind[:5])
        raise RuntimeError(
            f"revision {revision} not realized after {timeout:.0f}s ({len(answer.behind)} behind: {behind})"
        )


async def current_revision(api: Api) -> int:
    """The policy service's revision (its status, through the same channel)."""
    status = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=60)
    return int(status.revision)


async def import_change(api: Api, n: int) -> int:
    answer = await api.policy.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(change_policy(n)), origin="bench-scale"),
        timeout=120,
    )
    bad = [p.error for p in answer.policies if p.state == policy_pb2.POLICY_STATE_REJECTED]
    if bad:
        raise RuntimeError(f"change {n} rejected: {bad[0]}")
    return int(answer.revision)


@dataclass(frozen=True)
class Api:
    """The policy service as an operator reaches it."""

    policy: policy_pb2_grpc.PolicyServiceStub
    status: common_pb2_grpc.StatusServiceStub


@contextlib.asynccontextmanager
async def policy_api(stack: Stack) -> AsyncIterator[Api]:
    channel = open_channel(stack.address("policy"), "policy", Credentials.load(stack.tls, "cli"))
    try:
        yield Api(policy_pb2_grpc.PolicyServiceStub(channel), common_pb2_grpc.StatusServiceStub(channel))
    finally:
        await channel.close()


async def scenario(stack: Stack, world: World, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    policy_pid = stack.children["policy"].proc.pid  # type: ignore[union-attr]
    async with Cluster(stack) as cluster, policy_api(stack) as api:
        started = time.perf_counter()
        await cluster.follow_ipcache()
        await wait_for(lambda: len(cluster.pods) >= world.pods, f"{world.pods} pods in the ipcache", args.patience)
        out["ipcache_complete_s"] = round(time.perf_counter() - started, 1)
        log(f"ipcache holds {len(cluster.pods)} pods; starting {world.nodes} nodes")
        started = time.perf_counter()
        for i in range(world.nodes):
            await cluster.add_node(world.node(i))
        revision = await current_revision(api)
        await wait_realized(api, revision, args.patience)
        out["nodes_started_and_realized_s"] = round(time.perf_counter() - started, 1)
        # A real node's process holds its own node's state; this one holds a thousand nodes'
        # (and the whole ipcache), which the collector would rescan at every change: the
        # simulation's heap, not the product's cost. Settled as the services settle theirs.
        tune_gc()
        freeze_loaded()
        out["identities"] = len({ident for _, ident in cluster.pods.values()})
        out["rss_policy_loaded_mib"] = rss_mib(policy_pid)
        log(f"{world.nodes} nodes realized revision {revision}; {out['identities']} identities")

        # -- policy changes realized on every node
        delays, node_delays, sent = [], [], []
        # Where a change's time goes: CPU seconds of each process from the import to realized
        # everywhere. "simulation" is this process (the simulated nodes' consumers and reporters).
        pids = {name: child.proc.pid for name, child in stack.children.items() if child.proc is not None}
        pids["simulation"] = os.getpid()
        cpu: dict[str, list[float]] = {name: [] for name in pids}
        for n in range(args.changes + 1):
            bytes_before = metric_sum(stack.policy_metrics, "palisade_policy_order_bytes_sum")
            cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            t0 = time.monotonic()
            revision = await import_change(api, n)
            await wait_realized(api, revision, args.patience)
            done = time.monotonic()
            cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
            last_node = max(node.applied_at.get(revision, done) for node in cluster.nodes.values() if node.endpoints)
            await asyncio.sleep(0.2)  # the publisher's counters are updated after the last publish
            sent_bytes = metric_sum(stack.policy_metrics, "palisade_policy_order_bytes_sum") - bytes_before
            if n == 0:
                continue  # the first makes every pod ingress-enforced: a different change
            delays.append((done - t0) * 1000)
            node_delays.append((last_node - t0) * 1000)
            sent.append(sent_bytes)
            for name in pids:
                cpu[name].append(cpu_after[name] - cpu_before[name])
        out["change_realized_ms"] = stats_ms(delays)
        out["change_applied_on_last_node_ms"] = stats_ms(node_delays)
        out["change_order_bytes"] = round(sum(sent) / len(sent))
        out["change_cpu_s"] = {name: round(sum(v) / len(v), 3) for name, v in cpu.items()}
        log(f"CPU seconds per change, by process: {out['change_cpu_s']}")
        log(f"policy change realized everywhere p50 {out['change_realized_ms']['p50']} ms")

        # -- node join: pods scheduled first, then the node's datapath starts
        joins = []
        for j in range(args.joins):
            index = world.nodes + j
            name = world.node(index)
            pods = [pod_object(f"ns-{(j * 7 + s) % world.namespaces}", f"join-{j}-{s}",
                               {"app": f"a{s % APPS}"}, name, world.ip(index, 1 + s))
                    for s in range(args.pods_per_join)]  # fmt: skip
            write_docs(stack.manifests / f"join-{j}.yaml", pods)
            keys = {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods}
            await wait_for(lambda k=keys: k <= cluster.pods.keys(), f"node {name}'s pods in the ipcache", args.patience)
            revision = await current_revision(api)
            t0 = time.monotonic()
            node = await cluster.add_node(name)
            await node.consumer.synced.wait()
            await wait_realized(api, revision, args.patience)
            await node.reporter.flushed()
            joins.append((time.monotonic() - t0) * 1000)
            if len(node.endpoints) != len(pods) or not node.state.policies:
                raise RuntimeError(f"joined node {name} holds {len(node.endpoints)} endpoints, no policy")
        out["node_join_ms"] = stats_ms(joins)
        log(f"node join p50 {out['node_join_ms']['p50']} ms")

        # -- identity churn through the manifest folder
        log(f"churn: {args.churn_rate} new pods/s for {args.churn_seconds}s")
        out["churn"] = await churn(stack, world, cluster, api, args, pids)
        log(f"churn: {out['churn']}")
        out["rss_policy_end_mib"] = rss_mib(policy_pid)
        out["rss_policy_peak_mib"] = peak_rss_mib(policy_pid)
        out["rss_bench_process_mib"] = rss_mib(os.getpid())
        log("stopping the simulated nodes")
    return out


async def churn(
    stack: Stack, world: World, cluster: Cluster, api: Api, args: argparse.Namespace, pids: dict[str, int]
) -> dict[str, Any]:
    """Every second a file of new pods (new label sets) appears, ``rate`` a second; files older than
    ``--churn-life`` go.

    The pods due are counted from the clock, not from the ticks: a tick that comes late (this
    process also runs the thousand simulated nodes) writes the pods of the seconds it missed,
    so the rate offered is ``rate`` however busy the loop is.
    """
    written: dict[str, float] = {}
    files: list[tuple[Path, int]] = []
    created = 0
    total = args.churn_rate * args.churn_seconds
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    tick = 0
    while created < total:
        second = int(time.monotonic() - started)
        due = min(total, args.churn_rate * (second + 1))
        pods = []
        for c in range(created, due):
            node = c % world.nodes
            slot = CHURN_SLOT + (c // world.nodes) % CHURN_SLOTS
            pods.append(pod_object(f"ns-{c % world.namespaces}", f"churn-{c}",
                                   {"app": f"a{c % APPS}", "churn": f"c{c}"}, world.node(node),
                                   world.ip(node, slot)))  # fmt: skip
        created = max(created, due)
        if pods:
            path = stack.manifests / f"churn-{tick:04d}.yaml"
            tick += 1
            write_docs(path, pods)
            now = time.monotonic()
            for p in pods:
                written[f"{p['metadata']['namespace']}/{p['metadata']['name']}"] = now
            files.append((path, second))
        while files and files[0][1] <= second - args.churn_life:
            files.pop(0)[0].unlink()
        await asyncio.sleep(max(0.0, started + second + 1 - time.monotonic()))
    wrote_s = time.monotonic() - started
    # Where the machine's cores went while the churn was written (of os.cpu_count() per second).
    cpu_share = {name: round((cpu_seconds(pid) - cpu_before[name]) / wrote_s, 2) for name, pid in pids.items()}
    # The last files live out their --churn-life too: removed at once, a file the watcher has not read
    # yet would take its pods with it unseen (a folder is not a watch: it keeps no history).
    while files:
        second = int(time.monotonic() - started)
        while files and files[0][1] <= second - args.churn_life:
            files.pop(0)[0].unlink()
        await asyncio.sleep(max(0.0, started + second + 1 - time.monotonic()))
    last_write = time.monotonic()
    # Converged: ipam has handled every churn delta (a pod written last reaches the ipcache: the
    # stream is in order), no churn pod is left in the ipcache (all were deleted), and the
    # cluster's revision is realized everywhere. A pod deleted before ipam got to it never reaches
    # the ipcache (the stream keeps only its tombstone): that is ipam lagging, counted as such.
    # A churn the control plane cannot keep up with is a figure too: how far it got in --churn-patience.
    marker = pod_object("ns-0", "churn-end", {"app": "churn-end"}, world.node(0), world.ip(0, CHURN_SLOT - 1))
    write_docs(stack.manifests / "churn-end.yaml", [marker])
    deadline = time.monotonic() + args.churn_patience

    def settled() -> bool:
        return "ns-0/churn-end" in cluster.pods and not any(p in cluster.pods for p in written)

    with contextlib.suppress(RuntimeError):
        await wait_for(settled, "the churn to settle", args.churn_patience)
    converged = settled()
    if converged:
        try:
            await wait_realized(api, await current_revision(api), max(1.0, deadline - time.monotonic()))
        except RuntimeError as exc:
            log(f"churn: not realized within --churn-patience: {exc}")
            converged = False
    converged_s = time.monotonic() - last_write
    lags = [(cluster.seen[p] - t) * 1000 for p, t in written.items() if p in cluster.seen]
    return {
        "pods_created": created,
        "pods_in_ipcache": len(lags),
        "rate_per_s": round(created / wrote_s, 1),
        "seconds": args.churn_seconds,
        "manifest_to_ipcache_ms": stats_ms(lags),
        "converged": converged,
        "converged_after_s": round(converged_s, 1),
        "cpu_s_per_s_by_process": cpu_share,
    }


def summary(out: dict[str, Any]) -> list[dict[str, Any]]:
    w = out["world"]
    scale = f"{w['nodes']} nodes, {w['pods']} pods, {w['policies']} policies"
    churn = out["churn"]
    return [
        {"metric": f"policy change realized on every node p50 ({scale})", "value": out["change_realized_ms"]["p50"],
         "unit": "ms"},
        {"metric": f"policy change realized on every node p99 ({scale})", "value": out["change_realized_ms"]["p99"],
         "unit": "ms", "target": target("<=", 2000.0)},
        {"metric": "policy change applied by the last node p99", "value": out["change_applied_on_last_node_ms"]["p99"],
         "unit": "ms"},
        {"metric": "order bytes published per cluster-wide change", "value": out["change_order_bytes"], "unit": "B"},
        *({"metric": f"CPU per cluster-wide change: {name}", "value": seconds, "unit": "s"}
          for name, seconds in out["change_cpu_s"].items()),
        {"metric": f"node join (its full state) p99 ({scale})", "value": out["node_join_ms"]["p99"], "unit": "ms",
         "target": target("<=", 5000.0)},
        {"metric": f"identity churn: manifest -> ipcache p50 at {churn['rate_per_s']} pods/s",
         "value": churn["manifest_to_ipcache_ms"]["p50"], "unit": "ms"},
        {"metric": f"identity churn: manifest -> ipcache p99 at {churn['rate_per_s']} pods/s",
         "value": churn["manifest_to_ipcache_ms"]["p99"], "unit": "ms"},
        {"metric": "identity churn: converged after the last write" if churn["converged"] else
                   f"identity churn: NOT converged after the last write ({churn['pods_in_ipcache']} of "
                   f"{churn['pods_created']} pods in the ipcache)", "value": churn["converged_after_s"], "unit": "s"},
        {"metric": f"policy service RSS peak ({scale})", "value": out["rss_policy_peak_mib"], "unit": "MiB",
         "target": target("<=", 1024.0)},
        {"metric": "initial load: manifests -> ipcache complete", "value": out["ipcache_complete_s"], "unit": "s"},
        {"metric": "initial load: nodes started -> realized", "value": out["nodes_started_and_realized_s"],
         "unit": "s"},
    ]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 20 nodes, 400 pods, 40 policies, 5 s of churn")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pods", type=int, default=50000)
    p.add_argument("--namespaces", type=int, default=500)
    p.add_argument("--policies", type=int, default=1000)
    p.add_argument("--changes", type=int, default=20, help="cluster-wide policy changes timed")
    p.add_argument("--joins", type=int, default=5, help="nodes joining, one after the other")
    p.add_argument("--pods-per-join", type=int, default=50)
    p.add_argument("--churn-rate", type=int, default=100, help="new pods (new identities) per second")
    p.add_argument("--churn-seconds", type=int, default=60)
    p.add_argument("--churn-life", type=int, default=10, help="seconds a churn pod lives")
    p.add_argument("--churn-patience", type=float, default=300.0, help="seconds the churn may take to settle")
    p.add_argument("--patience", type=float, default=600.0, help="seconds any one wait may take before failing")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs) after the run")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.pods, args.namespaces, args.policies = 20, 400, 10, 40
        args.changes, args.joins, args.pods_per_join = 5, 2, 10
        args.churn_rate, args.churn_seconds, args.churn_life = 20, 5, 2
        args.patience, args.churn_patience = 120.0, 60.0
    if args.pods // max(1, args.nodes) >= CHURN_SLOT - 1 or args.pods_per_join >= CHURN_SLOT - 1:
        p.error(f"at most {CHURN_SLOT - 2} pods per node (one /24 each, churn pods above)")
    world = World(args.nodes, args.pods, args.namespaces, args.policies)
    tmp = Path(tempfile.mkdtemp(prefix="palisade-bench-scale-"))
    random.seed(0)
    wall = time.perf_counter()
    stack: Stack | None = None
    interrupted = ""
    try:
        with terminate_cleanly():
            log(f"starting nats, etcd, watcher, ipam, policy with {world} in {tmp}")
            started = time.perf_counter()
            stack = start_stack(tmp, world, args.log_level)
            stack_s = round(time.perf_counter() - started, 1)
            out: dict[str, Any] = {"benchmark": "scale", "quick": args.quick, "world": world.__dict__}
            out["stack_serving_s"] = stack_s
            out.update(asyncio.run(scenario(stack, world, args)))
    except KeyboardInterrupt as exc:
        interrupted = str(exc)
    finally:
        if stack is not None:
            stack.stop()
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if interrupted:
        print(f"bench_scale: interrupted ({interrupted}); cleaned up", file=sys.stderr)
        return 130
    out["machine"] = {"cpus": os.cpu_count(), "note": "2 cores shared with other engineers' test runs"}
    out["total_s"] = round(time.perf_counter() - wall, 1)
    out["summary"] = summary(out)
    out["plots"] = []
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
