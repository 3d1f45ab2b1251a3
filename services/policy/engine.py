"""The policy engine: repository + selector cache + identities + per-identity policy.

Pure and synchronous; the policy service owns one engine and feeds it
changes (policies, identities, ipcache, named ports). Every mutating call
returns a :class:`ChangeResult` with, for each subject identity whose computed
policy changed, the exact :class:`PolicyDiff`. Applying the diffs to the
previous entries always yields a full recomputation's result.

Only the subjects a change can affect are recomputed: the identities selected
by the changed rules' subject selectors, the subjects of rules whose peer
selectors changed selection, and identities whose own named ports changed.

Revisions: each accepted policy change bumps the repository revision; an
identity/ipcache/named-port change bumps it only if some subject's policy
changed. A rejected document raises :class:`PolicyValidationError` and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.labels import CLUSTER_NAME_DEFAULT
from services.policy.identity import (
    DEFAULT_RESERVED,
    Identity,
    IdentityState,
    reserved_identity,
)
from services.policy.model import (
    Direction,
    EntryKey,
    IPAddress,
    IPNetwork,
    Policy,
    PolicyKey,
    Protocol,
    Rule,
    Verdict,
)
from services.policy.parse import parse_policy
from services.policy.repository import Repository
from services.policy.resolve import NamedPorts, ResolvedPolicy, RuleRef, resolve_subject
from services.policy.selector import CIDRSelector, Selector
from services.policy.selectorcache import SelectionChange, SelectorCache

RuleId = tuple[PolicyKey, int]


@dataclass(frozen=True, slots=True)
class PolicyDiff:
    """How one subject's policy changed.

    Apply as: drop ``removed`` keys, then set ``added`` (a key whose verdict
    changed is in both). ``deleted`` means the subject is gone: drop it all.
    The enforced flags are the new values.
    """

    identity: int
    ingress_enforced: bool
    egress_enforced: bool
    added: Mapping[EntryKey, Verdict] = field(default_factory=dict)
    removed: frozenset[EntryKey] = frozenset()
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class ChangeResult:
    """Result of one engine change: the revision after it and per-subject diffs."""

    revision: int
    diffs: Mapping[int, PolicyDiff] = field(default_factory=dict)
    policy: Policy | None = None


def diff_policies(old: ResolvedPolicy | None, new: ResolvedPolicy | None, identity: int) -> PolicyDiff | None:
    """The diff from ``old`` to ``new`` (``None`` when equal)."""
    if new is None:
        if old is None:
            return None
        return PolicyDiff(identity, False, False, {}, frozenset(old.entries), deleted=True)
    old_entries: Mapping[EntryKey, Verdict] = old.entries if old is not None else {}
    added = {k: v for k, v in new.entries.items() if old_entries.get(k) is not v}
    removed = frozenset(k for k, v in old_entries.items() if new.entries.get(k) is not v)
    flags_same = old is not None and (
        old.ingress_enforced == new.ingress_enforced and old.egress_enforced == new.egress_enforced
    )
    if old is not None and flags_same and not added and not removed:
        return None
    return PolicyDiff(identity, new.ingress_enforced, new.egress_enforced, added, removed)


def apply_diff(policies: dict[int, ResolvedPolicy], diff: PolicyDiff) -> None:
    """Apply one diff to a per-identity policy table (what a consumer does)."""
    if diff.deleted:
        policies.pop(diff.identity, None)
        return
    old = policies.get(diff.identity)
    entries = dict(old.entries) if old is not None else {}
    for k in diff.removed:
        entries.pop(k, None)
    entries.update(diff.added)
    policies[diff.identity] = ResolvedPolicy(diff.identity, diff.ingress_enforced, diff.egress_enforced, entries)


class PolicyEngine:
    """See the module docstring. Not thread-safe: one owner feeds it."""

    def __init__(self, *, cluster: str = CLUSTER_NAME_DEFAULT, with_reserved: bool = True) -> None:
        self.cluster = cluster
        self._repo = Repository()
        self._cache = SelectorCache()
        self._identities: dict[int, Identity] = {}
        self._ips: dict[int, frozenset[IPAddress]] = {}
        self._ipcache: dict[IPAddress, int] = {}
        self._ports: dict[int, NamedPorts] = {}
        self._port_index: dict[str, set[int]] = {}
        self._rules: dict[RuleId, Rule] = {}
        self._by_subject: dict[Selector, set[RuleId]] = {}
        self._by_peer: dict[Selector, set[RuleId]] = {}
        self._egress_named: set[RuleId] = set()
        self._resolved: dict[int, ResolvedPolicy] = {}
        self._batch: set[int] | None = None
        if with_reserved:
            for r in DEFAULT_RESERVED:
                ident = reserved_identity(r)
                self._identities[ident.id] = ident
                self._cache.upsert_identity(ident.id, IdentityState(ident))
            self._recompute(set(self._identities), policy_change=True)

    # --- read side -------------------------------------------------------------------

    @property
    def revision(self) -> int:
        return self._repo.revision

    @property
    def repository(self) -> Repository:
        return self._repo

    @property
    def selector_cache(self) -> SelectorCache:
        return self._cache

    def seed_revision(self, revision: int) -> None:
        self._repo.seed_revision(revision)

    def identity(self, identity: int) -> Identity | None:
        return self._identities.get(identity)

    def identities(self) -> Mapping[int, Identity]:
        return self._identities

    def identity_by_labels(self, labels: Any) -> Identity | None:
        for ident in self._identities.values():
            if ident.labels == labels:
                return ident
        return None

    def ips_of(self, identity: int) -> frozenset[IPAddress]:
        return self._ips.get(identity, frozenset())

    def policy_for(self, identity: int) -> ResolvedPolicy | None:
        """The computed policy of a subject identity (None if not an endpoint identity)."""
        return self._resolved.get(identity)

    def policies(self) -> Mapping[int, ResolvedPolicy]:
        return self._resolved

    def referenced_cidrs(self) -> set[IPNetwork]:
        """Every prefix used by CIDR rules (and excepts): each needs a CIDR identity."""
        out: set[IPNetwork] = set()
        for sel in self._cache.selectors():
            if isinstance(sel, CIDRSelector):
                out.add(sel.cidr)
                out.update(sel.excepts)
        return out

    def explain(self, identity: int) -> tuple[ResolvedPolicy, dict[EntryKey, list[RuleRef]]]:
        """Recompute one subject with provenance (which rules made each entry)."""
        why: dict[EntryKey, list[RuleRef]] = {}
        resolved = resolve_subject(identity, self._rules_for(identity), self, explain=why)
        return resolved, why

    def rules_for(self, identity: int) -> list[tuple[PolicyKey, Rule]]:
        return self._rules_for(identity)

    # --- ResolveContext ----------------------------------------------------------------

    def selection_set(self, selector: Selector) -> set[int]:
        return self._cache.selection_set(selector)

    def named_ports(self, identity: int) -> NamedPorts:
        return self._ports.get(identity, {})

    def identities_with_named_port(self, name: str) -> Iterable[int]:
        return [i for i in self._port_index.get(name, ()) if i in self._identities]

    # --- batching ------------------------------------------------------------------------

    def begin_batch(self) -> None:
        """Defer recomputation until :meth:`end_batch` (bulk loads, initial sync)."""
        if self._batch is None:
            self._batch = set()

    def end_batch(self) -> ChangeResult:
        """Recompute everything deferred since :meth:`begin_batch`; one combined diff."""
        pending, self._batch = self._batch or set(), None
        return self._recompute(pending, policy_change=False)

    # --- policies ------------------------------------------------------------------------

    def upsert_policy_document(self, doc: Mapping[str, Any]) -> ChangeResult:
        """Parse and add/replace; raises PolicyValidationError with nothing changed."""
        return self.upsert_policy(parse_policy(doc, cluster=self.cluster))

    def upsert_policy(self, policy: Policy) -> ChangeResult:
        """Add a policy, or replace every rule of the object with the same key."""
        old = self._repo.get(policy.key)
        affected = self._unregister(old) if old is not None else set()
        self._repo.upsert(policy)
        affected |= self._register(policy)
        result = self._recompute(affected, policy_change=True)
        return ChangeResult(result.revision, result.diffs, policy)

    def delete_policy(self, key: PolicyKey) -> ChangeResult:
        old = self._repo.get(key)
        if old is None:
            return ChangeResult(self.revision)
        affected = self._unregister(old)
        self._repo.delete(key)
        return self._recompute(affected, policy_change=True)

    # --- identities ------------------------------------------------------------------------

    def upsert_identity(self, identity: Identity) -> ChangeResult:
        """Add an identity or change its labels."""
        old = self._identities.get(identity.id)
        self._identities[identity.id] = identity
        changes = self._cache.upsert_identity(identity.id, self._state(identity.id))
        affected = self._affected_by_selections(changes)
        if old is None or old.is_endpoint or identity.is_endpoint:
            affected.add(identity.id)
        if self._ports.get(identity.id):
            affected |= self._affected_by_named_ports(identity.id)
        return self._recompute(affected, policy_change=False)

    def remove_identity(self, identity: int) -> ChangeResult:
        if identity not in self._identities:
            return ChangeResult(self.revision)
        had_ports = bool(self._ports.get(identity))
        named_affected = self._affected_by_named_ports(identity) if had_ports else set()
        del self._identities[identity]
        changes = self._cache.remove_identity(identity)
        affected = self._affected_by_selections(changes) | named_affected
        affected.add(identity)
        return self._recompute(affected, policy_change=False)

    def set_identity_ips(self, identity: int, ips: Iterable[IPAddress]) -> ChangeResult:
        """Replace the endpoint IPs known for an identity.

        Low-level form of the ipcache; use either this or
        :meth:`upsert_ipcache`/:meth:`delete_ipcache`, which maintain the
        per-identity sets from single ``ip -> identity`` entries.
        """
        return self._recompute(self._set_ips(identity, frozenset(ips)), policy_change=False)

    def upsert_ipcache(self, ip: IPAddress, identity: int) -> ChangeResult:
        """One ipcache entry: ``ip`` now maps to ``identity``."""
        old = self._ipcache.get(ip)
        if old == identity:
            return ChangeResult(self.revision)
        self._ipcache[ip] = identity
        affected: set[int] = set()
        if old is not None:
            affected |= self._set_ips(old, self._ips.get(old, frozenset()) - {ip})
        affected |= self._set_ips(identity, self._ips.get(identity, frozenset()) | {ip})
        return self._recompute(affected, policy_change=False)

    def delete_ipcache(self, ip: IPAddress) -> ChangeResult:
        old = self._ipcache.pop(ip, None)
        if old is None:
            return ChangeResult(self.revision)
        return self.set_identity_ips(old, self._ips.get(old, frozenset()) - {ip})

    def set_named_ports(self, identity: int, ports: Mapping[str, Iterable[tuple[Protocol, int]]]) -> ChangeResult:
        """Replace an identity's named ports (union over its pods of name -> (proto, port))."""
        new = {name: frozenset(v) for name, v in ports.items() if v}
        old = self._ports.get(identity, {})
        if dict(old) == new:
            return ChangeResult(self.revision)
        affected = self._affected_by_named_ports(identity)
        for name in old:
            bucket = self._port_index.get(name)
            if bucket is not None:
                bucket.discard(identity)
        if new:
            self._ports[identity] = new
            for name in new:
                self._port_index.setdefault(name, set()).add(identity)
        else:
            self._ports.pop(identity, None)
        affected |= self._affected_by_named_ports(identity)
        affected.add(identity)
        return self._recompute(affected, policy_change=False)

    # --- full recomputation (tests, resync) --------------------------------------------

    def compute_all(self) -> dict[int, ResolvedPolicy]:
        """Recompute every subject from scratch without changing state."""
        return {
            i: resolve_subject(i, self._rules_for(i), self)
            for i, ident in sorted(self._identities.items())
            if ident.is_endpoint
        }

    # --- internals -------------------------------------------------------------------------

    def _set_ips(self, identity: int, new: frozenset[IPAddress]) -> set[int]:
        if self._ips.get(identity, frozenset()) == new:
            return set()
        if new:
            self._ips[identity] = new
        else:
            self._ips.pop(identity, None)
        if identity not in self._identities:
            return set()
        changes = self._cache.upsert_identity(identity, self._state(identity))
        return self._affected_by_selections(changes)

    def _state(self, identity: int) -> IdentityState:
        return IdentityState(self._identities[identity], self._ips.get(identity, frozenset()))

    def _register(self, policy: Policy) -> set[int]:
        affected: set[int] = set()
        for idx, rule in enumerate(policy.rules):
            rid = (policy.key, idx)
            self._rules[rid] = rule
            self._cache.add_selector(rule.subject)
            self._by_subject.setdefault(rule.subject, set()).add(rid)
            affected |= self._cache.selection_set(rule.subject)
            for pr in rule.peer_rules:
                for sel in (*(pr.peers or ()), *pr.requirements):
                    self._cache.add_selector(sel)
                    self._by_peer.setdefault(sel, set()).add(rid)
                if pr.direction is Direction.EGRESS and pr.has_named_ports:
                    self._egress_named.add(rid)
        return affected

    def _unregister(self, policy: Policy) -> set[int]:
        affected: set[int] = set()
        for idx, rule in enumerate(policy.rules):
            rid = (policy.key, idx)
            affected |= self._cache.selection_set(rule.subject)
            self._rules.pop(rid, None)
            self._egress_named.discard(rid)
            self._discard(self._by_subject, rule.subject, rid)
            self._cache.remove_selector(rule.subject)
            for pr in rule.peer_rules:
                for sel in (*(pr.peers or ()), *pr.requirements):
                    self._discard(self._by_peer, sel, rid)
                    self._cache.remove_selector(sel)
        return affected

    @staticmethod
    def _discard(index: dict[Selector, set[RuleId]], sel: Selector, rid: RuleId) -> None:
        bucket = index.get(sel)
        if bucket is not None:
            bucket.discard(rid)
            if not bucket:
                del index[sel]

    def _rules_for(self, identity: int) -> list[tuple[PolicyKey, Rule]]:
        rids: set[RuleId] = set()
        for sel in self._cache.selectors_selecting(identity):
            rids.update(self._by_subject.get(sel, ()))
        return [(rid[0], self._rules[rid]) for rid in sorted(rids)]

    def _affected_by_selections(self, changes: Mapping[Selector, SelectionChange]) -> set[int]:
        affected: set[int] = set()
        for sel, change in changes.items():
            if sel in self._by_subject:
                affected.update(change.added)
                affected.update(change.removed)
            for rid in self._by_peer.get(sel, ()):
                affected |= self._cache.selection_set(self._rules[rid].subject)
        return affected

    def _affected_by_named_ports(self, identity: int) -> set[int]:
        """Subjects whose egress named ports could resolve against ``identity``."""
        affected: set[int] = set()
        for rid in self._egress_named:
            rule = self._rules[rid]
            for pr in rule.peer_rules:
                if pr.direction is not Direction.EGRESS or not pr.has_named_ports:
                    continue
                if pr.peers is None or any(identity in self._cache.selection_set(s) for s in pr.peers):
                    affected |= self._cache.selection_set(rule.subject)
                    break
        return affected

    def _recompute(self, affected: set[int], *, policy_change: bool) -> ChangeResult:
        """Recompute ``affected`` subjects and diff them against the stored policies.

        The repository already bumped the revision for a policy change; any
        other change bumps it only when some subject's policy changed.
        """
        if self._batch is not None:
            self._batch |= affected
            return ChangeResult(self.revision)
        diffs: dict[int, PolicyDiff] = {}
        for i in sorted(affected):
            ident = self._identities.get(i)
            new = resolve_subject(i, self._rules_for(i), self) if ident is not None and ident.is_endpoint else None
            old = self._resolved.get(i)
            d = diff_policies(old, new, i)
            if new is None:
                self._resolved.pop(i, None)
            else:
                self._resolved[i] = new
            if d is not None:
                diffs[i] = d
        if diffs and not policy_change:
            self._repo.bump()
        return ChangeResult(self.revision, diffs)
