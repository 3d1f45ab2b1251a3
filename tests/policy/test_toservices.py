"""``toServices``: a rule naming Services allows (or denies) their backends, and follows the Services."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from services.common.manifests import Document
from services.policy.engine.analyze import Probe, build_model, connectivity
from services.policy.engine.model import Direction, PolicyValidationError, ServiceRef
from services.policy.engine.parse import parse_policy

PODS = """\
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: x, labels: {app: client}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: x, labels: {app: web}}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: x, labels: {app: db}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: y, labels: {app: web}}
---
apiVersion: v1
kind: Pod
metadata: {name: ext, namespace: z, labels: {app: ext}}
status: {podIP: 192.0.2.7}
"""
SERVICES = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: x, labels: {tier: front}}
spec: {selector: {app: web}, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: x, labels: {tier: data}}
spec: {selector: {app: db}, ports: [{port: 5432}]}
---
apiVersion: v1
kind: Service
metadata: {name: outside, namespace: x}
spec: {ports: [{port: 443}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: outside-1, namespace: x, labels: {kubernetes.io/service-name: outside}}
addressType: IPv4
endpoints: [{addresses: [192.0.2.7]}]
"""


def policy(egress: str, kind: str = "CiliumNetworkPolicy", namespace: str = "x") -> str:
    meta = f"{{name: p, namespace: {namespace}}}" if kind == "CiliumNetworkPolicy" else "{name: p}"
    return (
        f"apiVersion: cilium.io/v2\nkind: {kind}\nmetadata: {meta}\nspec:\n"
        f"  endpointSelector: {{matchLabels: {{app: client}}}}\n  egress:\n{egress}"
    )


def reachable(*texts: str, port: int = 8080) -> set[str]:
    docs = [Document(f"doc{i}", d) for i, text in enumerate(texts) for d in yaml.safe_load_all(text) if d]
    matrix = connectivity(build_model(docs), Probe.parse(f"{port}/TCP"))
    return {dst for dst, ok in matrix["x/client"].items() if ok and dst != "x/client"}


def test_k8s_service_allows_exactly_its_backends_on_the_backend_port() -> None:
    rule = "  - toServices: [{k8sService: {serviceName: web}}]\n    toPorts: [{ports: [{port: '8080'}]}]\n"
    assert reachable(PODS, SERVICES, policy(rule)) == {"x/web"}  # not y/web: same labels, other namespace
    assert reachable(PODS, SERVICES, policy(rule), port=80) == set()  # the frontend port is not the backend's


def test_without_the_service_the_rule_selects_nothing_and_it_follows_the_service() -> None:
    rule = "  - toServices: [{k8sService: {serviceName: web, namespace: x}}]\n"
    assert reachable(PODS, policy(rule)) == set()
    assert reachable(PODS, SERVICES, policy(rule)) == {"x/web"}


def test_service_selector_matches_services_by_label_and_clusterwide_means_every_namespace() -> None:
    rule = "  - toServices: [{k8sServiceSelector: {selector: {matchLabels: {tier: data}}}}]\n"
    assert reachable(PODS, SERVICES, policy(rule)) == {"x/db"}
    everywhere = "  - toServices: [{k8sServiceSelector: {selector: {}}}]\n"
    got = reachable(PODS, SERVICES, policy(everywhere, kind="CiliumClusterwideNetworkPolicy"))
    assert got == {"x/web", "x/db", "z/ext"}


def test_a_service_without_selector_stands_for_its_endpoint_addresses() -> None:
    rule = "  - toServices: [{k8sService: {serviceName: outside}}]\n"
    assert reachable(PODS, SERVICES, policy(rule)) == {"z/ext"}


def test_egress_deny_to_a_service() -> None:
    rules = "  - toEntities: [all]\n"
    deny = "  egressDeny:\n  - toServices: [{k8sService: {serviceName: db}}]\n"
    assert reachable(PODS, SERVICES, policy(rules) + deny) == {"x/web", "y/web", "z/ext"}


