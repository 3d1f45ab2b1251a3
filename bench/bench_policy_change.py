"""The policy service's own work for one cluster-wide change, at bench_scale's world, without a stack.

Loads a :class:`PolicyCore` with bench_scale's world (by default 1,000 nodes, 50,000 pods in
500 namespaces x 10 apps = 5,000 identities, 1,000 policies), then edits bench_scale's
CiliumClusterwideNetworkPolicy (a new port each time) ``--changes`` times and measures the
process CPU seconds of each change's commit (engine, order planning) plus the encoding of
every node's order, and of the realized reports of every endpoint that follow. No NATS,
gRPC or etcd: what is left of bench_scale's "CPU per change: policy" is the service's I/O
(one ReportRealized call per node, one publish per node). ``--profile`` prints cProfile's
top functions of the changes.

    .venv/bin/python -m bench.bench_policy_change [--nodes N] [--changes N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from typing import Any

from bench.bench_scale import APPS, CHANGE_POLICY, TEAMS, World, change_policy
from services.common.gctuning import freeze_loaded, tune_gc
from services.common.subjects import identity_subject, ipcache_subject
from services.policy.engine.core import PolicyCore
from services.policy.engine.model import PolicyKind
from services.policy.engine.orders import PolicyEpoch
from services.policy.engine.realized import Report
from services.policy.engine.sources import Source, object_key
from services.policy.wire import DiffProtos, delta_from_proto, encode, identity_from_proto, record_from_proto
from testkit import builders


class Loaded:
    """A core holding the world, synced, every node at the current revision."""

    def __init__(self, world: World) -> None:
        self.core = PolicyCore(persisted=PolicyEpoch())
        self.now = 100.0
        self.endpoints: dict[str, list[tuple[str, int, int]]] = {}
        number = 256
        identity: dict[tuple[int, int], int] = {}
        for k in range(world.namespaces):
            for a in range(APPS):
                labels = {"app": f"a{a}", "io.cilium.k8s.namespace.labels.team": f"t{k % TEAMS}"}
                update = builders.identity_update(number, labels, f"ns-{k}")
                change = identity_from_proto(identity_subject(number), update)
                assert change is not None
                self.core.apply_identity(change, self.tick())
                identity[(k, a)] = number
                number += 1
        for p in range(world.pods):
            pod = world.pod(p)
            meta = pod["metadata"]
            k, a = p % world.namespaces, (p // world.namespaces) % APPS
            node, ip = pod["spec"]["nodeName"], pod["status"]["podIP"]
            entry = builders.ipcache_entry(ip, identity[(k, a)], node, meta["name"], namespace=meta["namespace"])
            self.core.apply_ipcache(ipcache_subject(ip), record_from_proto(entry), self.tick())
            self.endpoints.setdefault(node, []).append((f"{meta['namespace']}/{meta['name']}", identity[(k, a)], p))
        for j in range(world.policies):
            outcome = self.core.apply_policy_delta(delta_from_proto(builders.delta(world.policy(j))), self.tick())
            assert outcome is not None and outcome.accepted, outcome
        self.core.mark_synced(self.tick())
        self.commit_and_encode()
        self.report_all()

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def change(self, n: int) -> None:
        outcome = self.core.upsert(Source.API, change_policy(n), "", self.tick())
        assert outcome.accepted, outcome.error

    def answer(self) -> None:
        """The status ImportPolicies answers with: the changed policy's roll-up over every endpoint."""
        record = self.core.registry.get(
            Source.API, object_key(PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY, "", CHANGE_POLICY)
        )
        assert record is not None
        self.core.queries.view(record)

    def commit_and_encode(self) -> int:
        """Commit the open batch and encode every order, as the controller and its publisher do; bytes."""
        commit = self.core.commit(self.tick())
        protos = DiffProtos()
        return sum(
            m.ByteSize()
            for order in commit.orders
            for m in encode(order, max_bytes=1 << 20, max_chunks=1000, converted=protos)
        )

    def report_all(self) -> None:
        """Every node reports every endpoint at the current revision, as its datapath would."""
        revision = self.core.revision
        settled, left = self.core.wait_settled(revision)
        for node, endpoints in self.endpoints.items():
            reports = [Report(node, p + 1, ident, revision, pod) for pod, ident, p in endpoints]
            self.core.report(reports, self.tick())
            settled, left = self.core.wait_settled(revision, left)
        if not settled:
            raise RuntimeError(f"revision {revision} not settled after every endpoint reported it")


def _figures(seconds: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(seconds), 3), "min": round(min(seconds), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pods", type=int, default=50000)
    p.add_argument("--namespaces", type=int, default=500)
    p.add_argument("--policies", type=int, default=1000)
    p.add_argument("--changes", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of the changes")
    p.add_argument("--quick", action="store_true", help="smoke run: 20 nodes, 400 pods, 40 policies, 2 changes")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.pods, args.namespaces, args.policies, args.changes = 20, 400, 10, 40, 2
    tune_gc()  # as the policy service does
    started = time.perf_counter()
    loaded = Loaded(World(args.nodes, args.pods, args.namespaces, args.policies))
    freeze_loaded()
    load_s = time.perf_counter() - started
    loaded.change(0)  # the first makes every pod ingress-enforced: a different change
    loaded.commit_and_encode()
    loaded.report_all()
    profile = cProfile.Profile() if args.profile else None
    commit_s: list[float] = []
    answer_s: list[float] = []
    report_s: list[float] = []
    sent: list[int] = []
    for n in range(1, args.changes + 1):
        if profile is not None:
            profile.enable()
        t0 = time.process_time()
        loaded.change(n)
        sent.append(loaded.commit_and_encode())
        t1 = time.process_time()
        loaded.answer()
        ta = time.process_time()
        loaded.report_all()
        t2 = time.process_time()
        if profile is not None:
            profile.disable()
        commit_s.append(t1 - t0)
        answer_s.append(ta - t1)
        report_s.append(t2 - ta)
    out: dict[str, Any] = {
        "benchmark": "policy_change",
        "world": {"nodes": args.nodes, "pods": args.pods, "namespaces": args.namespaces, "policies": args.policies},
        "load_s": round(load_s, 1),
        "change_commit_and_encode_cpu_s": _figures(commit_s),
        "change_answer_status_cpu_s": _figures(answer_s),
        "change_reports_cpu_s": _figures(report_s),
        "change_order_bytes": round(statistics.mean(sent)),
    }
    world = f"{args.nodes} nodes, {args.pods} pods, {args.policies} policies"
    out["summary"] = [
        {"metric": f"{what} CPU per cluster-wide change, median ({world})", "value": out[key]["median"], "unit": "s"}
        for what, key in (
            ("policy core: commit, planning, encoding", "change_commit_and_encode_cpu_s"),
            ("policy core: the import's status answer", "change_answer_status_cpu_s"),
            ("policy core: every endpoint's report", "change_reports_cpu_s"),
        )
    ]
    out["plots"] = []
    print(json.dumps(out, indent=2))
    if profile is not None:
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
