"""The upstream x/y/z, a/b/c pod model the policy tests judge policies on, and matrices over it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import yaml

from services.common.manifests import Document
from services.policy.engine.analyze import Probe, analyze

NAMESPACES = ("x", "y", "z")


PODS = ("a", "b", "c")


PORT_NAMES = [(f"serve-{port}-{proto.lower()}", port, proto) for port in (80, 81) for proto in ("TCP", "UDP", "SCTP")]


Matrix = dict[str, dict[str, bool]]


Expect = Callable[[str, str], bool]


def pod_ip(ns: str, pod: str) -> str:
    return f"10.0.{NAMESPACES.index(ns) + 1}.{PODS.index(pod) + 1}"


def model_documents() -> list[dict[str, Any]]:
    """Three namespaces with label ns=<name>, pods a/b/c with label pod=<name> and
    named container ports serve-{80,81}-{tcp,udp,sctp}, IPs 10.0.<ns>.<pod>."""
    docs: list[dict[str, Any]] = []
    for ns in NAMESPACES:
        docs.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"ns": ns}}})
        for pod in PODS:
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod, "namespace": ns, "labels": {"pod": pod}},
                    "spec": {
                        "nodeName": "node-1",
                        "containers": [
                            {
                                "name": "c",
                                "ports": [
                                    {"name": name, "containerPort": port, "protocol": proto}
                                    for name, port, proto in PORT_NAMES
                                ],
                            }
                        ],
                    },
                    "status": {"podIP": pod_ip(ns, pod)},
                }
            )
    return docs


ALL_PODS = [f"{ns}/{p}" for ns in NAMESPACES for p in PODS]


def compute_matrix(policies: Iterable[Mapping[str, Any] | str], probe: str) -> Matrix:
    docs = [Document(f"model[{i}]", d) for i, d in enumerate(model_documents())]
    for i, p in enumerate(policies):
        body = yaml.safe_load(p) if isinstance(p, str) else p
        docs.append(Document(f"policy[{i}]", body))
    results, _ = analyze(docs, [Probe.parse(probe)])
    return {s: dict(row) for s, row in results[0].matrix.items()}


def expected_matrix(expect: Expect) -> Matrix:
    return {s: {d: (s == d) or expect(s, d) for d in ALL_PODS} for s in ALL_PODS}


def mismatches(got: Matrix, want: Matrix) -> list[str]:
    return [
        f"{s} -> {d}: got {got[s][d]}, want {want[s][d]}" for s in ALL_PODS for d in ALL_PODS if got[s][d] != want[s][d]
    ]
