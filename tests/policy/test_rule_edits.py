"""A rule edited in place is applied by remote, and subjects with one rule set share one resolve.

A cluster-wide rule selecting every pod, edited (a new port), must not resolve every
identity's whole policy again: each subject whose rule set is the same rules gets only the
entries of the remotes the old and new rule name recomputed (here the wildcard), and
subjects that must be resolved whole share one resolve per distinct rule set. The
property test in ``test_incremental`` checks that the results always equal a full
recomputation; these check that the cheap paths are the ones taken, and the cases where
they must not be.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.common.labels import LabelSet, pod_identity_labels
from services.policy.engine import policyengine
from services.policy.engine.identity import Identity
from services.policy.engine.model import Direction, EntryKey, IpProto, Verdict
from services.policy.engine.policyengine import PolicyEngine, apply_diff
from services.policy.engine.resolve import ResolvedPolicy, resolve_subject

ING = Direction.INGRESS


def labels(ns: str, app: str) -> LabelSet:
    return pod_identity_labels({"metadata": {"namespace": ns, "labels": {"app": app}}}, None)


def clusterwide(port: int, *, peer: dict[str, Any] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"toPorts": [{"ports": [{"port": str(port), "protocol": "TCP"}]}]}
    if peer is not None:
        rule["fromEndpoints"] = [peer]
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": "everyone"},
        "spec": {"endpointSelector": {}, "ingress": [rule]},
    }


def namespaced(ns: str, app: str, peer_app: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"allow-{app}", "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"app": app}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": peer_app}}}], "ports": [{"port": port}]}],
        },
    }


@pytest.fixture
def cluster() -> PolicyEngine:
    """Pods of apps a..d in namespaces n0..n2 (identities 256..267), one namespaced policy in n0."""
    eng = PolicyEngine()
    number = 256
    for ns in ("n0", "n1", "n2"):
        for app in "abcd":
            eng.upsert_identity(Identity(number, labels(ns, app)))
            number += 1
    eng.upsert_policy_document(namespaced("n0", "a", "b", 8080))
    eng.upsert_policy_document(clusterwide(20000))
    return eng


@pytest.fixture
def resolves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The subjects the engine resolves whole, in order."""
    seen: list[int] = []

    def counting(subject: int, *args: Any, **kwargs: Any) -> ResolvedPolicy:
        seen.append(subject)
        return resolve_subject(subject, *args, **kwargs)

    monkeypatch.setattr(policyengine, "resolve_subject", counting)
    return seen


def wildcard(port: int) -> EntryKey:
    return EntryKey(ING, 0, IpProto.TCP, port, port)


def test_edited_clusterwide_rule_changes_only_its_entries_and_resolves_nobody(
    cluster: PolicyEngine, resolves: list[int]
) -> None:
    before = dict(cluster.policies())
    result = cluster.upsert_policy_document(clusterwide(20001))
    assert resolves == []
    # Every endpoint identity (the pods, and the reserved health and init ones) is selected.
    assert sorted(result.diffs) == sorted(before) and set(range(256, 268)) <= set(before)
    for d in result.diffs.values():
        assert dict(d.added) == {wildcard(20001): Verdict.ALLOW}
        assert set(d.removed) == {wildcard(20000)}
    mirror = dict(before)
    for d in result.diffs.values():
        apply_diff(mirror, d)
    assert mirror == cluster.compute_all() == dict(cluster.policies())
    # n0/a keeps its own rule's entries (remote n0/b, port 8080) beside the new wildcard.
    assert cluster.policy_for(256) is not None
    assert EntryKey(ING, 257, IpProto.TCP, 8080, 8080) in cluster.policy_for(256).entries  # type: ignore[union-attr]


