"""Property: applying the engine's diffs always equals a full recomputation."""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.labels import pod_identity_labels
from services.policy.engine import PolicyEngine, apply_diff
from services.policy.identity import Identity
from services.policy.model import Protocol
from services.policy.resolve import ResolvedPolicy

NAMESPACES = ["x", "y"]
APPS = ["a", "b", "c"]
IDS = list(range(256, 264))
IPS = [f"10.0.{n}.{h}" for n in (0, 1) for h in (1, 2, 130)]

app_sel = st.sampled_from(
    [
        {},
        {"matchLabels": {"app": "a"}},
        {"matchLabels": {"app": "b"}},
        {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["c"]}]},
    ]
)
ns_sel = st.sampled_from([{}, {"matchLabels": {"ns": "x"}}, {"matchLabels": {"kubernetes.io/metadata.name": "y"}}])
knp_ports = st.sampled_from(
    [None, [{"port": 80}], [{"port": "http"}], [{"port": 80, "endPort": 90, "protocol": "UDP"}]]
)
cnp_ports = st.sampled_from(
    [
        None,
        [{"ports": [{"port": "80", "protocol": "TCP"}]}],
        [{"ports": [{"port": "http"}]}],
        [{"ports": [{"port": "80", "endPort": 85}]}],
    ]
)


@st.composite
def knp_peer(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["pod", "ns", "both", "ip"]))
    if kind == "pod":
        return {"podSelector": draw(app_sel)}
    if kind == "ns":
        return {"namespaceSelector": draw(ns_sel)}
    if kind == "both":
        return {"podSelector": draw(app_sel), "namespaceSelector": draw(ns_sel)}
    return {
        "ipBlock": draw(
            st.sampled_from(
                [{"cidr": "10.0.0.0/16"}, {"cidr": "10.0.0.0/16", "except": ["10.0.1.0/24"]}, {"cidr": "10.0.0.0/25"}]
            )
        )
    }


@st.composite
def knp(draw: Any, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"podSelector": draw(app_sel)}
    for field, peer_key in (("ingress", "from"), ("egress", "to")):
        if draw(st.booleans()):
            rules = []
            for _ in range(draw(st.integers(0, 2))):
                rule: dict[str, Any] = {}
                peers = draw(st.lists(knp_peer(), max_size=2))
                if peers:
                    rule[peer_key] = peers
                ports = draw(knp_ports)
                if ports:
                    rule["ports"] = ports
                rules.append(rule)
            spec[field] = rules
    if draw(st.booleans()):
        spec["policyTypes"] = draw(st.sampled_from([["Ingress"], ["Egress"], ["Ingress", "Egress"]]))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": draw(st.sampled_from(NAMESPACES))},
        "spec": spec,
    }


@st.composite
def cnp_rule(draw: Any, direction: str) -> dict[str, Any]:
    p = "from" if direction == "ingress" else "to"
    rule: dict[str, Any] = {}
    choice = draw(st.sampled_from(["eps", "ents", "cidr", "none", "requires"]))
    if choice == "eps":
        rule[f"{p}Endpoints"] = [draw(app_sel)]
    elif choice == "ents":
        rule[f"{p}Entities"] = [draw(st.sampled_from(["world", "cluster", "all", "host"]))]
    elif choice == "cidr":
        rule[f"{p}CIDRSet"] = [
            draw(st.sampled_from([{"cidr": "10.0.0.0/16"}, {"cidr": "10.0.0.0/8", "except": ["10.0.0.0/24"]}]))
        ]
    elif choice == "requires":
        rule[f"{p}Requires"] = [draw(app_sel)]
        rule[f"{p}Endpoints"] = [{}]
    ports = draw(cnp_ports)
    if ports:
        rule["toPorts"] = ports
    return rule


@st.composite
def cnp(draw: Any, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"endpointSelector": draw(app_sel)}
    for field, direction in (
        ("ingress", "ingress"),
        ("egress", "egress"),
        ("ingressDeny", "ingress"),
        ("egressDeny", "egress"),
    ):
        if draw(st.integers(0, 3)) == 0:
            spec[field] = draw(st.lists(cnp_rule(direction), min_size=1, max_size=2))
    clusterwide = draw(st.booleans())
    meta: dict[str, Any] = {"name": name}
    if not clusterwide:
        meta["namespace"] = draw(st.sampled_from(NAMESPACES))
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy" if clusterwide else "CiliumNetworkPolicy",
        "metadata": meta,
        "spec": spec,
    }


