"""Benchmark: full resolve of 2,000 identities under 1,000 policies in 200 namespaces,
then one policy change applied incrementally. Prints JSON.

Run: .venv/bin/python bench/bench_engine.py [--policies N] [--identities N] [--namespaces N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.labels import pod_identity_labels
from services.policy.engine import PolicyEngine
from services.policy.identity import LocalAllocator
from services.policy.model import Protocol
from services.policy.parse import parse_policy

APPS = [f"app{i}" for i in range(10)]
TIERS = ["web", "api", "db"]


def make_identities(n: int, namespaces: int, rng: random.Random) -> list[Any]:
    alloc = LocalAllocator()
    out = []
    for i in range(n):
        ns = f"ns{i % namespaces}"
        labels = pod_identity_labels(
            {
                "metadata": {
                    "namespace": ns,
                    "labels": {"app": APPS[(i // namespaces) % len(APPS)], "tier": rng.choice(TIERS), "v": str(i)},
                }
            },
            {"metadata": {"name": ns, "labels": {"team": f"t{i % namespaces % 20}"}}},
        )
        out.append(alloc.allocate(labels))
    return out


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", type=int, default=1000)
    ap.add_argument("--identities", type=int, default=2000)
    ap.add_argument("--namespaces", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(7)
    idents = make_identities(args.identities, args.namespaces, rng)
    policies = [parse_policy(make_policy(i, args.namespaces, rng)) for i in range(args.policies)]

    t0 = time.perf_counter()
    eng = PolicyEngine()
    eng.begin_batch()
    for ident in idents:
        eng.upsert_identity(ident)
    for n, ident in enumerate(idents):
        eng.set_named_ports(ident.id, {"http": [(Protocol.TCP, 8080 + n % 3)]})
    for p in policies:
        eng.upsert_policy(p)
    full = eng.end_batch()
    full_s = time.perf_counter() - t0
    entries = sum(len(p.entries) for p in eng.policies().values())

    t1 = time.perf_counter()
    recompute = eng.compute_all()
    recompute_s = time.perf_counter() - t1

    changed = parse_policy(make_policy(3, args.namespaces, random.Random(99), variant=1))
    t2 = time.perf_counter()
    inc = eng.upsert_policy(changed)
    inc_s = time.perf_counter() - t2

    t3 = time.perf_counter()
    ident_change = eng.remove_identity(idents[5].id)
    ident_s = time.perf_counter() - t3

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
                "full_subjects_changed": len(full.diffs),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
