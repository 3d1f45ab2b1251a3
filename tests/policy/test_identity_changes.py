"""Identity-side changes update only the entries naming that identity, with allow/deny overlap kept right."""

# Policy documents are inline YAML; long lines keep each one readable.
# ruff: noqa: E501

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from services.common.labels import LabelSet, cidr_identity_labels, pod_identity_labels
from services.policy.engine.identity import Identity
from services.policy.engine.model import Direction, EntryKey, IpProto, Verdict
from services.policy.engine.policyengine import ChangeResult, PolicyEngine

ING, EGR = Direction.INGRESS, Direction.EGRESS
S, T, X = 256, 257, 300  # two subjects in namespace x, and the identity that changes


def pod(ns: str, **labels: str) -> LabelSet:
    return pod_identity_labels({"metadata": {"namespace": ns, "labels": labels}}, None)


def cnp(name: str, spec: str) -> dict[str, Any]:
    text = f"apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\nspec:\n  endpointSelector: {{matchLabels: {{role: s}}}}\n{spec}"
    loaded = yaml.safe_load(text)
    assert isinstance(loaded, dict)
    return loaded


def engine(*specs: str) -> PolicyEngine:
    eng = PolicyEngine()
    eng.upsert_identity(Identity(S, pod("x", role="s")))
    eng.upsert_identity(Identity(T, pod("x", role="s", other="yes")))
    for n, spec in enumerate(specs):
        eng.upsert_policy_document(cnp(f"p{n}", spec))
    return eng


def key(direction: Direction, remote: int = X, proto: IpProto = IpProto.ANY, lo: int = 0, hi: int = 0) -> EntryKey:
    return EntryKey(direction, remote, proto, lo, hi)


def entries(eng: PolicyEngine, subject: int) -> Mapping[EntryKey, Verdict]:
    policy = eng.policy_for(subject)
    assert policy is not None
    return policy.entries


def assert_consistent(eng: PolicyEngine) -> None:
    assert dict(eng.policies()) == eng.compute_all()


def only_remote(result: ChangeResult, remote: int, *, subjects: set[int]) -> None:
    """Every diff is one of ``subjects`` and touches only keys with ``remote``."""
    assert set(result.diffs) == subjects
    for d in result.diffs.values():
        assert {k.identity for k in (*d.added, *d.removed)} == {remote}


@pytest.mark.parametrize("peer", ["fromEntities: [cluster]", "fromEntities: [all]", "fromEndpoints: [{}]"])
def test_broad_peer_add_and_remove_touch_only_that_identity(peer: str) -> None:
    eng = engine(f"  ingress:\n  - {peer}\n    toPorts: [{{ports: [{{port: '80', protocol: TCP}}]}}]\n")
    before = {i: dict(p.entries) for i, p in eng.policies().items()}
    res = eng.upsert_identity(Identity(X, pod("x", app="new")))
    if "all" in peer:  # the wildcard entry already covers X: nothing but X's own (empty) policy
        assert set(res.diffs) == {X}
    else:
        assert res.diffs[S].added == {key(ING, X, IpProto.TCP, 80, 80): Verdict.ALLOW}
        assert not res.diffs[S].removed
        assert set(res.diffs) == {S, T, X}
    assert_consistent(eng)
    res = eng.remove_identity(X)
    assert res.diffs[X].deleted
    assert {i: dict(p.entries) for i, p in eng.policies().items()} == before


def test_entry_stays_while_another_rule_still_makes_it() -> None:
    eng = engine(
        "  ingress:\n  - fromEntities: [cluster]\n",
        "  ingress:\n  - fromEndpoints: [{matchLabels: {app: web}}]\n",
    )
    eng.upsert_identity(Identity(X, pod("x", app="web")))
    assert entries(eng, S)[key(ING)] is Verdict.ALLOW
    res = eng.upsert_identity(Identity(X, pod("x", app="db")))  # leaves app=web, still in cluster
    assert S not in res.diffs and T not in res.diffs
    assert entries(eng, S)[key(ING)] is Verdict.ALLOW
    assert_consistent(eng)


def test_deny_and_allow_on_one_key_follow_the_identity() -> None:
    eng = engine(
        "  ingress:\n  - fromEntities: [cluster]\n",
        "  ingressDeny:\n  - fromEndpoints: [{matchLabels: {app: bad}}]\n",
    )
    res = eng.upsert_identity(Identity(X, pod("x", app="bad")))
    assert res.diffs[S].added == {key(ING): Verdict.DENY}
    res = eng.upsert_identity(Identity(X, pod("x", app="good")))  # deny no longer applies: allow shows through
    only_remote(res, X, subjects={S, T})
    assert res.diffs[S].added == {key(ING): Verdict.ALLOW}
    assert res.diffs[S].removed == {key(ING)}
    res = eng.upsert_identity(Identity(X, pod("y", app="bad")))  # CNP peers are namespaced: y/bad is not denied
    assert not res.diffs
    assert entries(eng, S)[key(ING)] is Verdict.ALLOW
    assert_consistent(eng)


def test_requirements_restrict_only_the_changed_identity() -> None:
    eng = engine(
        "  ingress:\n  - fromEndpoints: [{}]\n",
        "  ingress:\n  - fromRequires: [{matchLabels: {env: prod}}]\n",
    )
    eng.upsert_identity(Identity(X, pod("x", env="prod")))
    eng.upsert_identity(Identity(X + 1, pod("x", env="prod")))
    assert {key(ING), key(ING, X + 1)} <= set(entries(eng, S))
    res = eng.upsert_identity(Identity(X, pod("x", env="dev")))
    only_remote(res, X, subjects={S, T})
    assert res.diffs[S].removed == {key(ING)}
    assert key(ING, X + 1) in entries(eng, S)
    assert_consistent(eng)


