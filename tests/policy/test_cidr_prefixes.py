"""The prefixes the accepted policies name, each of which needs a CIDR identity (pure engine)."""

from __future__ import annotations

from typing import Any

import pytest

from services.policy.engine.parse import parse_policy
from services.policy.engine.selector import cidr_identity_prefixes
from tests.policy_service.world import World


def knp(name: str, *peers: dict[str, Any], egress: bool = True) -> dict[str, Any]:
    direction, field = ("egress", "to") if egress else ("ingress", "from")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"podSelector": {}, direction: [{field: list(peers)}]},
    }


def cnp(name: str, **rule: Any) -> dict[str, Any]:
    direction = "egress" if any(k.startswith("to") for k in rule) else "ingress"
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"endpointSelector": {}, direction: [rule]},
    }


CASES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "ipBlock": (knp("a", {"ipBlock": {"cidr": "198.51.100.0/24"}}), {"198.51.100.0/24"}),
    "ipBlock with excepts": (
        knp("a", {"ipBlock": {"cidr": "198.51.100.0/24", "except": ["198.51.100.11/32", "198.51.100.128/25"]}}),
        {"198.51.100.0/24", "198.51.100.11/32", "198.51.100.128/25"},
    ),
    "ingress ipBlock": (knp("a", {"ipBlock": {"cidr": "192.0.2.7/32"}}, egress=False), {"192.0.2.7/32"}),
    "host bits are canonicalised": (knp("a", {"ipBlock": {"cidr": "198.51.100.77/24"}}), {"198.51.100.0/24"}),
    "toCIDR /32": (cnp("a", toCIDR=["198.51.100.10/32"]), {"198.51.100.10/32"}),
    "a bare address is its host prefix": (cnp("a", toCIDR=["198.51.100.10"]), {"198.51.100.10/32"}),
    "fromCIDR": (cnp("a", fromCIDR=["203.0.113.0/24"]), {"203.0.113.0/24"}),
    "toCIDRSet with except": (
        cnp("a", toCIDRSet=[{"cidr": "198.51.100.0/24", "except": ["198.51.100.11/32"]}]),
        {"198.51.100.0/24", "198.51.100.11/32"},
    ),
    "world needs none, its except does": (
        knp("a", {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}),
        {"10.0.0.0/8"},
    ),
    "IPv6 world needs none": (cnp("a", toCIDR=["::/0"]), set()),
    "IPv6 prefixes": (
        cnp("a", toCIDRSet=[{"cidr": "2001:db8::/32", "except": ["2001:db8::1/128"]}]),
        {"2001:db8::/32", "2001:db8::1/128"},
    ),
    "pod selectors name no prefix": (knp("a", {"podSelector": {"matchLabels": {"app": "web"}}}), set()),
    "entities name no prefix": (cnp("a", toEntities=["world"]), set()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_prefixes_a_policy_names(case: str) -> None:
    doc, want = CASES[case]
    assert cidr_identity_prefixes(parse_policy(doc).referenced_selectors()) == want


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_core_reports_the_prefixes_of_accepted_policies_until_deleted(case: str) -> None:
    doc, want = CASES[case]
    world = World()
    world.sync()
    outcome = world.policy(doc)
    assert outcome is not None and outcome.accepted
    world.commit()
    assert world.core.cidr_prefixes() == want
    world.delete_policy(doc)
    world.commit()
    assert world.core.cidr_prefixes() == frozenset()


def test_prefixes_are_the_union_over_policies_and_shared_ones_stay_while_one_names_them() -> None:
    world = World()
    world.sync()
    a = cnp("a", toCIDR=["198.51.100.10/32"])
    b = cnp("b", toCIDRSet=[{"cidr": "198.51.100.0/24", "except": ["198.51.100.10/32"]}])
    world.policy(a)
    world.policy(b)
    world.commit()
    assert world.core.cidr_prefixes() == {"198.51.100.10/32", "198.51.100.0/24"}
    world.delete_policy(a)
    world.commit()
    assert world.core.cidr_prefixes() == {"198.51.100.10/32", "198.51.100.0/24"}, "b's except names it too"
    world.delete_policy(b)
    world.commit()
    assert world.core.cidr_prefixes() == frozenset()


def test_a_rejected_policy_names_nothing_and_an_invalid_edit_keeps_the_valid_version() -> None:
    world = World()
    world.sync()
    bad = cnp("a", toCIDR=["198.51.100.10/32"], toPortz=[])
    outcome = world.import_policy(bad)
    assert not outcome.accepted
    world.commit()
    assert world.core.cidr_prefixes() == frozenset()
    good = cnp("a", toCIDR=["198.51.100.10/32"])
    assert world.import_policy(good).accepted
    world.commit()
    assert world.core.cidr_prefixes() == {"198.51.100.10/32"}
    assert not world.import_policy(bad).accepted
    world.commit()
    assert world.core.cidr_prefixes() == {"198.51.100.10/32"}, "the last valid version stays enforced"


def test_an_audited_policy_names_its_prefixes_too() -> None:
    world = World()
    world.sync()
    doc = cnp("a", toCIDR=["198.51.100.10/32"])
    doc["metadata"]["annotations"] = {"policy.palisade.io/mode": "audit"}
    assert world.import_policy(doc).accepted
    world.commit()
    assert world.core.audited_policies(), "the annotation puts it in audit mode"
    assert world.core.engine.cidr_identity_prefixes() == frozenset(), "the enforcing engine does not see it"
    assert world.core.cidr_prefixes() == {"198.51.100.10/32"}
