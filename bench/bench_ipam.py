"""Identity and IP allocation throughput of ipam, in-process and through replicas' gRPC API.

    .venv/bin/python -m bench.bench_ipam [--identities 2000] [--ips 2000] [--concurrency 1,32]
                                         [--replicas 2] [--api-concurrency 16]

Starts its own single-member etcd and nats-server on free loopback ports (fresh
data dirs) and prints one JSON object.

- ``results``: the allocators in this process, per concurrency level: new identities
  per second (each a create-if-absent transaction plus the reference), references on
  existing identities per second, IP allocations and releases per second on one node.
- ``api``: ``--replicas`` ipam processes on that etcd and NATS, called over gRPC (mutual
  TLS) as the datapath calls them, ``--api-concurrency`` requests in flight in all,
  spread round-robin over the replicas: new identities (each announced on NATS before
  the answer), IP allocations on one node (every replica allocating from the same node
  CIDR) and their releases. No address or identity may be handed out twice. Then the
  floor: as many GetNodeCIDR calls answered from memory (gRPC, TLS and the client alone).
  And how many messages the identity stream took per new identity (its sequence numbers:
  1 when each identity is announced once).
- ``churn``: ipam's share of identity churn, the pod task of one ipam in this process on a
  fresh etcd and nats-server: ``--churn-rate`` new pods a second (each a new label set, with
  its address) for ``--churn-seconds``, each deleted ``--churn-life`` seconds after it came,
  fed as the bus deltas are; timed from the delta to its ipcache entry on the bus, and until
  the last is applied, with the CPU per pod change of this process, etcd and nats-server.

The ``summary`` rows carry the targets of issue 34 on the API figures, and the CPU each API
request cost the replicas, etcd, nats-server and this client; per phase too, with the ceiling
that CPU puts on this machine (its cores over the sum, were they doing nothing else).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from bench.stats import stats_ms, target
from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc
from services.common.bus import IDENTITY_STREAM, Bus
from services.common.labels import LabelSet
from services.common.store import connect_etcd
from services.common.subjects import IPCACHE_ALL
from services.ipam.config import IPAMMode
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Store
from services.ipam.leases import NodeLeases
from services.ipam.pods import K8sChanged
from services.ipam.podwatch import Change, ObjectKind
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, channel, creds
from testkit.ipam import K8s, ipam_args, namespace, pod, pod_task

#: Issue 34's targets for the API at concurrency 16 with two replicas, per second.
TARGET_IDENTITIES = 2000.0
TARGET_IPS = 2000.0
#: The replicas' pool: one node CIDR holds every address the API part allocates.
POOL = ("--cluster-cidrs", "10.0.0.0/8", "--node-mask-v4", "16")


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


async def bench(endpoint: str, identities: int, ips: int, levels: list[int]) -> dict[str, dict[str, float]]:
    host, port = endpoint.rsplit(":", 1)
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    store = Store(client)
    try:
        return {f"concurrency_{level}": await bench_level(store, level, identities, ips) for level in levels}
    finally:
        await client.close()


#: Measures one phase of the API part: runs it, returns (operations per second, CPU ms per request by process).
Phase = Callable[[str, Sequence[Callable[[], Awaitable[object]]]], Awaitable[float]]


async def _api_level(
    addresses: list[str], concurrency: int, identities: int, ips: int, phase: Phase
) -> dict[str, float]:
    channels = [channel(address, "ipam", "datapath") for address in addresses]
    try:
        ident = [identity_pb2_grpc.IdentityServiceStub(c) for c in channels]
        ipam = [ipam_pb2_grpc.IPAMServiceStub(c) for c in channels]
        n = len(channels)

        got_ids: dict[int, str] = {}

        def alloc_identity(i: int) -> Callable[[], Awaitable[None]]:
            labels = [
                common_pb2.Label(source="k8s", key="app", value=f"api-{i}"),
                common_pb2.Label(source="k8s", key="io.kubernetes.pod.namespace", value="bench"),
            ]
            request = identity_pb2.AllocateIdentityRequest(labels=labels, node=f"node-{i % 8}", owner=f"pod/bench/{i}")

            async def run() -> None:
                answer = await ident[i % n].AllocateIdentity(request, timeout=60)
                assert answer.new, f"label set {i} was not new"
                assert got_ids.setdefault(answer.identity.id, f"api-{i}") == f"api-{i}", (
                    "an identity was handed out twice"
                )

            return run

        node = "api-node"
        await ipam[0].GetNodeCIDR(ipam_pb2.GetNodeCIDRRequest(node=node), timeout=60)
        got_ips: dict[str, str] = {}

        def alloc_ip(i: int) -> Callable[[], Awaitable[None]]:
            request = ipam_pb2.AllocateIPRequest(node=node, owner=f"pod/bench/ip-{i}", family=ipam_pb2.FAMILY_IPV4)

            async def run() -> None:
                answer = await ipam[i % n].AllocateIP(request, timeout=60)
                assert got_ips.setdefault(answer.ip, answer.owner) == answer.owner, "an address was handed out twice"

            return run

        out = {"identity_new_per_s": await phase("identity_new", [alloc_identity(i) for i in range(identities)])}
        out["ip_allocate_per_s"] = await phase("ip_allocate", [alloc_ip(i) for i in range(ips)])
        assert len(got_ids) == identities and len(got_ips) == ips
        release = [
            functools.partial(
                ipam[i % n].ReleaseIP, ipam_pb2.ReleaseIPRequest(node=node, ip=ip, owner=owner), timeout=60
            )
            for i, (ip, owner) in enumerate(sorted(got_ips.items()))
        ]
        out["ip_release_per_s"] = await phase("ip_release", release)
        # The floor under every request: a call answered from memory (no etcd, no bus), so what
        # gRPC, TLS, the interceptors and the client cost alone.
        known = ipam_pb2.GetNodeCIDRRequest(node=node)
        floor = [functools.partial(ipam[i % n].GetNodeCIDR, known, timeout=60) for i in range(ips)]
        out["rpc_floor_per_s"] = await phase("rpc_floor", floor)
        return out
    finally:
        for c in channels:
            await c.close()


async def bench_api(tmp: Path, replicas: int, concurrency: int, identities: int, ips: int) -> dict[str, object]:
    """``replicas`` ipam processes on a fresh etcd and nats-server, called over gRPC."""
    etcd = EtcdServer(tmp / "etcd-api")
    etcd.start()
    nats = NatsServer(tmp / "nats")
    nats.start()
    procs: list[ServiceProcess] = []
    try:
        async with await Bus.connect([nats.url], name="bench", tls=creds()) as bus:
            await bus.ensure_streams()
            await K8s(bus).synced()
            published_before = (await bus.js.stream_info(IDENTITY_STREAM.name)).state.last_seq
        args = ipam_args(nats, etcd, "--identity-gc-interval", "3600", "--log-level", "warning", *POOL)
        logs = tmp / "logs"
        logs.mkdir()
        for _ in range(replicas):
            proc = ServiceProcess("ipam", logs, args)
            proc.start()
            procs.append(proc)
        pids = {
            name: [s.proc.pid for s in servers if s.proc is not None]
            for name, servers in (("replicas", procs), ("etcd", [etcd]), ("nats", [nats]))
        }

        def cpu() -> dict[str, float]:
            return {k: _cpu_seconds(v) for k, v in pids.items()} | {"client": time.process_time()}

        by_phase: dict[str, dict[str, float]] = {}

        async def phase(name: str, jobs: Sequence[Callable[[], Awaitable[object]]]) -> float:
            before = cpu()
            rate = await _timed(jobs, concurrency)
            after = cpu()
            by_phase[name] = {k: round((after[k] - before[k]) * 1000 / len(jobs), 3) for k in before}
            return rate

        figures = await _api_level([p.address for p in procs], concurrency, identities, ips, phase)
        async with await Bus.connect([nats.url], name="bench", tls=creds()) as bus:
            # The replicas announce from the watch too: wait until the stream stops growing.
            published, last = 0, -1
            while published != last:
                last = published
                await asyncio.sleep(1.0)
                published = (await bus.js.stream_info(IDENTITY_STREAM.name)).state.last_seq - published_before
        counts = {"identity_new": identities, "ip_allocate": ips, "ip_release": ips}
        requests = sum(counts.values())
        return {
            "replicas": replicas,
            "concurrency": concurrency,
            **figures,
            "identity_messages_per_new_identity": round(published / identities, 3),
            # Where the machine's CPU went, per API request (allocations and releases alike).
            "cpu_ms_per_request": {
                k: round(sum(by_phase[p][k] * n for p, n in counts.items()) / requests, 3)
                for k in by_phase["identity_new"]
            },
            # The same per phase (and for the floor: a call answered from memory).
            "cpu_ms_per_request_by_phase": by_phase,
        }
    finally:
        for proc in procs:
            if proc.terminate() != 0:
                print(f"ipam replica exited uncleanly:\n{proc.logs()[-2000:]}", file=sys.stderr)
        nats.stop()
        etcd.stop()
        etcd.stop()


async def bench_churn(tmp: Path, rate: int, seconds: int, life: int) -> dict[str, object]:
    """The pod task of one ipam under churn: ``rate`` new pods a second, each gone ``life`` s later."""
    etcd = EtcdServer(tmp / "etcd-churn")
    etcd.start()
    nats = NatsServer(tmp / "nats-churn")
    nats.start()
    try:
        host, port = etcd.endpoint.rsplit(":", 1)
        client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
        store = Store(client)
        async with await Bus.connect([nats.url], name="bench-churn", tls=creds()) as bus:
            await bus.ensure_streams()
            pods = (await pod_task(store, bus)).pods
            runner = asyncio.create_task(pods.run())
            namespaces = 50
            for n in range(namespaces):
                pods.submit(K8sChanged(Change(ObjectKind.NAMESPACE, "", f"ns-{n}", namespace(f"ns-{n}"))))
            await pods.sweep()
            written: dict[str, float] = {}
            lags: list[float] = []
            all_seen = asyncio.Event()

            async def on_entry(subject: str, entry: identity_pb2.IpcacheEntry) -> None:
                at = written.pop(entry.prefix, None)
                if at is not None and not entry.deleted:
                    lags.append((time.monotonic() - at) * 1000)
                if not written:
                    all_seen.set()

            await bus.follow(IPCACHE_ALL, identity_pb2.IpcacheEntry, on_entry)
            pids = {"etcd": [etcd.proc.pid] if etcd.proc else [], "nats": [nats.proc.pid] if nats.proc else []}
            before = {k: _cpu_seconds(v) for k, v in pids.items()} | {"ipam and client": time.process_time()}
            started = time.monotonic()

            def change(c: int, gone: bool = False) -> K8sChanged:
                ns, name = f"ns-{c % namespaces}", f"churn-{c}"
                ip = f"10.{100 + c // 60000}.{(c // 250) % 240}.{c % 250 + 1}"
                obj = (
                    None
                    if gone
                    else pod(ns, name, {"app": f"a{c % 10}", "churn": f"c{c}"}, node=f"node-{c % 100}", ip=ip)
                )
                if not gone:
                    written[f"{ip}/32"] = time.monotonic()
                return K8sChanged(Change(ObjectKind.POD, ns, name, obj))

            for second in range(seconds):
                for k in range(rate):
                    pods.submit(change(second * rate + k))
                    if second >= life:
                        pods.submit(change((second - life) * rate + k, gone=True))
                await asyncio.sleep(max(0.0, started + second + 1 - time.monotonic()))
            await pods.sweep()  # queued after every change: answered once all are applied
            drained = time.monotonic() - started - seconds
            if written:  # the last entries' messages are on their way back
                all_seen.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(all_seen.wait(), 5.0)
            after = {k: _cpu_seconds(v) for k, v in pids.items()} | {"ipam and client": time.process_time()}
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await client.close()
        events = rate * seconds + rate * max(0, seconds - life)
        return {
            "rate_per_s": rate,
            "seconds": seconds,
            "life_s": life,
            "pod_changes": events,
            "delta_to_ipcache_ms": stats_ms(lags),
            "missing_entries": len(written),
            "applied_after_last_s": round(drained, 2),
            "cpu_ms_per_pod_change": {k: round((after[k] - before[k]) * 1000 / events, 3) for k in before},
            "waves": pods.waves,
        }
    finally:
        nats.stop()
        etcd.stop()


def _cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds the processes have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def churn_rows(churn: dict[str, object]) -> list[dict[str, object]]:
    if not churn:
        return []
    where = f"{churn['rate_per_s']} new pods/s, each deleted {churn['life_s']} s later"
    lag = dict(churn["delta_to_ipcache_ms"])  # type: ignore[call-overload]
    cpu = dict(churn["cpu_ms_per_pod_change"])  # type: ignore[call-overload]
    return [
        {"metric": f"ipam pod churn: delta -> ipcache entry p50, {where}", "value": lag["p50"], "unit": "ms"},
        {"metric": f"ipam pod churn: delta -> ipcache entry p99, {where}", "value": lag["p99"], "unit": "ms"},
        {
            "metric": f"ipam pod churn: last change applied after the last delta, {where}",
            "value": churn["applied_after_last_s"],
            "unit": "s",
        },
        {
            "metric": f"ipam pod churn: CPU per pod change of all processes, {where}",
            "value": round(sum(cpu.values()), 3),
            "unit": "ms",
        },
    ]


def summary(
    results: dict[str, dict[str, float]], api: dict[str, object], churn: dict[str, object] | None = None
) -> list[dict[str, object]]:
    """One row per figure: the allocators in this process per level, then the API with its targets, then churn."""
    rows: list[dict[str, object]] = [
        {
            "metric": f"allocator in process: {name.removesuffix('_per_s')}, {level.replace('_', ' ')}",
            "value": v,
            "unit": "/s",
        }
        for level, figures in results.items()
        for name, v in figures.items()
    ]
    rows += churn_rows(churn or {})
    if not api:
        return rows
    where = f"{api['replicas']} replicas, concurrency {api['concurrency']}"
    return [
        *rows,
        {
            "metric": f"ipam API: new identities, {where}",
            "value": api["identity_new_per_s"],
            "unit": "/s",
            "target": target(">=", TARGET_IDENTITIES),
        },
        {
            "metric": f"ipam API: IP allocations, {where}",
            "value": api["ip_allocate_per_s"],
            "unit": "/s",
            "target": target(">=", TARGET_IPS),
        },
        {"metric": f"ipam API: IP releases, {where}", "value": api["ip_release_per_s"], "unit": "/s"},
        {
            "metric": f"ipam API: bus messages per new identity, {where}",
            "value": api["identity_messages_per_new_identity"],
            "unit": "messages",
        },
        *(
            {"metric": f"ipam API: CPU per request, {who}", "value": ms, "unit": "ms"}
            for who, ms in dict(api["cpu_ms_per_request"]).items()  # type: ignore[call-overload]
        ),
        *(
            {
                "metric": f"ipam API: CPU per request of all processes, {phase.replace('_', ' ')}",
                "value": round(sum(cpu.values()), 3),
                "unit": "ms",
            }
            for phase, cpu in dict(api["cpu_ms_per_request_by_phase"]).items()  # type: ignore[call-overload]
        ),
        *(
            # What the machine could do were its cores doing nothing else: the cores over that CPU.
            {
                "metric": f"ipam API: CPU ceiling on {os.cpu_count()} cores, {phase.replace('_', ' ')}",
                "value": round((os.cpu_count() or 1) * 1000 / sum(cpu.values()), 1),
                "unit": "/s",
            }
            for phase, cpu in dict(api["cpu_ms_per_request_by_phase"]).items()  # type: ignore[call-overload]
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=2000, help="identities allocated per concurrency level")
    parser.add_argument("--ips", type=int, default=2000, help="addresses allocated per concurrency level")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated numbers of requests in flight")
    parser.add_argument("--replicas", type=int, default=2, help="ipam processes behind the API figures (0: none)")
    parser.add_argument("--api-concurrency", type=int, default=16, help="API requests in flight over all replicas")
    parser.add_argument("--churn-rate", type=int, default=300, help="new pods a second in the churn part (0: none)")
    parser.add_argument("--churn-seconds", type=int, default=20, help="seconds new pods come in the churn part")
    parser.add_argument("--churn-life", type=int, default=10, help="seconds a churn pod lives")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    api: dict[str, object] = {}
    churn: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="palisade-bench-") as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")
        etcd.start()
        try:
            results = asyncio.run(bench(etcd.endpoint, args.identities, args.ips, levels))
        finally:
            etcd.stop()
        if args.replicas > 0:
            api = asyncio.run(bench_api(Path(tmp), args.replicas, args.api_concurrency, args.identities, args.ips))
        if args.churn_rate > 0:
            churn = asyncio.run(bench_churn(Path(tmp), args.churn_rate, args.churn_seconds, args.churn_life))
    out = {
        "benchmark": "ipam",
        "identities": args.identities,
        "ips": args.ips,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "results": results,
        "api": api,
        "churn": churn,
        "summary": summary(results, api, churn),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
