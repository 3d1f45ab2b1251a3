"""Properties of incremental computation.

* Applying the engine's diffs always equals a full recomputation, over random
  sequences of policy, identity (add, remove, relabel, endpoint <-> CIDR),
  ipcache, named-port and batch operations.
* An identity-side change of X touches, in every other subject, only entries
  whose remote identity is X.
* Policies handed out earlier are never modified afterwards.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.policy.engine.identity import Identity
from services.policy.engine.model import EntryKey, NameRules, Verdict
from services.policy.engine.parse import parse_policy
from services.policy.engine.policyengine import PolicyDiff, PolicyEngine, apply_diff
from services.policy.engine.resolve import ResolvedPolicy
from tests.policy.strategies import (
    CIDR_PREFIXES,
    IDS,
    IPS,
    NAMED_PORTS,
    cidr_identity,
    cnp,
    knp,
    pod_range_labels,
    policy_doc,
)

ids = st.sampled_from(IDS)
ips = st.sampled_from(IPS)

# Identity-side operations are listed several times so that they dominate.
op = st.one_of(
    st.tuples(st.just("policy"), st.integers(0, 3)),
    st.tuples(st.just("policy"), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.integers(0, 3)),
    st.tuples(st.just("identity"), ids, pod_range_labels),
    st.tuples(st.just("identity"), ids, pod_range_labels),
    st.tuples(st.just("identity"), ids, pod_range_labels),
    st.tuples(st.just("cidr"), st.integers(0, len(CIDR_PREFIXES) - 1)),
    st.tuples(st.just("remove"), ids),
    st.tuples(st.just("remove"), ids),
    st.tuples(st.just("ips"), ids, st.lists(ips, max_size=2)),
    st.tuples(st.just("ipcache"), ips, ids),
    st.tuples(st.just("ipcache"), ips, ids),
    st.tuples(st.just("ipcache-delete"), ips),
    st.tuples(st.just("ports"), ids, st.sampled_from(NAMED_PORTS)),
    st.tuples(st.just("ports"), ids, st.sampled_from(NAMED_PORTS)),
    st.tuples(st.just("batch")),
)

Snapshot = dict[int, tuple[bool, bool, dict[EntryKey, Verdict], NameRules]]


def snapshot(policies: dict[int, ResolvedPolicy]) -> Snapshot:
    return {i: (p.ingress_enforced, p.egress_enforced, dict(p.entries), p.names) for i, p in policies.items()}


def assert_local(diffs: dict[int, PolicyDiff], touched: set[int], before: Snapshot) -> None:
    """Other subjects change only in entries whose remote identity was touched."""
    for i, d in diffs.items():
        if i in touched:
            continue
        assert not d.deleted and i in before
        assert (d.ingress_enforced, d.egress_enforced) == before[i][:2]
        assert {k.identity for k in (*d.added, *d.removed)} <= touched, (i, d)


def assert_minimal(d: PolicyDiff, before: Snapshot) -> None:
    """A diff names only real changes."""
    old = before.get(d.identity)
    if d.deleted:
        assert old is not None
        return
    entries = old[2] if old is not None else {}
    assert all(k in entries for k in d.removed)
    assert all(entries.get(k) is not v for k, v in d.added.items())
    assert d.names is None or old is None or d.names != old[3]
    assert (
        d.added or d.removed or old is None or (d.ingress_enforced, d.egress_enforced) != old[:2] or d.names is not None
    )


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    start=st.dictionaries(ids, pod_range_labels, min_size=2),
    start_policies=st.integers(1, 4),
    start_ports=st.dictionaries(ids, st.sampled_from(NAMED_PORTS)),
    start_batched=st.booleans(),
    ops=st.lists(op, min_size=1, max_size=20),
    data=st.data(),
)
def test_incremental_equals_full(
    start: dict[int, Any],
    start_policies: int,
    start_ports: dict[int, Any],
    start_batched: bool,
    ops: list[Any],
    data: Any,
) -> None:
    eng = PolicyEngine()
    docs: dict[int, dict[str, Any]] = {}
    identities: dict[int, Identity] = {}
    ports: dict[int, dict[str, Any]] = {}
    # A populated cluster first, so that most operations change existing subjects.
    if start_batched:
        eng.begin_batch()
    for n in range(start_policies):
        docs[n] = data.draw(policy_doc(f"p{n}"))
        eng.upsert_policy_document(docs[n])
    for i, named in start_ports.items():
        ports[i] = named
        eng.set_named_ports(i, named)
    for i, labels in start.items():
        identities[i] = Identity(i, labels)
        eng.upsert_identity(identities[i])
    if start_batched:
        eng.end_batch()
    mirror: dict[int, ResolvedPolicy] = dict(eng.policies())
    assert snapshot(mirror) == snapshot(eng.compute_all())
    last_revision = eng.revision
    batching = False
    for o in ops:
        handed_out = {i: (p, dict(p.entries)) for i, p in eng.policies().items()}
        before = snapshot(dict(eng.policies()))
        touched: set[int] | None = None
        results = []
        if o[0] == "policy":
            doc = data.draw(policy_doc(f"p{o[1]}"))
            old = docs.get(o[1])
            if old is not None and parse_policy(old).key != parse_policy(doc).key:
                results.append(eng.delete_policy(parse_policy(old).key))
            docs[o[1]] = doc
            results.append(eng.upsert_policy_document(doc))
            assert results[-1].revision > last_revision
        elif o[0] == "delete":
            old = docs.pop(o[1], None)
            if old is None:
                continue
            results.append(eng.delete_policy(parse_policy(old).key))
        elif o[0] in ("identity", "cidr"):
            ident = Identity(o[1], o[2]) if o[0] == "identity" else cidr_identity(o[1])
            identities[ident.id] = ident
            touched = {ident.id}
            results.append(eng.upsert_identity(ident))
        elif o[0] == "remove":
            identities.pop(o[1], None)
            touched = {o[1]}
            results.append(eng.remove_identity(o[1]))
        elif o[0] == "ips":
            touched = {o[1]}
            results.append(eng.set_identity_ips(o[1], [ipaddress.ip_address(x) for x in o[2]]))
        elif o[0] == "ipcache":
            ip = ipaddress.ip_address(o[1])
            # Every identity holding the address (the low-level "ips" op can give it to several).
            touched = {o[2]} | {i for i in IDS if ip in eng.ips_of(i)}
            results.append(eng.upsert_ipcache(ip, o[2]))
        elif o[0] == "ipcache-delete":
            ip = ipaddress.ip_address(o[1])
            touched = {i for i in IDS if ip in eng.ips_of(i)}
            results.append(eng.delete_ipcache(ip))
        elif o[0] == "ports":
            ports[o[1]] = o[2]
            touched = {o[1]}
            results.append(eng.set_named_ports(o[1], o[2]))
        elif batching:
            batching = False
            results.append(eng.end_batch())
        else:
            batching = True
            eng.begin_batch()
        for res in results:
            assert res.revision >= last_revision
            last_revision = res.revision
            if batching:
                assert not res.diffs
            for i, d in res.diffs.items():
                assert d.identity == i
                apply_diff(mirror, d)
        if len(results) == 1 and o[0] != "batch" and not batching:
            for d in results[0].diffs.values():
                assert_minimal(d, before)
            if touched is not None:
                assert_local(dict(results[0].diffs), touched, before)
        for p, entries in handed_out.values():
            assert dict(p.entries) == entries
        if not batching:
            assert snapshot(mirror) == snapshot(eng.compute_all()) == snapshot(dict(eng.policies()))

    if batching:
        for d in eng.end_batch().diffs.values():
            apply_diff(mirror, d)
        assert snapshot(mirror) == snapshot(eng.compute_all()) == snapshot(dict(eng.policies()))

    # A fresh engine fed the final state agrees too (checks the selector cache).
    fresh = PolicyEngine()
    for ident in identities.values():
        fresh.upsert_identity(ident)
        fresh.set_identity_ips(ident.id, eng.ips_of(ident.id))
    for i, named in ports.items():
        fresh.set_named_ports(i, named)
    for doc in docs.values():
        fresh.upsert_policy_document(doc)
    assert snapshot(dict(fresh.policies())) == snapshot(mirror)


def edit_of(old: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Another version of ``old``: same object, same subject selector, other rules (ports, peers,
    verdicts, directions), which is what the engine applies by remote when it can."""
    subject = "podSelector" if old["kind"] == "NetworkPolicy" else "endpointSelector"
    same_family = knp() if old["kind"] == "NetworkPolicy" else cnp()
    return same_family.map(
        lambda doc: {
            **doc,
            "kind": old["kind"],
            "metadata": old["metadata"],
            "spec": {**doc["spec"], subject: old["spec"][subject]},
        }
    )


