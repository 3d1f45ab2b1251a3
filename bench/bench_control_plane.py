"""Control plane at scale: policy implementation delay, engine times, allocation rates, memory.

    sudo .venv/bin/python bench/bench_control_plane.py [--quick]

Four parts, one JSON object on stdout:

1. **Implementation delay** on the real services: nats-server, etcd and the
   watcher, ipam, policy and datapath processes (the datapath with real BPF, pinned
   under a bpffs directory of its own, and a temporary state dir). ``--endpoints``
   endpoints are created on one node through ``DatapathService.CreateEndpoint`` with
   labels (16 distinct label sets), ``--policies`` policies are loaded through
   ``PolicyService.ImportPolicies`` in batches, then ``--changes`` policy changes are
   made, each changing what the endpoints of two identities allow; each is timed from
   the ImportPolicies call to ``WaitForRevision`` answering realized (every affected
   endpoint wrote the new revision into its BPF map and reported it).
2. **Allocation rates** through the running ipam's gRPC API (IdentityService.
   AllocateIdentity of new label sets, IPAMService.AllocateIP and ReleaseIP) at
   concurrency 1 and 16.
3. **Memory** (VmRSS from /proc/<pid>/status) of every service process once the
   endpoints and policies are loaded, and of a fresh policy service loaded with
   ``--big-policies`` policies and ``--big-identities`` identities published on NATS
   (the world of bench_policy_service.py, spread over 10 nodes).
4. **Engine** (pure, in a child process): full resolve and incremental changes at
   ``--engine-policies`` policies and ``--engine-identities`` identities, with the
   generator of bench_engine.py.

Needs root and bcc for part 1 (run as root); everything it creates (processes,
namespaces, pins, temporary directories) is removed on exit, also on failure.
``--quick`` is a smoke run of about a minute at small sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.output import logger, run_timed
from bench.stats import cpu_seconds, rss_mib, stats_ms, target
from palisade.v1 import (
    common_pb2,
    datapath_pb2,
    datapath_pb2_grpc,
    identity_pb2,
    identity_pb2_grpc,
    ipam_pb2,
    ipam_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, creds, datapath_flags, sync_channel
from testkit.harness import channel as harness_channel

ROOT = Path(__file__).resolve().parent.parent

NODE = "bench-node"
CLUSTER_CIDR = "10.213.0.0/16"  # apart from the dev stack's and the tests' pod addresses
NAMESPACES = 10  # policies spread over this many namespaces; endpoints live in the first two
APPS = 4
TIERS = 2


log = logger("control_plane")


class Cleanup:
    """Undo steps run in reverse order; each one runs even if an earlier one failed."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], object]]] = []

    def push(self, what: str, step: Callable[[], object]) -> None:
        self._steps.append((what, step))

    def run(self) -> None:
        # A second SIGTERM must not cut the cleanup short (SIGKILL still does).
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            while self._steps:
                what, step = self._steps.pop()
                try:
                    step()
                except BaseException as exc:  # a Ctrl-C in one step still runs the others
                    log(f"cleanup: {what} failed: {exc!r}")
        finally:
            signal.signal(signal.SIGTERM, previous)


def stop_service(proc: ServiceProcess) -> None:
    if proc.proc is None or proc.proc.poll() is not None:
        return
    try:
        proc.terminate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def remove_netns(prefix: str) -> int:
    """Delete network namespaces the datapath made for pods of namespaces starting with ``prefix``."""
    removed = 0
    folder = Path("/run/netns")
    if not folder.is_dir():
        return 0
    for entry in folder.iterdir():
        if entry.name.startswith(f"pal_{prefix}"):
            subprocess.run(["ip", "netns", "del", entry.name], capture_output=True, check=False)
            removed += 1
    return removed


def teardown_bpffs(path: str) -> None:
    from services.datapath.datapath import teardown_all

    teardown_all(path)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


# -- the world -------------------------------------------------------------------


def endpoint_labels(i: int) -> tuple[str, dict[str, str]]:
    """Namespace and labels of endpoint ``i``: 2 namespaces x 4 apps x 2 tiers = 16 label sets."""
    return f"{i % 2}", {"app": f"a{(i // 2) % APPS}", "tier": f"t{(i // (2 * APPS)) % TIERS}"}


