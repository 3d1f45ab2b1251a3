"""Benchmark: full resolve of 2,000 identities under 1,000 policies in 200 namespaces,
then incremental changes: one policy change, and identity-side changes (add,
relabel, ipcache upsert/delete, named ports, remove) of single identities, each
timed over ``--samples`` identities (median and max), plus one batch of
``--batch`` identity adds. Prints one flat JSON object.

Run: .venv/bin/python bench/bench_engine.py [--policies N] [--identities N] [--namespaces N]
     [--samples N] [--batch N] [--verify]

``--verify`` checks at the end that the incrementally maintained policies equal
a full recomputation.
"""

from __future__ import annotations

import argparse
import cProfile
import ipaddress
import json
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.stats import percentile, rss_mib
from services.common.gctuning import freeze_loaded, tune_gc
from services.common.labels import pod_identity_labels
from services.policy.engine.identity import Identity, LocalAllocator
from services.policy.engine.model import IpProto
from services.policy.engine.parse import parse_policy
from services.policy.engine.policyengine import ChangeResult, PolicyEngine

APPS = [f"app{i}" for i in range(10)]
TIERS = ["web", "api", "db"]


def pod_labels(i: int, namespaces: int, tier: str) -> Any:
    ns = f"ns{i % namespaces}"
    return pod_identity_labels(
        {
            "metadata": {
                "namespace": ns,
                "labels": {"app": APPS[(i // namespaces) % len(APPS)], "tier": tier, "v": str(i)},
            }
        },
        {"metadata": {"name": ns, "labels": {"team": f"t{i % namespaces % 20}"}}},
    )


def load_engine(
    idents: list[Any], policies: list[Any], *, named_ports: bool = True
) -> tuple[PolicyEngine, ChangeResult]:
    """A policy engine with ``idents`` and the parsed ``policies`` loaded in one batch (each identity
    naming port ``http`` unless not ``named_ports``), and the batch's result."""
    eng = PolicyEngine()
    eng.begin_batch()
    for ident in idents:
        eng.upsert_identity(ident)
    if named_ports:
        for n, ident in enumerate(idents):
            eng.set_named_ports(ident.id, {"http": [(IpProto.TCP, 8080 + n % 3)]})
    for p in policies:
        eng.upsert_policy(p)
    return eng, eng.end_batch()


def make_identities(n: int, namespaces: int, rng: random.Random) -> list[Any]:
    alloc = LocalAllocator()
    return [alloc.allocate(pod_labels(i, namespaces, rng.choice(TIERS))) for i in range(n)]


def make_policy(i: int, namespaces: int, rng: random.Random, *, variant: int = 0) -> dict[str, Any]:
    ns = f"ns{i % namespaces}"
    app = APPS[(i + variant) % len(APPS)]
    kind = i % 3
    if kind == 0:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"p{i}", "namespace": ns},
            "spec": {
                "podSelector": {"matchLabels": {"app": app}},
                "ingress": [
                    {
                        "from": [
                            {"podSelector": {"matchLabels": {"tier": rng.choice(TIERS)}}},
                            {"namespaceSelector": {"matchLabels": {"team": f"t{rng.randrange(20)}"}}},
                        ],
                        "ports": [{"port": 80 + variant}, {"port": "http"}],
                    }
                ],
                "egress": [
                    {"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]},
                    {"ports": [{"port": 53, "protocol": "UDP"}]},
                ],
            },
        }
    if kind == 1:
        return {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNetworkPolicy",
            "metadata": {"name": f"p{i}", "namespace": ns},
            "spec": {
                "endpointSelector": {"matchLabels": {"app": app}},
                "ingress": [
                    {
                        "fromEndpoints": [{"matchLabels": {"tier": rng.choice(TIERS)}}],
                        "toPorts": [{"ports": [{"port": str(8000 + variant), "endPort": 8100, "protocol": "TCP"}]}],
                    },
                    {"fromEntities": ["host", "remote-node"]},
                ],
                "egressDeny": [
                    {
                        "toEndpoints": [
                            {"matchLabels": {"k8s:io.kubernetes.pod.namespace": f"ns{rng.randrange(namespaces)}"}}
                        ]
                    }
                ],
                "egress": [{"toEntities": ["cluster"]}],
            },
        }
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": f"p{i}", "namespace": ns},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": app, "tier": rng.choice(TIERS)}},
            "ingress": [
                {
                    "fromEndpoints": [
                        {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["web", "api"]}]}
                    ],
                    "toPorts": [{"ports": [{"port": "443", "protocol": "TCP"}]}],
                },
                {"fromCIDRSet": [{"cidr": "192.0.2.0/24"}]},
            ],
        },
    }