def test_engine_follows_service_changes_incrementally() -> None:
    docs = [Document(f"d{i}", d) for i, d in enumerate(yaml.safe_load_all(PODS + "---\n" + SERVICES)) if d]
    rule = "  - toServices: [{k8sService: {serviceName: web}}]\n"
    docs.append(Document("p", yaml.safe_load(policy(rule))))
    model = build_model(docs)
    engine, client = model.engine, model.pods["x/client"].identity
    web, db = model.pods["x/web"].identity, model.pods["x/db"].identity

    def remotes() -> set[int]:
        resolved = engine.policy_for(client)
        assert resolved is not None
        return {k.identity for k in resolved.entries if k.direction is Direction.EGRESS}

    assert remotes() == {web}
    result = engine.set_service("x", "web", {"metadata": {"name": "web"}, "spec": {"selector": {"app": "db"}}})
    assert remotes() == {db} and client in result.diffs
    engine.set_service("x", "web", None)
    assert remotes() == set()
    unchanged = engine.set_service("x", "other", {"metadata": {"name": "other"}, "spec": {"selector": {"app": "web"}}})
    assert not unchanged.diffs


def test_parse_keeps_the_references_and_reports_nothing_unsupported() -> None:
    def parsed(egress: str, kind: str = "CiliumNetworkPolicy") -> Any:
        return parse_policy(yaml.safe_load(policy(egress, kind=kind)))

    p = parsed("  - toServices: [{k8sService: {serviceName: web}}, {}]\n")
    assert not p.unsupported
    assert p.rules[0].peer_rules[0].services == (ServiceRef("x", name="web"),)
    assert p.rules[0].peer_rules[0].peers == ()  # nothing selected until the engine expands it
    ccnp = parsed("  - toServices: [{k8sService: {serviceName: web}}]\n", kind="CiliumClusterwideNetworkPolicy")
    assert ccnp.rules[0].peer_rules[0].services == (ServiceRef(None, name="web"),)
    with pytest.raises(PolicyValidationError, match="serviceName"):
        parsed("  - toServices: [{k8sService: {namespace: x}}]\n")
    with pytest.raises(PolicyValidationError, match="not both"):
        parsed("  - toServices: [{k8sService: {serviceName: a}, k8sServiceSelector: {selector: {}}}]\n")


def test_only_slices_of_services_without_selector_can_change_a_policy() -> None:
    docs = [Document(f"d{i}", d) for i, d in enumerate(yaml.safe_load_all(PODS + "---\n" + SERVICES)) if d]
    rule = "  - toServices: [{k8sService: {serviceName: outside}}, {k8sService: {serviceName: web}}]\n"
    docs.append(Document("p", yaml.safe_load(policy(rule))))
    engine = build_model(docs).engine
    registry = engine.services

    def sl(service: str, ip: str) -> dict[str, Any]:
        return {
            "metadata": {"name": f"{service}-2", "labels": {"kubernetes.io/service-name": service}},
            "endpoints": [{"addresses": [ip]}],
        }

    # web selects its pods: its slices are not what the policy means.
    assert not registry.slice_matters("x", "web-2", sl("web", "192.0.2.8"))
    revision = engine.revision
    assert not engine.set_endpoint_slice("x", "web-2", sl("web", "192.0.2.8")).diffs
    assert engine.revision == revision
    # outside has no selector: a new slice adds an address, and deleting it takes it away.
    assert registry.slice_matters("x", "outside-2", sl("outside", "192.0.2.9"))
    assert engine.set_endpoint_slice("x", "outside-2", sl("outside", "192.0.2.9")).revision > revision
    assert registry.slice_matters("x", "outside-2", None)
    assert not registry.slice_matters("x", "unknown-1", sl("nothing", "192.0.2.10"))