def base_policy(j: int, prefix: str) -> dict[str, Any]:
    """Policy ``j`` of the existing ones: in namespace j % 10, alternately a NetworkPolicy and a CNP."""
    ns = f"{prefix}-{j % NAMESPACES}"
    round_ = j // NAMESPACES
    app = round_ % APPS
    if round_ % 2 == 0:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"base-{j}", "namespace": ns},
            "spec": {
                "podSelector": {"matchLabels": {"app": f"a{app}"}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"app": f"a{(app + 1) % APPS}"}}}],
                        "ports": [{"port": 1000 + j % 5000, "protocol": "TCP"}],
                    }
                ],
            },
        }
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": f"base-{j}", "namespace": ns},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": f"a{app}", "tier": f"t{(round_ // APPS) % TIERS}"}},
            "ingress": [
                {
                    "fromEndpoints": [{"matchLabels": {"tier": f"t{(round_ // APPS + 1) % TIERS}"}}],
                    "toPorts": [{"ports": [{"port": str(7000 + j % 1000), "protocol": "TCP"}]}],
                }
            ],
            "egress": [{"toEndpoints": [{"matchLabels": {"app": f"a{app}"}}]}],
        },
    }


def change_policy(n: int, prefix: str) -> dict[str, Any]:
    """Change ``n``: one of five policies, each time selecting one app of one namespace with a new port."""
    app = n % APPS
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"change-{n % 5}", "namespace": f"{prefix}-{n % 2}"},
        "spec": {
            "podSelector": {"matchLabels": {"app": f"a{app}"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"app": f"a{(app + 2) % APPS}"}}}],
                    "ports": [{"port": 20000 + n, "protocol": "TCP"}],
                }
            ],
        },
    }


def last_selects(n: int) -> tuple[str, dict[str, str]]:
    """A label set change ``n`` selects (tier t0 of the app it selects)."""
    return f"{n % 2}", {"app": f"a{n % APPS}", "tier": "t0"}


# -- part 1 and 2: the real services -------------------------------------------------


@dataclass
class Stack:
    tmp: Path
    prefix: str
    bpffs: str
    nats: NatsServer
    etcd: EtcdServer
    services: dict[str, ServiceProcess] = field(default_factory=dict)


def start_stack(
    tmp: Path, prefix: str, bpffs: str, cleanup: Cleanup, *, log_level_info: bool = False, attach: str = ""
) -> Stack:
    nats = NatsServer(tmp / "nats")
    nats.start()
    cleanup.push("stop nats", nats.stop)
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    cleanup.push("stop etcd", etcd.stop)
    stack = Stack(tmp, prefix, bpffs, nats, etcd)
    manifests = tmp / "manifests"
    manifests.mkdir()
    level = "info" if log_level_info else "warning"
    common = ["--nats-url", nats.url, "--node-name", NODE, "--log-level", level, "--log-format", "text"]
    logs = tmp / "logs"
    logs.mkdir()
    # Upstreams first: each reports SERVING once what it consumes is synced.
    plan: list[tuple[str, list[str]]] = [
        ("watcher", ["--source", "manifests", "--manifests", str(manifests)]),
        ("ipam", ["--etcd-endpoints", etcd.endpoint, "--cluster-cidrs", CLUSTER_CIDR]),
        ("policy", []),
    ]
    for name, extra in plan:
        proc = ServiceProcess(name, logs, [*common, *extra])
        cleanup.push(f"stop {name}", lambda p=proc: stop_service(p))  # type: ignore[misc]
        proc.start(timeout=120)
        stack.services[name] = proc
    datapath = ServiceProcess(
        "datapath",
        logs,
        [
            *common,
            *datapath_flags(
                stack.services["policy"].address, stack.services["ipam"].address, tmp / "datapath-state", bpffs
            ),
            *(["--attach", attach] if attach else []),
        ],
    )
    cleanup.push("remove the datapath's pins", lambda: teardown_bpffs(bpffs))
    cleanup.push("remove pod namespaces", lambda: remove_netns(prefix))
    cleanup.push("stop datapath", lambda: stop_service(datapath))
    datapath.start(timeout=300)
    stack.services["datapath"] = datapath
    return stack


def delete_endpoints(address: str, timeout: float = 120.0) -> None:
    """Delete every endpoint of the datapath (namespaces, veths, map entries) before it stops."""
    with sync_channel(address, "datapath") as channel:
        stub = datapath_pb2_grpc.DatapathServiceStub(channel)
        deadline = time.monotonic() + timeout
        eps = stub.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=30).endpoints
        for ep in eps:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(grpc.RpcError):
                stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=ep.id), timeout=min(30.0, left))