def test_edit_that_changes_a_subjects_rule_set_resolves_it_whole(cluster: PolicyEngine, resolves: list[int]) -> None:
    narrowed = clusterwide(20001)
    narrowed["spec"]["endpointSelector"] = {"matchLabels": {"app": "a"}}
    result = cluster.upsert_policy_document(narrowed)
    # Subjects that are not app a lose the rule: their rule set changed to none at all, resolved
    # whole once for all of them; app a pods keep their rule sets and take the edit path.
    assert len(resolves) == 1
    assert cluster.compute_all() == dict(cluster.policies())
    for i in (257, 258, 259):
        assert set(result.diffs[i].removed) == {wildcard(20000)}
        assert not cluster.policies()[i].ingress_enforced


def test_subjects_with_one_rule_set_share_one_resolve(resolves: list[int]) -> None:
    eng = PolicyEngine()
    for number in range(256, 266):
        eng.upsert_identity(Identity(number, labels("n0", "a" if number < 258 else "z")))
    eng.upsert_policy_document(namespaced("n0", "a", "z", 8080))
    resolves.clear()
    result = eng.upsert_policy_document(
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumClusterwideNetworkPolicy",
            "metadata": {"name": "new"},
            "spec": {"endpointSelector": {}, "egress": [{"toPorts": [{"ports": [{"port": "53", "protocol": "UDP"}]}]}]},
        }
    )
    # A new policy changes every subject's rule set: two distinct rule sets, two resolves (the
    # reserved endpoint identities, health and init, share the pods' without the namespaced rule).
    assert len(resolves) == 2
    assert set(result.diffs) == set(eng.policies()) and set(range(256, 266)) <= set(result.diffs)
    assert eng.compute_all() == dict(eng.policies())
    # The shared policy is every subject's own, under its own identity.
    assert [eng.policies()[i].identity for i in range(256, 266)] == list(range(256, 266))
    assert all(result.diffs[i].identity == i for i in result.diffs)


def test_edit_in_a_batch_with_an_identity_change_recomputes_both(cluster: PolicyEngine) -> None:
    """A subject with an edited rule and a remote that changed in the same batch: the remote's
    entries are recomputed too, not only the edited rule's."""
    eng = cluster
    mirror = dict(eng.policies())
    eng.begin_batch()
    # n1/c (identity 262) becomes app b of n0: now a peer of n0/a's namespaced rule (port 8080).
    eng.upsert_identity(Identity(262, labels("n0", "b")))
    eng.upsert_policy_document(clusterwide(20001))
    result = eng.end_batch()
    for d in result.diffs.values():
        apply_diff(mirror, d)
    assert mirror == eng.compute_all() == dict(eng.policies())
    assert EntryKey(ING, 262, IpProto.TCP, 8080, 8080) in eng.policies()[256].entries


def test_edit_of_a_rule_naming_peers_recomputes_old_and_new_peers(cluster: PolicyEngine, resolves: list[int]) -> None:
    eng = cluster
    eng.upsert_policy_document(clusterwide(20000, peer={"matchLabels": {"app": "c"}}))
    mirror = dict(eng.policies())
    resolves.clear()
    result = eng.upsert_policy_document(clusterwide(20000, peer={"matchLabels": {"app": "d"}}))
    assert resolves == []
    for d in result.diffs.values():
        apply_diff(mirror, d)
    assert mirror == eng.compute_all() == dict(eng.policies())
    entries = eng.policies()[260].entries  # n1/a
    assert EntryKey(ING, 259, IpProto.TCP, 20000, 20000) in entries  # n0/d
    assert EntryKey(ING, 258, IpProto.TCP, 20000, 20000) not in entries  # n0/c


def test_named_port_edits_take_the_whole_path(cluster: PolicyEngine, resolves: list[int]) -> None:
    eng = cluster
    eng.set_named_ports(257, {"http": [(IpProto.TCP, 8081)]})
    named = clusterwide(20000)
    named["spec"]["ingress"][0]["toPorts"][0]["ports"] = [{"port": "http", "protocol": "TCP"}]
    resolves.clear()
    eng.upsert_policy_document(named)
    assert resolves  # a named port resolves against each subject's own ports: no edit by remote
    assert eng.compute_all() == dict(eng.policies())
    assert EntryKey(ING, 0, IpProto.TCP, 8081, 8081) in eng.policies()[257].entries