edit_op = st.one_of(
    st.tuples(st.just("edit"), st.integers(0, 2)),
    st.tuples(st.just("edit"), st.integers(0, 2)),
    st.tuples(st.just("edit"), st.integers(0, 2)),
    st.tuples(st.just("identity"), ids, pod_range_labels),
    st.tuples(st.just("remove"), ids),
    st.tuples(st.just("ports"), ids, st.sampled_from(NAMED_PORTS)),
    st.tuples(st.just("batch")),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    start=st.dictionaries(ids, pod_range_labels, min_size=3),
    ops=st.lists(edit_op, min_size=1, max_size=15),
    data=st.data(),
)
def test_rule_edits_equal_full(start: dict[int, Any], ops: list[Any], data: Any) -> None:
    """Rules edited in place (the subjects they select keep their rule sets, so only the edited
    rules' remotes are recomputed), mixed with identity changes and batches: applying the diffs
    always equals a full recomputation, and each diff names only real changes."""
    eng = PolicyEngine()
    docs = {n: data.draw(policy_doc(f"p{n}")) for n in range(3)}
    for doc in docs.values():
        eng.upsert_policy_document(doc)
    for i, labels in start.items():
        eng.upsert_identity(Identity(i, labels))
    mirror: dict[int, ResolvedPolicy] = dict(eng.policies())
    batching = False
    for o in ops:
        before = snapshot(dict(eng.policies()))
        if o[0] == "edit":
            docs[o[1]] = data.draw(edit_of(docs[o[1]]))
            result = eng.upsert_policy_document(docs[o[1]])
        elif o[0] == "identity":
            result = eng.upsert_identity(Identity(o[1], o[2]))
        elif o[0] == "remove":
            result = eng.remove_identity(o[1])
        elif o[0] == "ports":
            result = eng.set_named_ports(o[1], o[2])
        elif batching:
            batching = False
            result = eng.end_batch()
        else:
            batching = True
            eng.begin_batch()
            continue
        if batching:
            assert not result.diffs
            continue
        for i, d in result.diffs.items():
            assert d.identity == i
            if o[0] != "batch":
                assert_minimal(d, before)
            apply_diff(mirror, d)
        assert snapshot(mirror) == snapshot(eng.compute_all()) == snapshot(dict(eng.policies()))
    if batching:
        for d in eng.end_batch().diffs.values():
            apply_diff(mirror, d)
    assert snapshot(mirror) == snapshot(eng.compute_all()) == snapshot(dict(eng.policies()))