async def bounded(jobs: Sequence[Callable[[], Awaitable[Any]]], concurrency: int) -> list[float]:
    """Run jobs with at most ``concurrency`` in flight; returns each job's seconds."""
    queue = list(enumerate(jobs))
    queue.reverse()
    out = [0.0] * len(jobs)

    async def worker() -> None:
        while queue:
            index, job = queue.pop()
            t = time.perf_counter()
            await job()
            out[index] = time.perf_counter() - t

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


#: CreateEndpoint calls in flight at once in part 1 (a runtime starting a deployment's pods).
CREATES_IN_FLIGHT = 4


async def create_endpoints(
    stub: datapath_pb2_grpc.DatapathServiceStub, prefix: str, count: int
) -> tuple[list[datapath_pb2.Endpoint], list[float], float]:
    created: list[datapath_pb2.Endpoint] = []

    def job(i: int) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            ns, labels = endpoint_labels(i)
            request = datapath_pb2.CreateEndpointRequest(
                namespace=f"{prefix}-{ns}",
                pod=f"pod-{i}",
                labels=[common_pb2.Label(source="k8s", key=k, value=v) for k, v in labels.items()],
            )
            created.append(await stub.CreateEndpoint(request, timeout=120))

        return run

    started = time.perf_counter()
    times = await bounded([job(i) for i in range(count)], CREATES_IN_FLIGHT)
    return created, times, time.perf_counter() - started


async def import_docs(
    stub: policy_pb2_grpc.PolicyServiceStub, docs: Sequence[dict[str, Any]], origin: str
) -> policy_pb2.ImportPoliciesResponse:
    response: policy_pb2.ImportPoliciesResponse = await stub.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump_all(docs, sort_keys=False), origin=origin),
        timeout=300,
    )
    rejected = [p.error for p in response.policies if p.state == policy_pb2.POLICY_STATE_REJECTED]
    if rejected:
        raise RuntimeError(f"{origin}: {len(rejected)} policies rejected, first: {rejected[0]}")
    return response


async def wait_realized(stub: policy_pb2_grpc.PolicyServiceStub, revision: int, timeout: float) -> None:
    answer: policy_pb2.WaitForRevisionResponse = await stub.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=revision, timeout_seconds=timeout), timeout=timeout + 10
    )
    if not answer.realized:
        behind = ", ".join(f"{b.pod or b.endpoint_id}@{b.realized_revision}" for b in answer.behind[:5])
        raise RuntimeError(f"revision {revision} not realized after {timeout:.0f}s; behind: {behind}")


async def allocation_level(
    channel: grpc.aio.Channel, prefix: str, level: int, identities: int, ips: int
) -> dict[str, float]:
    """New identities, IP allocations and releases per second with ``level`` requests in flight."""
    ident = identity_pb2_grpc.IdentityServiceStub(channel)
    ipam = ipam_pb2_grpc.IPAMServiceStub(channel)
    out: dict[str, float] = {}

    def alloc_identity(i: int) -> Callable[[], Awaitable[Any]]:
        labels = [
            common_pb2.Label(source="k8s", key="app", value=f"alloc-c{level}-{i}"),
            common_pb2.Label(source="k8s", key="io.kubernetes.pod.namespace", value=f"{prefix}-alloc"),
        ]
        request = identity_pb2.AllocateIdentityRequest(
            labels=labels, node="bench-alloc", owner=f"pod/{prefix}-alloc/c{level}-{i}"
        )
        return lambda: ident.AllocateIdentity(request, timeout=60)

    started = time.perf_counter()
    await bounded([alloc_identity(i) for i in range(identities)], level)
    out[f"identity_new_per_s_c{level}"] = round(identities / (time.perf_counter() - started), 1)

    node = f"bench-ip-c{level}"
    allocated: list[tuple[str, str]] = []

    def alloc_ip(i: int) -> Callable[[], Awaitable[Any]]:
        owner = f"pod/{prefix}-alloc/ip-c{level}-{i}"
        request = ipam_pb2.AllocateIPRequest(node=node, owner=owner, family=ipam_pb2.FAMILY_IPV4)

        async def run() -> None:
            answer = await ipam.AllocateIP(request, timeout=60)
            allocated.append((answer.ip, owner))

        return run

    await ipam.GetNodeCIDR(ipam_pb2.GetNodeCIDRRequest(node=node), timeout=60)  # the node's CIDR first
    started = time.perf_counter()
    await bounded([alloc_ip(i) for i in range(ips)], level)
    out[f"ip_allocate_per_s_c{level}"] = round(ips / (time.perf_counter() - started), 1)
    distinct = len({ip for ip, _ in allocated})
    if distinct != ips:
        raise RuntimeError(f"{ips} IP allocations gave {distinct} distinct addresses")

    def release_ip(ip: str, owner: str) -> Callable[[], Awaitable[Any]]:
        request = ipam_pb2.ReleaseIPRequest(node=node, ip=ip, owner=owner)
        return lambda: ipam.ReleaseIP(request, timeout=60)

    started = time.perf_counter()
    await bounded([release_ip(ip, owner) for ip, owner in allocated], level)
    out[f"ip_release_per_s_c{level}"] = round(ips / (time.perf_counter() - started), 1)
    return out


