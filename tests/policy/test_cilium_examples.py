"""Every upstream Cilium example parses; toFQDNs and DNS rules become rules on names (enforced);
other L7 features are reported as unsupported; where upstream tests state expected verdicts,
the engine agrees."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.manifests import Document
from services.policy.engine.analyze import Probe, analyze
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
    peer_rules = [pr for p in policies for r in p.rules for pr in r.peer_rules]
    if meta.get("fqdn"):
        assert any(pr.fqdns for pr in peer_rules), "toFQDNs must become rules on names"
        assert not any(u.split(":")[0].endswith("toFQDNs") for u in unsupported), unsupported
    if _writes_dns_rules(load(name)):
        assert any(pr.dns for pr in peer_rules), "rules.dns must become DNS rules"
    assert not any("rules.dns" in u for u in unsupported), unsupported
    if meta.get("l7") and _writes_other_l7(load(name)):
        assert unsupported, "L7 features other than DNS must be reported"
    if meta.get("l3l4_only") and not any(
        f.startswith(
            ("nodeSelector", "fromNodes", "toServices", "fromCIDRSet.cidrGroupRef", "auth", "ports.protocol:VRRP")
        )
        for f in meta.get("features", [])
    ):
        assert not unsupported, unsupported


_OTHER_L7 = ("serverNames", "terminatingTLS", "originatingTLS", "listener")


def _walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node, *(m for v in node.values() for m in _walk(v))]
    if isinstance(node, list):
        return [m for v in node for m in _walk(v)]
    return []


def _writes_dns_rules(docs: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("rules"), dict) and m["rules"].get("dns") for d in docs for m in _walk(d))


def _writes_other_l7(docs: list[dict[str, Any]]) -> bool:
    """Whether an example has an L7 rule Palisade does not enforce (anything but DNS rules)."""
    for m in (m for d in docs for m in _walk(d)):
        if any(m.get(f) for f in _OTHER_L7):
            return True
        if isinstance(m.get("rules"), dict) and any(v for k, v in m["rules"].items() if k != "dns"):
            return True
    return False


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
