"""Property: the trace, which evaluates rules directly, agrees with the lookup over computed entries.

For random policies, identities (pods, CIDR identities, reserved ones), IPs
and named ports, every (source, destination, probe) gets the same verdict and
the same kind of reason from :func:`trace` as from :func:`lookup` over the
engine's incrementally computed policies, in both directions.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.policy.engine.identity import Identity
from services.policy.engine.model import Direction
from services.policy.engine.policyengine import PolicyEngine
from services.policy.engine.resolve import lookup
from services.policy.engine.trace import trace
from tests.policy.strategies import (
    CIDR_PREFIXES,
    IDS,
    IPS,
    NAMED_PORTS,
    PROBES,
    cidr_identity,
    documents,
    named,
    pod_range_labels,
)

#: trace reason -> lookup reason
REASONS = {
    "deny-rule": "deny-entry",
    "allow-rule": "allow-entry",
    "default-deny": "default-deny",
    "default-allow": "default-allow",
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    docs=st.lists(documents, min_size=1, max_size=5),
    idents=st.dictionaries(st.sampled_from(IDS), pod_range_labels, min_size=1, max_size=5),
    cidrs=st.sets(st.integers(0, len(CIDR_PREFIXES) - 1)),
    addresses=st.dictionaries(st.sampled_from(IDS), st.lists(st.sampled_from(IPS), max_size=2)),
    ports=st.dictionaries(st.sampled_from(IDS), st.sampled_from(NAMED_PORTS)),
    policies_first=st.booleans(),
    probes=st.lists(st.sampled_from(PROBES), min_size=5, max_size=7, unique=True),
)
def test_trace_agrees_with_lookup(
    docs: list[dict[str, Any]],
    idents: dict[int, Any],
    cidrs: set[int],
    addresses: dict[int, list[str]],
    ports: dict[int, Any],
    policies_first: bool,
    probes: list[tuple[int, Any]],
) -> None:
    eng = PolicyEngine()

    def load_policies() -> None:
        for n, doc in enumerate(docs):
            eng.upsert_policy_document(named(doc, f"p{n}"))

    if policies_first:
        load_policies()
    for i, labels in idents.items():
        eng.upsert_identity(Identity(i, labels))
    for n in cidrs:
        eng.upsert_identity(cidr_identity(n))
    for i, ips in addresses.items():
        for ip in ips:
            eng.upsert_ipcache(ipaddress.ip_address(ip), i)
    for i, named_ports in ports.items():
        eng.set_named_ports(i, named_ports)
    if not policies_first:
        load_policies()

    # Pods and CIDR identities, plus host, world and health for the reserved ones.
    chosen = [i for i in sorted(eng.identities()) if i in (1, 2, 4) or i >= min(IDS)]
    for src in chosen:
        for dst in chosen:
            for port, protocol in probes:
                t = trace(eng, src=src, dst=dst, port=port, protocol=protocol)
                out = lookup(eng.policy_for(src), Direction.EGRESS, dst, protocol, port)
                inn = lookup(eng.policy_for(dst), Direction.INGRESS, src, protocol, port)
                where = f"{src} -> {dst} {port}/{protocol.name}"
                assert (t.egress.allowed, REASONS[t.egress.reason]) == (out.allowed, out.reason), where
                assert (t.ingress.allowed, REASONS[t.ingress.reason]) == (inn.allowed, inn.reason), where
                assert t.allowed == (out.allowed and inn.allowed)