async def allocation_rates(ipam_address: str, prefix: str, identities: int, ips: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with harness_channel(ipam_address, "ipam", "datapath") as channel:
        for level in (1, 16):
            out.update(await allocation_level(channel, prefix, level, identities, ips))
    return out


def stack_pids(stack: Stack) -> dict[str, int]:
    """The stack's processes by name: the services, nats-server and etcd."""
    pids = {name: p.proc.pid for name, p in stack.services.items() if p.proc}
    for name, server in (("nats-server", stack.nats), ("etcd", stack.etcd)):
        if server.proc is not None:
            pids[name] = server.proc.pid
    return pids


async def services_part(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    prefix = stack.prefix
    result: dict[str, Any] = {}
    dp_channel = harness_channel(stack.services["datapath"].address, "datapath")
    pol_channel = harness_channel(stack.services["policy"].address, "policy")
    try:
        datapath = datapath_pb2_grpc.DatapathServiceStub(dp_channel)
        policy = policy_pb2_grpc.PolicyServiceStub(pol_channel)

        log(f"creating {args.endpoints} endpoints")
        pids = stack_pids(stack)
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"bench client": time.process_time()}
        eps, create_times, create_s = await create_endpoints(datapath, prefix, args.endpoints)
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"bench client": time.process_time()}
        result["endpoints"] = len(eps)
        result["identities_of_endpoints"] = len({ep.identity for ep in eps})
        result["endpoint_create_ms"] = stats_ms([t * 1000 for t in create_times])
        result["endpoint_create_total_s"] = round(create_s, 2)
        # Where a create's time goes on a machine of few cores: CPU per create, by process.
        result["endpoint_create_cpu_ms"] = {
            name: round((cpu_after[name] - cpu_before[name]) * 1000 / len(eps), 2) for name in cpu_before
        }
        if args.endpoints_only:
            return result

        log(f"importing {args.policies} policies")
        started = time.perf_counter()
        revision = 0
        batch = 100
        for first in range(0, args.policies, batch):
            docs = [base_policy(j, prefix) for j in range(first, min(args.policies, first + batch))]
            revision = (await import_docs(policy, docs, f"base-{first}")).revision
        imported = time.perf_counter() - started
        await wait_realized(policy, revision, 300)
        result["policies"] = args.policies
        result["policy_import_s"] = round(imported, 2)
        result["policy_import_to_realized_s"] = round(time.perf_counter() - started, 2)

        listed = await datapath.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=30)
        ready = sum(1 for ep in listed.endpoints if ep.state == datapath_pb2.ENDPOINT_STATE_READY)
        result["endpoints_ready_after_load"] = ready
        if ready != len(eps):
            raise RuntimeError(f"only {ready} of {len(eps)} endpoints are READY after loading the policies")
        sizes = []
        for ep in eps:
            got = await datapath.GetPolicyMap(
                datapath_pb2.GetPolicyMapRequest(endpoint=datapath_pb2.GetEndpointRequest(id=ep.id)), timeout=30
            )
            sizes.append(len(got.entries))
        result["policy_map_entries"] = {"total": sum(sizes), "min": min(sizes), "max": max(sizes)}

        await asyncio.sleep(1.0)  # let garbage settle before reading memory
        result["rss_mib_loaded"] = {name: rss_mib(pid) for name, pid in stack_pids(stack).items()}

        log(f"timing {args.changes} policy changes")
        delays: list[float] = []
        import_ms: list[float] = []
        for n in range(args.changes):
            doc = change_policy(n, prefix)
            t0 = time.perf_counter()
            response = await import_docs(policy, [doc], f"change-{n}")
            t1 = time.perf_counter()
            await wait_realized(policy, response.revision, 60)
            t2 = time.perf_counter()
            delays.append((t2 - t0) * 1000)
            import_ms.append((t1 - t0) * 1000)
        # The last change is in the kernel map of an endpoint it selects.
        last = args.changes - 1
        target = next(ep for ep in eps if endpoint_labels(int(ep.pod.removeprefix("pod-"))) == last_selects(last))
        got = await datapath.GetPolicyMap(
            datapath_pb2.GetPolicyMapRequest(endpoint=datapath_pb2.GetEndpointRequest(id=target.id)), timeout=30
        )
        if not any(e.key.port_low == 20000 + last for e in got.entries):
            raise RuntimeError(f"the last change (port {20000 + last}) is not in the map of {target.pod}")
        result["implementation_delay_ms"] = stats_ms(delays)
        result["import_call_ms"] = stats_ms(import_ms)
        result["implementation_delay_samples_ms"] = [round(d, 3) for d in delays]
        result["changes"] = len(delays)

        log("allocation rates through the ipam API")
        result["allocation"] = await allocation_rates(
            stack.services["ipam"].address, prefix, args.alloc_identities, args.alloc_ips
        )
        result["allocation"]["identities_per_level"] = args.alloc_identities
        result["allocation"]["ips_per_level"] = args.alloc_ips
    finally:
        await dp_channel.close()
        await pol_channel.close()
    return result