def labels_for(ns: str, app: str) -> Any:
    return pod_identity_labels(
        {"metadata": {"namespace": ns, "labels": {"app": app}}}, {"metadata": {"name": ns, "labels": {"ns": ns}}}
    )


op = st.one_of(
    st.tuples(st.just("policy"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("delete"), st.integers(0, 3)),
    st.tuples(st.just("identity"), st.sampled_from(IDS), st.sampled_from(NAMESPACES), st.sampled_from(APPS)),
    st.tuples(st.just("remove"), st.sampled_from(IDS)),
    st.tuples(st.just("ips"), st.sampled_from(IDS), st.lists(st.sampled_from(IPS), max_size=2)),
    st.tuples(
        st.just("ports"),
        st.sampled_from(IDS),
        st.sampled_from([{}, {"http": [(Protocol.TCP, 80)]}, {"http": [(Protocol.TCP, 8080), (Protocol.UDP, 81)]}]),
    ),
)


def snapshot(policies: dict[int, ResolvedPolicy]) -> dict[int, tuple[bool, bool, dict[Any, Any]]]:
    return {i: (p.ingress_enforced, p.egress_enforced, dict(p.entries)) for i, p in policies.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=14), data=st.data())
def test_incremental_equals_full(ops: list[Any], data: Any) -> None:
    eng = PolicyEngine()
    mirror: dict[int, ResolvedPolicy] = dict(eng.policies())
    docs: dict[int, dict[str, Any]] = {}
    identities: dict[int, Identity] = {}
    ips: dict[int, list[str]] = {}
    ports: dict[int, dict[str, list[tuple[Protocol, int]]]] = {}
    last_revision = eng.revision
    for o in ops:
        if o[0] == "policy":
            doc = data.draw(cnp(f"p{o[1]}") if o[2] else knp(f"p{o[1]}"))
            old = docs.get(o[1])
            if old is not None and (old["kind"], old["metadata"].get("namespace")) != (
                doc["kind"],
                doc["metadata"].get("namespace"),
            ):
                res = eng.delete_policy(eng_key(old))
                for d in res.diffs.values():
                    apply_diff(mirror, d)
            docs[o[1]] = doc
            res = eng.upsert_policy_document(doc)
            assert res.revision > last_revision
        elif o[0] == "delete":
            old = docs.pop(o[1], None)
            if old is None:
                continue
            res = eng.delete_policy(eng_key(old))
        elif o[0] == "identity":
            ident = Identity(o[1], labels_for(o[2], o[3]))
            identities[o[1]] = ident
            res = eng.upsert_identity(ident)
        elif o[0] == "remove":
            identities.pop(o[1], None)
            res = eng.remove_identity(o[1])
        elif o[0] == "ips":
            ips[o[1]] = o[2]
            res = eng.set_identity_ips(o[1], [ipaddress.ip_address(x) for x in o[2]])
        else:
            ports[o[1]] = o[2]
            res = eng.set_named_ports(o[1], o[2])
        assert res.revision >= last_revision
        last_revision = res.revision
        for d in res.diffs.values():
            apply_diff(mirror, d)
        assert snapshot(mirror) == snapshot(eng.compute_all()) == snapshot(dict(eng.policies()))

    # A fresh engine fed the final state agrees too (checks the selector cache).
    fresh = PolicyEngine()
    for ident in identities.values():
        fresh.upsert_identity(ident)
    for i, addrs in ips.items():
        fresh.set_identity_ips(i, [ipaddress.ip_address(x) for x in addrs])
    for i, named in ports.items():
        fresh.set_named_ports(i, named)
    for doc in docs.values():
        fresh.upsert_policy_document(doc)
    assert snapshot(dict(fresh.policies())) == snapshot(mirror)


def eng_key(doc: dict[str, Any]) -> Any:
    from services.policy.parse import parse_policy

    return parse_policy(doc).key