def profiled(fn: Callable[[], object], top: int = 8) -> list[str]:
    """Run ``fn`` under cProfile: its ``top`` functions by own time, as ``seconds calls function`` lines."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]  # the documented raw table
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [f"{tt:.3f}s {nc} {Path(file).name}:{line}({name})" for (file, line, name), (_, nc, tt, _, _) in rows]


def timed(fn: Callable[[], ChangeResult]) -> tuple[float, ChangeResult]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def identity_changes(eng: PolicyEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Time single identity-side changes on ``--samples`` new identities, each like the existing ones."""
    times: dict[str, list[float]] = {}
    changed: dict[str, list[int]] = {}

    def record(name: str, fn: Callable[..., ChangeResult], *fn_args: Any) -> None:
        seconds, result = timed(lambda: fn(*fn_args))
        times.setdefault(name, []).append(seconds)
        changed.setdefault(name, []).append(len(result.diffs))

    first = max(eng.identities()) + 1
    for n in range(args.samples):
        number = first + n
        i = rng.randrange(args.identities)
        ident = Identity(number, pod_labels(i, args.namespaces, rng.choice(TIERS)))
        ip = ipaddress.ip_address(f"10.{2 + n // 250}.{n % 250}.{1 + i % 250}")  # inside the policies' 10/8
        record("identity_add", eng.upsert_identity, ident)
        other_tier = rng.choice([t for t in TIERS if ident.labels != pod_labels(i, args.namespaces, t)])
        relabeled = Identity(number, pod_labels(i, args.namespaces, other_tier))
        record("identity_relabel", eng.upsert_identity, relabeled)
        record("ipcache_upsert", eng.upsert_ipcache, ip, number)
        record("named_ports", eng.set_named_ports, number, {"http": [(IpProto.TCP, 9000 + n)]})
        record("ipcache_delete", eng.delete_ipcache, ip)
        record("identity_remove", eng.remove_identity, number)
    out: dict[str, Any] = {}
    for name, values in times.items():
        out[f"{name}_median_s"] = round(statistics.median(values), 6)
        out[f"{name}_p99_s"] = round(percentile(values, 0.99), 6)
        out[f"{name}_max_s"] = round(max(values), 6)
        out[f"{name}_subjects_changed_median"] = statistics.median(changed[name])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", type=int, default=1000)
    ap.add_argument("--identities", type=int, default=2000)
    ap.add_argument("--namespaces", type=int, default=200)
    ap.add_argument("--samples", type=int, default=20, help="identities to time single changes on")
    ap.add_argument("--batch", type=int, default=100, help="identity adds in the batched case")
    ap.add_argument("--verify", action="store_true", help="compare with a full recomputation at the end")
    args = ap.parse_args()
    tune_gc()  # as the policy service does
    rng = random.Random(7)
    idents = make_identities(args.identities, args.namespaces, rng)
    policies = [parse_policy(make_policy(i, args.namespaces, rng)) for i in range(args.policies)]

    t0 = time.perf_counter()
    eng, full = load_engine(idents, policies)
    full_s = time.perf_counter() - t0
    entries = sum(len(p.entries) for p in eng.policies().values())
    full_diffs = len(full.diffs)
    del full
    freeze_loaded()  # as the policy service does once its inputs are replayed
    loaded_rss = rss_mib(os.getpid())

    t1 = time.perf_counter()
    recompute = eng.compute_all()
    recompute_s = time.perf_counter() - t1

    changed = parse_policy(make_policy(3, args.namespaces, random.Random(99), variant=1))
    inc_s, inc = timed(lambda: eng.upsert_policy(changed))

    ident_s, ident_change = timed(lambda: eng.remove_identity(idents[5].id))

    singles = identity_changes(eng, args, random.Random(11))

    first = max(eng.identities()) + 1
    batch = [Identity(first + n, pod_labels(n, args.namespaces, TIERS[n % 3])) for n in range(args.batch)]

    def add_batch() -> ChangeResult:
        eng.begin_batch()
        for ident in batch:
            eng.upsert_identity(ident)
        return eng.end_batch()

    batch_s, batch_result = timed(add_batch)

    profile_first = max(eng.identities()) + 1
    profile_adds = [Identity(profile_first + n, pod_labels(n, args.namespaces, TIERS[n % 3])) for n in range(5)]
    profiles = {
        "profile_full_recompute": profiled(eng.compute_all),
        "profile_identity_add_x5": profiled(lambda: [eng.upsert_identity(i) for i in profile_adds]),
    }

    verified: dict[str, Any] = {}
    if args.verify:
        verified["verified_equal_to_full_recompute"] = dict(eng.policies()) == eng.compute_all()

    print(
        json.dumps(
            {
                "policies": args.policies,
                "identities": args.identities,
                "namespaces": args.namespaces,
                "subjects": len(recompute),
                "entries": entries,
                "full_load_and_resolve_s": round(full_s, 4),
                "full_recompute_s": round(recompute_s, 4),
                "incremental_policy_change_s": round(inc_s, 6),
                "incremental_subjects_changed": len(inc.diffs),
                "incremental_entries_added": sum(len(d.added) for d in inc.diffs.values()),
                "incremental_entries_removed": sum(len(d.removed) for d in inc.diffs.values()),
                "ratio_incremental_to_full_recompute": round(inc_s / recompute_s, 6),
                "identity_removal_s": round(ident_s, 6),
                "identity_removal_subjects_changed": len(ident_change.diffs),
                **singles,
                "ratio_identity_add_to_full_recompute": round(singles["identity_add_median_s"] / recompute_s, 6),
                "ratio_identity_remove_to_full_recompute": round(singles["identity_remove_median_s"] / recompute_s, 6),
                "batch_identity_adds": args.batch,
                "batch_identity_adds_s": round(batch_s, 4),
                "batch_subjects_changed": len(batch_result.diffs),
                "full_subjects_changed": full_diffs,
                "rss_mib_loaded": loaded_rss,
                "rss_mib_end": rss_mib(os.getpid()),
                **verified,
                **profiles,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