# -- part 3b: a policy service loaded with a big world on NATS ---------------------------


async def big_policy_part(tmp: Path, args: argparse.Namespace, cleanup: Cleanup) -> dict[str, Any]:
    from bench.bench_policy_service import NAMESPACES as PS_NAMESPACES
    from bench.bench_policy_service import load_world
    from palisade.v1 import policy_pb2 as ppb
    from services.common.bus import ALL_STREAMS, Bus
    from services.common.subjects import REGEN_ALL

    nodes = 10
    world = argparse.Namespace(identities=args.big_identities, policies=args.big_policies, nodes=nodes)
    nats = NatsServer(tmp / "nats-big")
    nats.start()
    cleanup.push("stop the second nats", nats.stop)
    bus = await Bus.connect([nats.url], name="bench-big", retries=5, backoff=0.05, tls=creds())
    try:
        await bus.ensure_streams(*ALL_STREAMS)
        started = time.perf_counter()
        await load_world(bus, world, max(1, args.big_identities // PS_NAMESPACES))
        published = time.perf_counter() - started
        seen: set[str] = set()
        all_nodes = asyncio.Event()

        async def on_order(msg: Any) -> None:
            order = ppb.RegenerationOrder()
            order.ParseFromString(msg.data)
            seen.add(order.node)
            if len(seen) == nodes:
                all_nodes.set()

        await bus.nc.subscribe(REGEN_ALL, cb=on_order)
        await bus.nc.flush()
        logs = tmp / "logs-big"
        logs.mkdir()
        proc = ServiceProcess("policy", logs, ["--nats-url", nats.url, "--log-level", "warning"])
        cleanup.push("stop the second policy service", lambda: stop_service(proc))
        started = time.perf_counter()
        proc.start(wait=False)
        await asyncio.to_thread(proc.wait_serving, 600.0)
        serving = time.perf_counter() - started
        await asyncio.wait_for(all_nodes.wait(), 600)
        orders = time.perf_counter() - started
        await asyncio.sleep(1.0)
        assert proc.proc is not None
        rss = rss_mib(proc.proc.pid)
        stop_service(proc)
    finally:
        await bus.close()
    return {
        "policies": args.big_policies,
        "identities": args.big_identities,
        "nodes": nodes,
        "world_publish_s": round(published, 2),
        "start_to_serving_s": round(serving, 2),
        "start_to_orders_for_every_node_s": round(orders, 2),
        "policy_rss_mib": rss,
    }


# -- part 4: the engine alone, in a child process ------------------------------------------


def engine_part(policies: int, identities: int, namespaces: int, samples: int) -> dict[str, Any]:
    from bench.bench_engine import APPS as ENGINE_APPS
    from bench.bench_engine import TIERS as ENGINE_TIERS
    from bench.bench_engine import load_engine, make_identities, make_policy, profiled
    from services.common.gctuning import freeze_loaded, tune_gc
    from services.common.labels import pod_identity_labels
    from services.policy.engine.identity import Identity
    from services.policy.engine.parse import parse_policy

    tune_gc()  # as the policy service does
    rng = random.Random(7)
    t = time.perf_counter()
    idents = make_identities(identities, namespaces, rng)
    docs = [parse_policy(make_policy(i, namespaces, rng)) for i in range(policies)]
    generate_s = time.perf_counter() - t

    t = time.perf_counter()
    eng, _ = load_engine(idents, docs)
    full_s = time.perf_counter() - t
    entries = sum(len(p.entries) for p in eng.policies().values())
    freeze_loaded()  # as the policy service does once its inputs are replayed

    pick = random.Random(99)
    policy_times: list[float] = []
    policy_subjects: list[int] = []
    for k in pick.sample(range(policies), min(samples, policies)):
        changed = parse_policy(make_policy(k, namespaces, random.Random(k), variant=1 + k % 3))
        t = time.perf_counter()
        result = eng.upsert_policy(changed)
        policy_times.append(time.perf_counter() - t)
        policy_subjects.append(len(result.diffs))

    def new_labels(n: int) -> Any:
        ns = f"ns{pick.randrange(namespaces)}"
        pod = {
            "metadata": {
                "namespace": ns,
                "labels": {"app": pick.choice(ENGINE_APPS), "tier": pick.choice(ENGINE_TIERS), "v": f"new{n}"},
            }
        }
        team = f"t{int(ns[2:]) % 20}"
        return pod_identity_labels(pod, {"metadata": {"name": ns, "labels": {"team": team}}})

    add_times: list[float] = []
    remove_times: list[float] = []
    first = max(eng.identities()) + 1
    for n in range(samples):
        ident = Identity(first + n, new_labels(n))
        t = time.perf_counter()
        eng.upsert_identity(ident)
        add_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.remove_identity(ident.id)
        remove_times.append(time.perf_counter() - t)
    rss = rss_mib(os.getpid())
    later = [Identity(first + samples + n, new_labels(samples + n)) for n in range(5)]
    profiles = {
        "full_recompute": profiled(eng.compute_all),
        "identity_add_x5": profiled(lambda: [eng.upsert_identity(i) for i in later]),
    }

    def ms(values: list[float]) -> dict[str, float]:
        return stats_ms([v * 1000 for v in values])

    return {
        "policies": policies,
        "identities": identities,
        "namespaces": namespaces,
        "subjects": len(eng.policies()),
        "entries": entries,
        "generate_and_parse_s": round(generate_s, 2),
        "full_resolve_s": round(full_s, 3),
        "incremental_policy_change_ms": ms(policy_times),
        "incremental_policy_change_subjects_median": statistics.median(policy_subjects),
        "incremental_identity_add_ms": ms(add_times),
        "incremental_identity_remove_ms": ms(remove_times),
        "samples": samples,
        "engine_process_rss_mib": rss,
        "profile": profiles,
    }


def run_engine_child(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_control_plane",
        "--engine-only",
        "--engine-policies",
        str(args.engine_policies),
        "--engine-identities",
        str(args.engine_identities),
        "--engine-namespaces",
        str(args.engine_namespaces),
        "--engine-samples",
        str(args.engine_samples),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"engine part failed ({proc.returncode}): {proc.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


# -- main ----------------------------------------------------------------------------


def create_rows(sv: dict[str, Any]) -> list[dict[str, Any]]:
    """CreateEndpoint's latencies, its CPU, and the latency that CPU allows on this machine's cores."""
    cpu_ms = round(sum(sv["endpoint_create_cpu_ms"].values()), 2)
    cores = os.cpu_count() or 1
    return [
        {
            "metric": f"CreateEndpoint p50 ({CREATES_IN_FLIGHT} in flight)",
            "value": sv["endpoint_create_ms"]["p50"],
            "unit": "ms",
        },
        {
            "metric": f"CreateEndpoint p99 ({CREATES_IN_FLIGHT} in flight)",
            "value": sv["endpoint_create_ms"]["p99"],
            "unit": "ms",
            "target": target("<=", 30.0),
        },
        {"metric": "CreateEndpoint mean", "value": sv["endpoint_create_ms"]["mean"], "unit": "ms"},
        {"metric": "CreateEndpoint CPU per create, all processes", "value": cpu_ms, "unit": "ms"},
        {
            # Little's law: with every core busy, creates finish at most cores / CPU a second, so
            # the mean time of one with N in flight is at least N x CPU / cores.
            "metric": f"CreateEndpoint mean, CPU-bound floor ({CREATES_IN_FLIGHT} in flight, {cores} cores)",
            "value": round(CREATES_IN_FLIGHT * cpu_ms / cores, 2),
            "unit": "ms",
        },
    ]


def summary(out: dict[str, Any]) -> list[dict[str, Any]]:
    sv, eng, big = out["services"], out["engine"], out["policy_big"]
    eps, pols = sv["endpoints"], sv["policies"]
    rows: list[dict[str, Any]] = [
        {
            "metric": f"implementation delay p50 ({eps} endpoints, {pols} policies, 1 node)",
            "value": sv["implementation_delay_ms"]["p50"],
            "unit": "ms",
        },
        {
            "metric": f"implementation delay p99 ({eps} endpoints, {pols} policies, 1 node)",
            "value": sv["implementation_delay_ms"]["p99"],
            "unit": "ms",
            "target": target("<=", 50.0),
        },
        {"metric": f"{pols} policies: import -> realized", "value": sv["policy_import_to_realized_s"], "unit": "s"},
        *create_rows(sv),
        {
            "metric": f"engine full resolve ({eng['policies']} policies, {eng['identities']} identities)",
            "value": eng["full_resolve_s"],
            "unit": "s",
            "target": target("<=", 10.0),
        },
        {
            "metric": "engine incremental policy change p50",
            "value": eng["incremental_policy_change_ms"]["p50"],
            "unit": "ms",
        },
        {
            "metric": "engine incremental policy change p99",
            "value": eng["incremental_policy_change_ms"]["p99"],
            "unit": "ms",
            "target": target("<=", 20.0),
        },
        {"metric": "engine identity add p50", "value": eng["incremental_identity_add_ms"]["p50"], "unit": "ms"},
        {
            "metric": "engine identity add p99",
            "value": eng["incremental_identity_add_ms"]["p99"],
            "unit": "ms",
            "target": target("<=", 20.0),
        },
        {"metric": "engine identity remove p50", "value": eng["incremental_identity_remove_ms"]["p50"], "unit": "ms"},
        {
            "metric": "engine process RSS at that scale",
            "value": eng["engine_process_rss_mib"],
            "unit": "MiB",
            "target": target("<=", 300.0),
        },
    ]
    alloc = sv["allocation"]
    for level in (1, 16):
        rows += [
            {
                "metric": f"ipam API: new identities, concurrency {level}",
                "value": alloc[f"identity_new_per_s_c{level}"],
                "unit": "/s",
            },
            {
                "metric": f"ipam API: IP allocations, concurrency {level}",
                "value": alloc[f"ip_allocate_per_s_c{level}"],
                "unit": "/s",
            },
        ]
    for name, value in sv["rss_mib_loaded"].items():
        rows.append({"metric": f"RSS {name} ({eps} endpoints, {pols} policies)", "value": value, "unit": "MiB"})
    rows.append(
        {
            "metric": f"RSS policy ({big['policies']} policies, {big['identities']} identities, {big['nodes']} nodes)",
            "value": big["policy_rss_mib"],
            "unit": "MiB",
        }
    )
    rows.append(
        {
            "metric": f"policy start -> orders for every node ({big['policies']} policies)",
            "value": big["start_to_orders_for_every_node_s"],
            "unit": "s",
        }
    )
    return rows


def stack_places() -> tuple[Path, str, str, Cleanup]:
    """A run's temporary directory, netns prefix and bpffs folder, and the cleanup that removes the directory."""
    tmp = Path(tempfile.mkdtemp(prefix="palisade-bench-cp-"))
    cleanup = Cleanup()
    cleanup.push("remove the temporary directory", lambda: shutil.rmtree(tmp, ignore_errors=True))
    return tmp, f"bcp{secrets.token_hex(3)}", f"/sys/fs/bpf/palisade-bench-{secrets.token_hex(4)}", cleanup


def run_endpoints_only(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """Part 1's endpoint creation alone: the stack, ``--endpoints`` CreateEndpoint calls 4 at a time."""
    tmp, prefix, bpffs, cleanup = stack_places()
    try:
        log("starting nats, etcd, watcher, ipam, policy, datapath")
        stack = start_stack(tmp, prefix, bpffs, cleanup, log_level_info=bool(args.keep_logs), attach=args.attach)
        out["attach"] = args.attach or "default"
        cleanup.push("delete the endpoints", lambda: delete_endpoints(stack.services["datapath"].address))
        out["services"] = asyncio.run(services_part(stack, args))
        if args.keep_logs:
            delete_endpoints(stack.services["datapath"].address)
            stop_service(stack.services["datapath"])
            shutil.copytree(tmp / "logs", args.keep_logs, dirs_exist_ok=True)
    finally:
        cleanup.run()
    sv = out["services"]
    out["summary"] = [
        *create_rows(sv),
    ]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": "control_plane", "quick": args.quick}
    if args.endpoints_only:
        return run_endpoints_only(args, out)
    log(f"engine: {args.engine_policies} policies x {args.engine_identities} identities")
    started = time.perf_counter()
    out["engine"] = run_engine_child(args)
    out["engine"]["wall_s"] = round(time.perf_counter() - started, 1)

    tmp, prefix, bpffs, cleanup = stack_places()
    try:
        log("starting nats, etcd, watcher, ipam, policy, datapath")
        started = time.perf_counter()
        stack = start_stack(tmp, prefix, bpffs, cleanup)
        out["stack_start_s"] = round(time.perf_counter() - started, 1)
        cleanup.push("delete the endpoints", lambda: delete_endpoints(stack.services["datapath"].address))
        started = time.perf_counter()
        out["services"] = asyncio.run(services_part(stack, args))
        out["services"]["wall_s"] = round(time.perf_counter() - started, 1)
        if args.endpoints_only:
            return out
        log("stopping the services")
        cleanup.run()  # frees the CPU for the next part; removes tmp too
        tmp.mkdir(parents=True)
        cleanup.push("remove the temporary directory", lambda: shutil.rmtree(tmp, ignore_errors=True))
        log(f"policy service with {args.big_policies} policies x {args.big_identities} identities")
        started = time.perf_counter()
        out["policy_big"] = asyncio.run(big_policy_part(tmp, args, cleanup))
        out["policy_big"]["wall_s"] = round(time.perf_counter() - started, 1)
    finally:
        cleanup.run()
        if os.path.isdir(bpffs):
            log(f"warning: {bpffs} is still there")
    sv = out["services"]
    out["summary"] = summary(out)
    out["plots"] = [
        {
            "name": "implementation_delay",
            "title": f"Policy change -> realized ({sv['endpoints']} endpoints, {sv['policies']} policies, 1 node)",
            "xlabel": "ms",
            "ylabel": "changes",
            "kind": "hist",
            "series": {"ImportPolicies -> WaitForRevision realized": sv.pop("implementation_delay_samples_ms")},
        }
    ]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run at small sizes (about a minute)")
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--policies", type=int, default=1000)
    p.add_argument("--changes", type=int, default=50)
    p.add_argument("--alloc-identities", type=int, default=300, help="identities allocated per concurrency level")
    p.add_argument("--alloc-ips", type=int, default=200, help="IPs allocated per concurrency level (< 254)")
    p.add_argument("--big-policies", type=int, default=10000)
    p.add_argument("--big-identities", type=int, default=5000)
    p.add_argument("--engine-policies", type=int, default=10000)
    p.add_argument("--engine-identities", type=int, default=5000)
    p.add_argument("--engine-namespaces", type=int, default=500)
    # 100, not fewer: the p99 of 20 samples is their maximum, one scheduler stall on a shared machine.
    p.add_argument("--engine-samples", type=int, default=100)
    p.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--endpoints-only",
        action="store_true",
        help="only part 1's endpoint creation (CreateEndpoint 4 in flight), no policies, rates, memory or engine",
    )
    p.add_argument(
        "--attach", default="", help="with --endpoints-only: the datapath's --attach mode (default: its own default)"
    )
    p.add_argument("--keep-logs", metavar="DIR", help="with --endpoints-only: copy the services' logs (info) there")
    args = p.parse_args()
    if args.quick:
        args.endpoints, args.policies, args.changes = 10, 100, 5
        args.alloc_identities, args.alloc_ips = 30, 30
        args.big_policies, args.big_identities = 500, 250
        args.engine_policies, args.engine_identities, args.engine_namespaces, args.engine_samples = 500, 250, 25, 5
    if args.engine_only:
        print(
            json.dumps(
                engine_part(args.engine_policies, args.engine_identities, args.engine_namespaces, args.engine_samples)
            )
        )
        return 0
    if os.geteuid() != 0:
        log("needs root (the datapath loads BPF programs, creates namespaces)")
        return 2
    if not 0 < args.alloc_ips < 254:
        p.error("--alloc-ips must be between 1 and 253 (one node's /24)")
    logging.getLogger("palisade").setLevel(logging.ERROR)
    return run_timed(run, args, log)


if __name__ == "__main__":
    sys.exit(main())
