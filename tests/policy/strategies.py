"""Hypothesis strategies shared by the engine property tests: small random clusters.

Two namespaces, three apps, eight pod identities (256-263), a few CIDR
identities, addresses in and out of the CIDRs the policies use, one named
port (``http``), and NetworkPolicy / CNP / CCNP documents mixing pod,
namespace, entity, CIDR and requirement peers, numeric, ranged and named
ports, ICMP, and deny rules.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from services.common.labels import LabelSet, cidr_identity_labels, pod_identity_labels
from services.policy.engine.identity import LOCAL_IDENTITY_FLAG, Identity
from services.policy.engine.model import IpProto

NAMESPACES = ["x", "y"]
APPS = ["a", "b", "c"]
IDS = list(range(256, 264))
CIDR_PREFIXES = ["10.0.0.0/24", "10.0.1.0/24", "10.0.0.0/16", "192.0.2.0/24"]
CIDR_IDS = [LOCAL_IDENTITY_FLAG + 1 + n for n in range(len(CIDR_PREFIXES))]
IPS = [f"10.0.{n}.{h}" for n in (0, 1) for h in (1, 2, 130)] + ["192.0.2.7", "172.16.0.1"]
NAMED_PORTS: list[dict[str, list[tuple[IpProto, int]]]] = [
    {},
    {"http": [(IpProto.TCP, 80)]},
    {"http": [(IpProto.TCP, 8080), (IpProto.UDP, 81)]},
    {"http": [(IpProto.SCTP, 85)], "dns": [(IpProto.UDP, 53)]},
]
#: (port or ICMP type, protocol) probes that hit the ports the policies use.
PROBES = [
    (80, IpProto.TCP),
    (81, IpProto.UDP),
    (85, IpProto.SCTP),
    (85, IpProto.TCP),
    (90, IpProto.UDP),
    (8080, IpProto.TCP),
    (53, IpProto.UDP),
    (443, IpProto.TCP),
    (8, IpProto.ICMP),
    (0, IpProto.ICMP),
]

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
    [None, [{"port": 80}], [{"port": "http"}], [{"port": 80, "endPort": 90, "protocol": "UDP"}], [{"protocol": "SCTP"}]]
)
cnp_ports = st.sampled_from(
    [
        None,
        [{"ports": [{"port": "80", "protocol": "TCP"}]}],
        [{"ports": [{"port": "http"}]}],
        [{"ports": [{"port": "http", "protocol": "UDP"}]}],
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
def knp(draw: Any) -> dict[str, Any]:
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
        "metadata": {"name": "p", "namespace": draw(st.sampled_from(NAMESPACES))},
        "spec": spec,
    }


@st.composite
def cnp_rule(draw: Any, direction: str, allow: bool = True) -> dict[str, Any]:
    p = "from" if direction == "ingress" else "to"
    rule: dict[str, Any] = {}
    names = direction == "egress" and allow
    choice = draw(st.sampled_from(["eps", "ents", "cidr", "none", "requires", *(["fqdn"] if names else [])]))
    if choice == "fqdn":
        rule["toFQDNs"] = [{"matchPattern": draw(st.sampled_from(["*.a.test", "*", "b.test"]))}]
        if draw(st.booleans()):
            rule["toPorts"] = [{"ports": [{"port": "443", "protocol": "TCP"}]}]
        return rule
    if names and choice in ("eps", "requires", "none") and draw(st.integers(0, 3)) == 0:
        # a DNS rule: its servers are the rule's peers (every identity when it has none)
        if choice == "none":
            rule["toPorts"] = [
                {"ports": [{"port": "53", "protocol": "UDP"}], "rules": {"dns": [{"matchName": "c.test"}]}}
            ]
            return rule
        rule[f"{p}Endpoints"] = draw(st.lists(app_sel, min_size=1, max_size=2))
        rule["toPorts"] = [
            {"ports": [{"port": "53", "protocol": "ANY"}], "rules": {"dns": [{"matchPattern": "*.a.test"}]}}
        ]
        return rule
    if choice == "eps":
        rule[f"{p}Endpoints"] = draw(st.lists(app_sel, min_size=1, max_size=2))
    elif choice == "ents":
        rule[f"{p}Entities"] = [draw(st.sampled_from(["world", "cluster", "all", "host"]))]
    elif choice == "cidr":
        rule[f"{p}CIDRSet"] = [
            draw(st.sampled_from([{"cidr": "10.0.0.0/16"}, {"cidr": "10.0.0.0/8", "except": ["10.0.0.0/24"]}]))
        ]
    elif choice == "requires":
        rule[f"{p}Requires"] = [draw(app_sel)]
        rule[f"{p}Endpoints"] = [{}]
    if draw(st.integers(0, 5)) == 0:
        rule["icmps"] = [{"fields": [{"type": draw(st.sampled_from([0, 8]))}]}]
    else:
        ports = draw(cnp_ports)
        if ports:
            rule["toPorts"] = ports
    return rule


@st.composite
def cnp(draw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"endpointSelector": draw(app_sel)}
    for field, direction in (
        ("ingress", "ingress"),
        ("egress", "egress"),
        ("ingressDeny", "ingress"),
        ("egressDeny", "egress"),
    ):
        if draw(st.booleans()):
            spec[field] = draw(st.lists(cnp_rule(direction, not field.endswith("Deny")), min_size=1, max_size=2))
    clusterwide = draw(st.booleans())
    meta: dict[str, Any] = {"name": "p"}
    if not clusterwide:
        meta["namespace"] = draw(st.sampled_from(NAMESPACES))
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy" if clusterwide else "CiliumNetworkPolicy",
        "metadata": meta,
        "spec": spec,
    }


#: A NetworkPolicy, CNP or CCNP document (named ``p``: rename with :func:`named`).
documents = st.one_of(knp(), cnp())


def named(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return {**doc, "metadata": {**doc["metadata"], "name": name}}


def policy_doc(name: str) -> st.SearchStrategy[dict[str, Any]]:
    """A NetworkPolicy, CNP or CCNP document called ``name``."""
    return documents.map(lambda doc: named(doc, name))


def labels_for(ns: str, app: str) -> LabelSet:
    return pod_identity_labels(
        {"metadata": {"namespace": ns, "labels": {"app": app}}}, {"metadata": {"name": ns, "labels": {"ns": ns}}}
    )


#: Labels a pod-range identity may take: a pod in some namespace with some
#: app, or (rarely) CIDR labels, which make it stop being an endpoint.
pod_range_labels = st.one_of(
    st.builds(labels_for, st.sampled_from(NAMESPACES), st.sampled_from(APPS)),
    st.builds(labels_for, st.sampled_from(NAMESPACES), st.sampled_from(APPS)),
    st.builds(labels_for, st.sampled_from(NAMESPACES), st.sampled_from(APPS)),
    st.builds(cidr_identity_labels, st.sampled_from(CIDR_PREFIXES)),
)


def cidr_identity(n: int) -> Identity:
    return Identity(CIDR_IDS[n], cidr_identity_labels(CIDR_PREFIXES[n]))