def test_subject_relabel_recomputes_its_own_policy() -> None:
    eng = engine("  ingress:\n  - fromEndpoints: [{matchLabels: {app: web}}]\n")
    eng.upsert_identity(Identity(X, pod("x", app="web")))
    res = eng.upsert_identity(Identity(T, pod("x", role="other")))  # T leaves the subject selector
    assert set(res.diffs) == {T}
    assert not res.diffs[T].ingress_enforced and res.diffs[T].removed == {key(ING)}
    res = eng.upsert_identity(Identity(T, pod("x", role="s")))
    assert set(res.diffs) == {T} and res.diffs[T].ingress_enforced
    assert_consistent(eng)


def test_pod_identity_turning_into_cidr_identity() -> None:
    eng = engine("  ingress:\n  - fromEntities: [world]\n  - fromEndpoints: [{}]\n")
    eng.upsert_identity(Identity(X, pod("x", app="web")))
    res = eng.upsert_identity(Identity(X, cidr_identity_labels("192.0.2.0/24")))
    assert res.diffs[X].deleted  # no longer an endpoint: no policy of its own
    assert entries(eng, S)[key(ING)] is Verdict.ALLOW  # now selected as world instead
    assert_consistent(eng)


def test_ipcache_moves_between_identities_touch_only_them() -> None:
    eng = engine("  egress:\n  - toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]\n")
    eng.upsert_identity(Identity(X, pod("x", app="a")))
    eng.upsert_identity(Identity(X + 1, pod("x", app="b")))
    ip = ipaddress.ip_address("10.2.0.1")
    res = eng.upsert_ipcache(ip, X)
    only_remote(res, X, subjects={S, T})
    res = eng.upsert_ipcache(ip, X + 1)  # the address moves: X loses it, X+1 gains it
    assert set(res.diffs) == {S, T}
    assert res.diffs[S].removed == {key(EGR)} and res.diffs[S].added == {key(EGR, X + 1): Verdict.ALLOW}
    res = eng.upsert_ipcache(ipaddress.ip_address("10.1.0.1"), X + 1)  # partly excepted: conservative
    only_remote(res, X + 1, subjects={S, T})
    assert_consistent(eng)


@pytest.mark.parametrize("peer", ["", "    toEndpoints: [{matchLabels: {app: web}}]\n"])
def test_egress_named_ports_follow_the_remote(peer: str) -> None:
    eng = engine(f"  egress:\n  - toPorts: [{{ports: [{{port: http}}]}}]\n{peer}")
    eng.set_named_ports(X, {"http": [(IpProto.TCP, 8080)]})  # ports known before the identity
    res = eng.upsert_identity(Identity(X, pod("x", app="web")))
    assert res.diffs[S].added == {key(EGR, X, IpProto.TCP, 8080, 8080): Verdict.ALLOW}
    res = eng.set_named_ports(X, {"http": [(IpProto.UDP, 53)]})
    assert res.diffs[S].removed == {key(EGR, X, IpProto.TCP, 8080, 8080)}
    assert res.diffs[S].added == {key(EGR, X, IpProto.UDP, 53, 53): Verdict.ALLOW}
    res = eng.remove_identity(X)
    assert res.diffs[S].removed == {key(EGR, X, IpProto.UDP, 53, 53)}
    assert_consistent(eng)


@pytest.mark.parametrize("count", [5, 40])  # 40: more than a subject takes before it is recomputed whole
def test_batch_combines_identity_changes_into_one_diff_per_subject(count: int) -> None:
    eng = engine("  ingress:\n  - fromEntities: [cluster]\n  egress:\n  - toEndpoints: [{matchLabels: {app: web}}]\n")
    eng.begin_batch()
    for n in range(count):
        assert not eng.upsert_identity(Identity(X + n, pod("x", app="web" if n % 2 else "db"))).diffs
    eng.remove_identity(X)
    eng.upsert_identity(Identity(X + 1, pod("x", app="db")))
    res = eng.end_batch()
    assert res.diffs[S].added == {
        **{key(ING, X + n): Verdict.ALLOW for n in range(1, count)},
        **{key(EGR, X + n): Verdict.ALLOW for n in range(3, count, 2)},
    }
    assert not res.diffs[S].removed
    assert_consistent(eng)


@pytest.mark.parametrize(
    ("policies", "identities", "expected_bumps"),
    [
        (1, 0, 1),  # one policy change: one bump, not a second one at end_batch
        (2, 1, 2),  # each policy change bumps; the identity's diff rides on them
        (0, 1, 1),  # identities alone: one bump for the batch's combined diff
        (0, 0, 0),  # an empty batch changes nothing
    ],
)
def test_a_batch_bumps_the_revision_once_per_policy_change_or_once_for_other_changes(
    policies: int, identities: int, expected_bumps: int
) -> None:
    eng = engine()
    before = eng.revision
    eng.begin_batch()
    for n in range(policies):
        eng.upsert_policy_document(cnp(f"b{n}", "  ingress:\n  - fromEndpoints: [{matchLabels: {role: peer}}]\n"))
    for n in range(identities):
        eng.upsert_identity(Identity(X + n, pod("x", role="peer")))
    result = eng.end_batch()
    assert eng.revision == before + expected_bumps
    assert result.revision == eng.revision
    assert_consistent(eng)
