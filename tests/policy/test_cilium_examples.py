"""Every upstream Cilium example parses; L7/FQDN ones report unsupported features;
where upstream tests state expected verdicts, the engine agrees."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.policy.engine.analyze import Document, Probe, analyze
from services.policy.engine.parse import is_policy_document, parse_policy

EXAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "testdata" / "cilium-examples"
INDEX: dict[str, dict[str, Any]] = (
    {e["file"]: e for e in json.loads((EXAMPLES / "index.json").read_text())}
    if (EXAMPLES / "index.json").exists()
    else {}
)
FILES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def test_corpus_present() -> None:
    assert len(FILES) >= 100, f"expected the examples corpus at {EXAMPLES}"


@pytest.mark.parametrize("name", FILES)
def test_every_policy_object_is_accepted(name: str) -> None:
    policies = [parse_policy(d) for d in load(name) if is_policy_document(d)]
    meta = INDEX.get(name, {})
    if meta.get("kinds") and set(meta["kinds"]) & {
        "NetworkPolicy",
        "CiliumNetworkPolicy",
        "CiliumClusterwideNetworkPolicy",
    }:
        assert policies, "policy objects expected"
    unsupported = [u for p in policies for u in p.unsupported]
    if meta.get("l7") or meta.get("fqdn"):
        assert unsupported, "L7/FQDN features must be reported"
    if meta.get("fqdn"):
        assert any("toFQDNs" in u for u in unsupported)
    if meta.get("l3l4_only") and not any(
        f.startswith(
            ("nodeSelector", "fromNodes", "toServices", "fromCIDRSet.cidrGroupRef", "auth", "ports.protocol:VRRP")
        )
        for f in meta.get("features", [])
    ):
        assert not unsupported, unsupported


# --- cilium-cli connectivity tests, namespace cilium-test, probe 8080/TCP ---------------

NS = "cilium-test"
PODS = {
    "client": ({"kind": "client", "name": "client"}, "default"),
    "client2": ({"kind": "client", "name": "client2", "other": "client"}, "default"),
    "echo-same-node": ({"kind": "echo", "name": "echo-same-node"}, "echo-same-node"),
    "echo-other-node": ({"kind": "echo", "name": "echo-other-node"}, "echo-other-node"),
}
CLI = "cilium-cli__connectivity__builder__manifests__"
ALLOW_ALL = [CLI + "allow-all-egress.yaml", CLI + "allow-all-ingress.yaml"]


def cli_matrix(files: list[str]) -> dict[str, dict[str, bool]]:
    docs = [Document("ns", {"kind": "Namespace", "metadata": {"name": NS}})]
    for name, (labels, sa) in PODS.items():
        ports = [{"name": "http-8080", "containerPort": 8080}] if labels["kind"] == "echo" else []
        docs.append(
            Document(
                name,
                {
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": NS, "labels": labels},
                    "spec": {"serviceAccountName": sa, "containers": [{"name": "c", "ports": ports}]},
                },
            )
        )
    for f in files:
        for d in load(f):
            d.setdefault("metadata", {}).setdefault("namespace", NS)
            docs.append(Document(f, d))
    results, _ = analyze(docs, [Probe.parse("8080/TCP")])
    return {s.split("/")[1]: {d.split("/")[1]: v for d, v in row.items()} for s, row in results[0].matrix.items()}


def echo(p: str) -> bool:
    return p.startswith("echo")


CLI_CASES: dict[str, tuple[list[str], Callable[[str, str], bool]]] = {
    "client-egress-to-echo-deny": (
        [*ALLOW_ALL, CLI + "client-egress-to-echo-deny.yaml"],
        lambda s, d: not (PODS[s][0]["kind"] == "client" and echo(d)),
    ),
    "client-egress-to-echo-deny-port-range": (
        [*ALLOW_ALL, CLI + "client-egress-to-echo-deny-port-range.yaml"],
        lambda s, d: not (PODS[s][0]["kind"] == "client" and echo(d)),
    ),
    "echo-ingress-from-other-client-deny": (
        [*ALLOW_ALL, CLI + "echo-ingress-from-other-client-deny.yaml"],
        lambda s, d: not (s == "client2" and echo(d)),
    ),
    "client-ingress-to-echo-named-port-deny": (
        [*ALLOW_ALL, CLI + "client-egress-to-echo-named-port-deny.yaml"],
        lambda s, d: not (s == "client" and echo(d)),
    ),
    "client-ingress-from-client2": (
        [CLI + "client-ingress-from-client2.yaml"],
        lambda s, d: PODS[d][0]["kind"] != "client" or s == "client2",
    ),
    "client-ingress-from-client2-knp": (
        [CLI + "client-ingress-from-client2-knp.yaml"],
        lambda s, d: PODS[d][0]["kind"] != "client" or s == "client2",
    ),
    "all-ingress-deny": ([CLI + "deny-all-ingress.yaml"], lambda s, d: False),
    "all-egress-deny": ([CLI + "deny-all-egress.yaml"], lambda s, d: False),
    "client-egress-to-echo": (
        [CLI + "client-egress-to-echo.yaml"],
        lambda s, d: PODS[s][0]["kind"] != "client" or echo(d),
    ),
    "client-egress-to-echo-port-range": (
        [CLI + "client-egress-to-echo-port-range.yaml"],
        lambda s, d: PODS[s][0]["kind"] != "client" or echo(d),
    ),
    "client-egress-to-echo-service-account": (
        [CLI + "client-egress-to-echo-service-account-port-range.yaml"],
        lambda s, d: PODS[s][0]["kind"] != "client" or d == "echo-same-node",
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cilium_cli_expectations(case: str) -> None:
    files, expect = CLI_CASES[case]
    for f in files:
        if not (EXAMPLES / f).exists():
            pytest.skip(f"{f} not in corpus")
    got = cli_matrix(files)
    want = {s: {d: s == d or expect(s, d) for d in PODS} for s in PODS}
    assert got == want
