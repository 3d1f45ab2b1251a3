"""The policy engine: repository + selector cache + identities + per-identity policy.

Pure and synchronous; the policy service owns one engine and feeds it
changes (policies, identities, ipcache, named ports). Every mutating call
returns a :class:`ChangeResult` with, for each subject identity whose computed
policy changed, the exact :class:`PolicyDiff`. Applying the diffs to the
previous entries always yields a full recomputation's result.

Work is proportional to what a change can affect:

* A policy change recomputes, whole, the subjects its rules' subject
  selectors select (their rule sets changed), each distinct rule set once
  per flush: subjects with the same rules share one computed policy (and,
  when their old policies were shared too, one diff).
* A policy edited in place (same object, its rules' subjects still selecting
  a subject) recomputes, in each subject whose rule set is still the same
  rules, only the entries of the remotes the old and new rules name (the
  wildcard for rules without peers), unless a rule names ports by name or
  has DNS/FQDN rules, or the edit changed enforcement or requirements: a
  cluster-wide rule's new port touches each subject's wildcard entries only.
* An identity change (add, remove, relabel, IPs, named ports) of identity X
  recomputes only the *slice* of entries whose remote identity is X, in the
  subjects whose rules may select X: the selector cache reports which
  selectors gained or lost X (Cilium's ``IdentitySelectionUpdated``), each
  such selector leads to the rules using it as a peer (or requirement), and
  each of those rules to its subjects. The slice is recomputed from every
  rule of the subject that can select X, so allow/deny overlap between rules
  stays right (a removed contribution never removes an entry another rule
  still makes). X's own policy is recomputed whole only when its rule set,
  endpoint status or own named ports changed.

A subject that collects many slice updates in one batch is recomputed whole
instead, which is cheaper past a point.

The module is longer than most (about 600 lines) on purpose: it is the one place that
keeps the engine's indexes consistent with each other (rules by subject, selectors by
rule, slices by remote identity), and every mutating call updates several of them;
selectors, resolution, the realized view and tracing live in their own modules.

Revisions: each accepted policy change bumps the repository revision; an
identity/ipcache/named-port change bumps it only if some subject's policy
changed. A rejected document raises :class:`PolicyValidationError` and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.labels import CLUSTER_NAME_DEFAULT, ReservedIdentity
from services.policy.engine.entries import DENY_BIT, MAX_IDENTITY, EntrySet, KeySet, changes
from services.policy.engine.identity import (
    DEFAULT_RESERVED,
    Identity,
    IdentityState,
    reserved_identity,
)
from services.policy.engine.model import (
    WILDCARD_IDENTITY,
    Direction,
    EntryKey,
    IPAddress,
    IPNetwork,
    IpProto,
    NameRules,
    Policy,
    PolicyRef,
    Rule,
    Verdict,
)
from services.policy.engine.parse import parse_policy
from services.policy.engine.repository import Repository
from services.policy.engine.resolve import (
    Memo,
    NamedPorts,
    PeerIndex,
    ResolvedPolicy,
    RuleRef,
    SubjectRules,
    has_named_ports,
    has_names,
    names_follow_remotes,
    peer_index,
    resolve_names,
    resolve_subject,
    wildcard_run,
)
from services.policy.engine.selector import Selector, cidr_identity_prefixes
from services.policy.engine.selectorcache import SelectionChange, SelectorCache
from services.policy.engine.servicepeers import ServiceRegistry, has_service_peers

RuleId = tuple[PolicyRef, int]


@dataclass(frozen=True, slots=True)
class PolicyDiff:
    """How one subject's policy changed.

    Apply as: drop ``removed`` keys, then set ``added`` (a key whose verdict
    changed is in both). ``deleted`` means the subject is gone: drop it all.
    The enforced flags are the new values. ``names`` is the subject's whole new set of
    ``toFQDNs``/DNS rules when it changed, None when it did not.
    """

    identity: int
    ingress_enforced: bool
    egress_enforced: bool
    added: Mapping[EntryKey, Verdict] = field(default_factory=EntrySet)
    removed: AbstractSet[EntryKey] = field(default_factory=KeySet)
    deleted: bool = False
    names: NameRules | None = None


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
        return PolicyDiff(
            identity, False, False, EntrySet(), KeySet(c & ~DENY_BIT for c in old.entries.codes), True, NameRules()
        )
    new_codes = new.entries.codes
    if old is None:
        return PolicyDiff(identity, new.ingress_enforced, new.egress_enforced, new.entries, KeySet(), names=new.names)
    names = None if old.names == new.names else new.names
    flags_same = old.ingress_enforced == new.ingress_enforced and old.egress_enforced == new.egress_enforced
    old_codes = old.entries.codes
    if old_codes == new_codes:
        if flags_same and names is None:
            return None
        return PolicyDiff(identity, new.ingress_enforced, new.egress_enforced, names=names)
    added, removed = changes(old_codes, new_codes)
    return PolicyDiff(
        identity, new.ingress_enforced, new.egress_enforced, EntrySet(sorted(added)), KeySet(removed), names=names
    )


def apply_diff(policies: dict[int, ResolvedPolicy], diff: PolicyDiff) -> None:
    """Apply one diff to a per-identity policy table (what a consumer does)."""
    if diff.deleted:
        policies.pop(diff.identity, None)
        return
    old = policies.get(diff.identity)
    entries = dict(old.entries.items()) if old is not None else {}
    for k in diff.removed:
        entries.pop(k, None)
    entries.update(diff.added.items())
    names = diff.names if diff.names is not None else (old.names if old is not None else NameRules())
    policies[diff.identity] = ResolvedPolicy(
        diff.identity, diff.ingress_enforced, diff.egress_enforced, EntrySet.of(entries), names
    )


#: A subject collecting pending slice updates (in one batch) is recomputed
#: whole once it has more than this many and more than a quarter as many as it
#: has entries: past that, one full resolve is cheaper than the slices.
_SLICES_BEFORE_FULL = 32


def _for_identity(diff: PolicyDiff, identity: int) -> PolicyDiff:
    """``diff`` made for another subject with the same policy, as ``identity``'s (the parts shared)."""
    return PolicyDiff(
        identity, diff.ingress_enforced, diff.egress_enforced, diff.added, diff.removed, diff.deleted, diff.names
    )


def _plain(srules: SubjectRules) -> bool:
    """No rule names a port by name or has DNS/FQDN rules: every entry follows from the rules
    that select its remote identity alone."""
    return not has_named_ports(srules) and not has_names(srules)


#: Identities of node addresses (the ipcache maps them; CIDR selection ignores them).
_NODE_IDENTITIES = frozenset({int(ReservedIdentity.HOST), int(ReservedIdentity.REMOTE_NODE)})


@dataclass(slots=True)
class _Subject:
    """What the engine keeps per computed subject besides its :class:`ResolvedPolicy`.

    ``rids`` parallels ``rules.rules``. One remote's slice of the entries is a
    contiguous run of the packed :class:`EntrySet`, so it is replaced without a scan.
    """

    rids: tuple[RuleId, ...]
    rules: SubjectRules
    #: Its DNS rules name their servers: an identity change may change its names.
    names_follow_remotes: bool = False
    #: No rule names a port by name or has DNS/FQDN rules (see :func:`_plain`).
    plain: bool = False
    #: Built at the first slice: a rule edit that only touches the wildcard entries needs none.
    _index: PeerIndex | None = None

    @property
    def index(self) -> PeerIndex:
        if self._index is None:
            self._index = peer_index(self.rules)
        return self._index


@dataclass(slots=True)
class _Distilled:
    """One rule set's computed policy in one flush, shared by every subject it selects alike.

    A subject's policy depends on its rules and, when they name ingress ports, its own named
    ports, never on which identity it is (Cilium's distillery shares one computed policy per
    identity; this shares one per rule set): a cluster-wide rule edit resolves each distinct
    rule set once, not each of the thousands of identities it selects.
    """

    subject: _Subject
    policy: ResolvedPolicy
    #: The diffs made from ``policy``, by the ``id`` of the old entries each was made against
    #: (the old policy is held, so the id is not reused): subjects that shared their old
    #: policy too share the diff.
    diffs: dict[int, tuple[ResolvedPolicy, PolicyDiff | None]] = field(default_factory=dict)


@dataclass(slots=True)
class _RuleSetShare:
    """A rule set met in one flush: whether its policy depends on the subject's own named ports,
    its :class:`_Distilled` policies (by the subject's own named ports when it does), and the
    results of the rule-edit path (see :meth:`PolicyEngine._recompute_edited`)."""

    subject: _Subject
    needs_own_ports: bool
    #: No rule names a port by name or has DNS/FQDN rules: an edit can be applied by remote.
    plain: bool
    by_ports: dict[Any, _Distilled] = field(default_factory=dict)
    #: By ``id`` of the old entries: (old policy, the remotes recomputed, new policy, diff); the
    #: old policy and the remotes are held, so their ids are not reused meanwhile.
    edits: dict[int, tuple[ResolvedPolicy, AbstractSet[int], ResolvedPolicy, PolicyDiff | None]] = field(
        default_factory=dict
    )


class PolicyEngine:
    """See the module docstring. Not thread-safe: one owner feeds it."""

    def __init__(self, *, cluster: str = CLUSTER_NAME_DEFAULT, with_reserved: bool = True) -> None:
        self.cluster = cluster
        self._repo = Repository()
        #: The cluster's Services, for ``toServices``; policies naming some are kept as declared
        #: here and enter the repository expanded (``servicepeers``).
        self.services = ServiceRegistry()
        self._declared: dict[PolicyRef, Policy] = {}
        self._cache = SelectorCache()
        self._identities: dict[int, Identity] = {}
        self._ips: dict[int, frozenset[IPAddress]] = {}
        self._ipcache: dict[IPAddress, int] = {}
        self._ports: dict[int, NamedPorts] = {}
        self._port_index: dict[str, set[int]] = {}
        self._rules: dict[RuleId, Rule] = {}
        self._by_subject: dict[Selector, set[RuleId]] = {}
        #: Peer (or requirement) selector -> subject selector -> the rules using both: what an
        #: identity's change reaches without walking every rule that names a broad peer.
        self._by_peer: dict[Selector, dict[Selector, set[RuleId]]] = {}
        self._egress_named: set[RuleId] = set()
        self._resolved: dict[int, ResolvedPolicy] = {}
        self._subjects: dict[int, _Subject] = {}
        # Work not done yet: subjects to recompute whole, and per subject the
        # remote identities whose slice to recompute. Flushed after every
        # change, or at end_batch while batching.
        self._pending_full: set[int] = set()
        self._pending_slices: dict[int, set[int]] = {}
        #: Subjects of edited rules whose rule set may be the same: the remote identities whose
        #: entries the edits can have changed (see :meth:`_recompute_edited`).
        self._pending_edits: dict[int, AbstractSet[int]] = {}
        self._batching = False
        self._batch_start_revision = 0
        self._memo: Memo | None = None
        #: Within a flush, each rule set's computed policy (see :class:`_Distilled`).
        self._distilled: dict[tuple[RuleId, ...], _RuleSetShare] | None = None
        if with_reserved:
            for r in DEFAULT_RESERVED:
                ident = reserved_identity(r)
                self._identities[ident.id] = ident
                self._cache.upsert_identity(ident.id, IdentityState(ident))
            self._pending_full.update(self._identities)
            self._flush(policy_change=True)

    # --- read side -------------------------------------------------------------------

    @property
    def revision(self) -> int:
        return self._repo.revision

    @property
    def committed_revision(self) -> int:
        """The revision before the open batch (the current one when none is open): the newest
        whose changes are computed; the open batch's changes come above it."""
        return self._batch_start_revision if self._batching else self.revision

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

    def identity_of_address(self, ip: IPAddress) -> int | None:
        """The identity the ipcache gives an address (a pod's), or None."""
        return self._ipcache.get(ip)

    def policy_for(self, identity: int) -> ResolvedPolicy | None:
        """The computed policy of a subject identity (None if not an endpoint identity)."""
        return self._resolved.get(identity)

    def policies(self) -> Mapping[int, ResolvedPolicy]:
        return self._resolved

    def referenced_cidrs(self) -> set[IPNetwork]:
        """Every prefix used by CIDR rules (and excepts) of the accepted policies."""
        out: set[IPNetwork] = set()
        for sel in self._cache.cidr_selectors():
            out.add(sel.cidr)
            out.update(sel.excepts)
        return out

    def cidr_identity_prefixes(self) -> frozenset[str]:
        """The prefixes of the accepted policies that need a CIDR identity: see :func:`cidr_identity_prefixes`."""
        return cidr_identity_prefixes(self._cache.cidr_selectors())

    def explain(self, identity: int) -> tuple[ResolvedPolicy, dict[EntryKey, list[RuleRef]]]:
        """Recompute one subject with provenance (which rules made each entry)."""
        why: dict[EntryKey, list[RuleRef]] = {}
        resolved = resolve_subject(identity, self._rules_for(identity), self, explain=why)
        return resolved, why

    def rules_for(self, identity: int) -> list[tuple[PolicyRef, Rule]]:
        return self._rules_for(identity)

    # --- ResolveContext ----------------------------------------------------------------

    def selection_set(self, selector: Selector) -> set[int]:
        return self._cache.selection_set(selector)

    def named_ports(self, identity: int) -> NamedPorts:
        return self._ports.get(identity, {})

    def identities_with_named_port(self, name: str) -> Iterable[int]:
        return [i for i in self._port_index.get(name, ()) if i in self._identities]

    def selectors_selecting(self, identity: int) -> AbstractSet[Selector]:
        return self._cache.selectors_selecting(identity)

    # --- batching ------------------------------------------------------------------------

    def begin_batch(self) -> None:
        """Defer recomputation until :meth:`end_batch` (bulk loads, initial sync)."""
        self._batching = True
        self._batch_start_revision = self.revision

    def end_batch(self) -> ChangeResult:
        """Recompute everything deferred since :meth:`begin_batch`; one combined diff.

        A batch that changed policies already bumped the revision; it is not bumped again.
        """
        self._batching = False
        return self._flush(policy_change=self.revision != self._batch_start_revision)

    # --- policies ------------------------------------------------------------------------

    def upsert_policy_document(self, doc: Mapping[str, Any]) -> ChangeResult:
        """Parse and add/replace; raises PolicyValidationError with nothing changed."""
        return self.upsert_policy(parse_policy(doc, cluster=self.cluster))

    def upsert_policy(self, policy: Policy) -> ChangeResult:
        """Add a policy, or replace every rule of the object with the same key."""
        if has_service_peers(policy):
            self._declared[policy.key] = policy
            policy = self.services.expand(policy)
        else:
            self._declared.pop(policy.key, None)
        return self._put_policy(policy)

    def names_services(self) -> bool:
        """Whether some policy has ``toServices`` (only then can a Service change a policy)."""
        return bool(self._declared)

    def declared_policy(self, key: PolicyRef) -> Policy | None:
        """A policy as it was given (``toServices`` not expanded)."""
        return self._declared.get(key) or self._repo.get(key)

    def set_service(self, namespace: str, name: str, obj: Mapping[str, Any] | None) -> ChangeResult:
        """A Service added, changed or (``obj`` None) deleted; policies naming it follow."""
        self.services.set_service(namespace, name, obj)
        return self._reexpand()

    def set_endpoint_slice(self, namespace: str, name: str, obj: Mapping[str, Any] | None) -> ChangeResult:
        """An EndpointSlice added, changed or deleted (it matters to Services without a selector)."""
        matters = self.services.slice_matters(namespace, name, obj)
        self.services.set_slice(namespace, name, obj)
        return self._reexpand() if matters else ChangeResult(self.revision)

    def _reexpand(self) -> ChangeResult:
        changed = []
        for key, declared in self._declared.items():
            expanded = self.services.expand(declared)
            if expanded != self._repo.get(key):
                changed.append(expanded)
        if not changed:
            return ChangeResult(self.revision)
        if self._batching:
            for policy in changed:
                self._put_policy(policy)
            return ChangeResult(self.revision)
        self.begin_batch()
        for policy in changed:
            self._put_policy(policy)
        return self.end_batch()

    def _put_policy(self, policy: Policy) -> ChangeResult:
        old = self._repo.get(policy.key)
        if old is None:
            self._repo.upsert(policy)
            self._pending_full |= self._register(policy)
        else:
            # An edit: a subject whose rule set is the same gets only the entries of the remotes
            # the old or the new rules name recomputed (the selections, before the old rules'
            # selectors leave the cache).
            before = self._policy_remotes(old)
            affected = self._unregister(old)
            self._repo.upsert(policy)
            affected |= self._register(policy)
            after = self._policy_remotes(policy)
            if before is None or after is None:
                self._pending_full |= affected
            else:
                self._edited(affected, frozenset(before | after))
        result = self._flush(policy_change=True)
        return ChangeResult(result.revision, result.diffs, policy)

    def delete_policy(self, key: PolicyRef) -> ChangeResult:
        self._declared.pop(key, None)
        old = self._repo.get(key)
        if old is None:
            return ChangeResult(self.revision)
        self._pending_full |= self._unregister(old)
        self._repo.delete(key)
        return self._flush(policy_change=True)

    # --- identities ------------------------------------------------------------------------

    def upsert_identity(self, identity: Identity) -> ChangeResult:
        """Add an identity or change its labels."""
        x = identity.id
        if not 0 < x <= MAX_IDENTITY:
            raise ValueError(f"identity {x} is outside 1..{MAX_IDENTITY}, the identities the engine can hold")
        old = self._identities.get(x)
        if old == identity:
            return ChangeResult(self.revision)
        self._identities[x] = identity
        changes = self._cache.upsert_identity(x, self._state(x))
        # Its own policy is recomputed whole when it is new or becomes (or stops
        # being) an endpoint; otherwise only if its rule set changed.
        whole = old is None or old.is_endpoint != identity.is_endpoint
        named = self._affected_by_named_ports(x) if old is None and self._ports.get(x) else set()
        self._identity_changed(x, changes, whole=whole, also=named)
        return self._flush(policy_change=False)

    def remove_identity(self, identity: int) -> ChangeResult:
        if identity not in self._identities:
            return ChangeResult(self.revision)
        named = self._affected_by_named_ports(identity) if self._ports.get(identity) else set()
        del self._identities[identity]
        changes = self._cache.remove_identity(identity)
        self._identity_changed(identity, changes, whole=True, also=named)
        return self._flush(policy_change=False)

    def set_identity_ips(self, identity: int, ips: Iterable[IPAddress]) -> ChangeResult:
        """Replace the endpoint IPs known for an identity.

        Low-level form of the ipcache; use either this or
        :meth:`upsert_ipcache`/:meth:`delete_ipcache`, which maintain the
        per-identity sets from single ``ip -> identity`` entries.
        """
        self._set_ips(identity, frozenset(ips))
        return self._flush(policy_change=False)

    def upsert_ipcache(self, ip: IPAddress, identity: int) -> ChangeResult:
        """One ipcache entry: ``ip`` now maps to ``identity``."""
        old = self._ipcache.get(ip)
        if old == identity:
            return ChangeResult(self.revision)
        self._ipcache[ip] = identity
        if old is not None:
            self._set_ips(old, self._ips.get(old, frozenset()) - {ip})
        self._set_ips(identity, self._ips.get(identity, frozenset()) | {ip})
        return self._flush(policy_change=False)

    def delete_ipcache(self, ip: IPAddress) -> ChangeResult:
        old = self._ipcache.pop(ip, None)
        if old is None:
            return ChangeResult(self.revision)
        return self.set_identity_ips(old, self._ips.get(old, frozenset()) - {ip})

    def set_named_ports(self, identity: int, ports: Mapping[str, Iterable[tuple[IpProto, int]]]) -> ChangeResult:
        """Replace an identity's named ports (union over its pods of name -> (proto, port))."""
        new = {name: frozenset(v) for name, v in ports.items() if v}
        old = self._ports.get(identity, {})
        if dict(old) == new:
            return ChangeResult(self.revision)
        for name in old:
            bucket = self._port_index.get(name)
            if bucket is not None:
                bucket.discard(identity)
                if not bucket:
                    del self._port_index[name]
        if new:
            self._ports[identity] = new
            for name in new:
                self._port_index.setdefault(name, set()).add(identity)
        else:
            self._ports.pop(identity, None)
        # Its own ingress named ports resolve against the new ports, and so do
        # the egress named-port slices of every subject whose rules may reach it.
        sub = self._subjects.get(identity)
        own = sub is None or any(
            pr.direction is Direction.INGRESS and pr.has_named_ports for _, r in sub.rules.rules for pr in r.peer_rules
        )
        self._identity_changed(identity, {}, whole=own, also=self._affected_by_named_ports(identity))
        return self._flush(policy_change=False)

    # --- full recomputation (tests, resync) --------------------------------------------

    def compute_all(self) -> dict[int, ResolvedPolicy]:
        """Recompute every subject from scratch without changing state.

        The reference the incremental engine is checked against, so it shares nothing
        between subjects (no memo): a memo keyed wrongly would show as a difference.
        """
        return {
            i: resolve_subject(i, self._rules_for(i), self)
            for i, ident in sorted(self._identities.items())
            if ident.is_endpoint
        }

    # --- internals -------------------------------------------------------------------------

    def _set_ips(self, identity: int, new: frozenset[IPAddress]) -> None:
        if identity in _NODE_IDENTITIES:
            return  # as Cilium's default: CIDR rules never select nodes (entities do)
        if self._ips.get(identity, frozenset()) == new:
            return
        if new:
            self._ips[identity] = new
        else:
            self._ips.pop(identity, None)
        if identity not in self._identities:
            return
        changes = self._cache.upsert_identity(identity, self._state(identity))
        self._identity_changed(identity, changes, whole=False)

    def _state(self, identity: int) -> IdentityState:
        return IdentityState(self._identities[identity], self._ips.get(identity, frozenset()))

    def _register(self, policy: Policy) -> set[int]:
        affected: set[int] = set()
        for idx, rule in enumerate(policy.rules):
            rid = (policy.key, idx)
            self._cache.add_selector(rule.subject)
            self._by_subject.setdefault(rule.subject, set()).add(rid)
            affected |= self._cache.selection_set(rule.subject)
            for pr in rule.peer_rules:
                for sel in (*(pr.peers or ()), *pr.requirements):
                    self._cache.add_selector(sel)
                    self._by_peer.setdefault(sel, {}).setdefault(rule.subject, set()).add(rid)
                if pr.direction is Direction.EGRESS and pr.has_named_ports:
                    self._egress_named.add(rid)
            self._rules[rid] = self._interned(rule)
        return affected

    def _interned(self, rule: Rule) -> Rule:
        """``rule`` holding the selector cache's instances of its selectors (equal, faster lookups)."""
        canonical = self._cache.canonical
        peer_rules = tuple(
            replace(
                pr,
                peers=None if pr.peers is None else tuple(canonical(s) for s in pr.peers),
                requirements=tuple(canonical(s) for s in pr.requirements),
            )
            for pr in rule.peer_rules
        )
        return replace(rule, subject=canonical(rule.subject), peer_rules=peer_rules)

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
                    by_subject = self._by_peer.get(sel)
                    if by_subject is not None:
                        self._discard(by_subject, rule.subject, rid)
                        if not by_subject:
                            del self._by_peer[sel]
                    self._cache.remove_selector(sel)
        return affected

    @staticmethod
    def _discard(index: dict[Selector, set[RuleId]], sel: Selector, rid: RuleId) -> None:
        bucket = index.get(sel)
        if bucket is not None:
            bucket.discard(rid)
            if not bucket:
                del index[sel]

    def _policy_remotes(self, policy: Policy) -> set[int] | None:
        """The remote identities a policy's rules make entries for (0: every remote), or None when
        its entries do not follow from remotes alone (named ports, DNS and FQDN rules)."""
        out: set[int] = set()
        for rule in policy.rules:
            for pr in rule.peer_rules:
                if pr.has_named_ports or pr.fqdns or pr.dns:
                    return None
                if pr.peers is None:
                    out.add(WILDCARD_IDENTITY)
                    continue
                for sel in pr.peers:
                    out |= self._cache.selection_set(sel)
        return out

    def _edited(self, subjects: Iterable[int], remotes: frozenset[int]) -> None:
        full, edits = self._pending_full, self._pending_edits
        for s in subjects:
            if s in full:
                continue
            pending = edits.get(s)
            edits[s] = remotes if pending is None or pending is remotes else pending | remotes

    def _rule_ids_for(self, identity: int) -> list[RuleId]:
        rids: set[RuleId] = set()
        for sel in self._cache.selectors_selecting(identity):
            rids.update(self._by_subject.get(sel, ()))
        return sorted(rids)

    def _rules_for(self, identity: int) -> list[tuple[PolicyRef, Rule]]:
        return [(rid[0], self._rules[rid]) for rid in self._rule_ids_for(identity)]

    def _identity_changed(
        self,
        x: int,
        changes: Mapping[Selector, SelectionChange],
        *,
        whole: bool,
        also: Iterable[int] = (),
    ) -> None:
        """Schedule what a change of identity ``x`` needs (``changes``: selectors that gained/lost it).

        ``x`` itself is recomputed whole when asked (``whole``) or when its
        rule set changed (a subject selector gained or lost it). Every subject
        of a rule using a changed selector as peer or requirement, and every
        subject in ``also``, gets its slice for remote ``x`` recomputed.
        """
        if whole or any(sel in self._by_subject for sel in changes):
            self._pending_full.add(x)
        subject_selectors: set[Selector] = set()
        for sel in changes:
            subject_selectors.update(self._by_peer.get(sel, ()))
        subjects: set[int] = set(also)
        for sel in subject_selectors:
            subjects |= self._cache.selection_set(sel)
        full, pending = self._pending_full, self._pending_slices
        for s in subjects:
            if s in full:
                continue
            remotes = pending.get(s)
            if remotes is None:
                pending[s] = {x}
            else:
                remotes.add(x)
                if len(remotes) > _SLICES_BEFORE_FULL and len(remotes) * 4 > self._entry_count(s):
                    del pending[s]
                    full.add(s)

    def _entry_count(self, subject: int) -> int:
        policy = self._resolved.get(subject)
        return len(policy.entries) if policy is not None else 0

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

    def _flush(self, *, policy_change: bool) -> ChangeResult:
        """Do the pending work (unless batching) and diff against the stored policies.

        The repository already bumped the revision for a policy change; any
        other change bumps it only when some subject's policy changed.
        """
        if self._batching:
            return ChangeResult(self.revision)
        full, slices, edits = self._pending_full, self._pending_slices, self._pending_edits
        self._pending_full, self._pending_slices, self._pending_edits = set(), {}, {}
        diffs: dict[int, PolicyDiff] = {}
        # Selections are fixed until the flush ends: subjects share peer rules' codes, and
        # subjects with the same rule set share their whole policy.
        self._memo, self._distilled = {}, {}
        try:
            for i in full:
                d = self._recompute_whole(i)
                if d is not None:
                    diffs[i] = d
            for i, remotes in edits.items():
                if i in full:
                    continue
                d = self._recompute_edited(i, remotes, slices.get(i))
                if d is not None:
                    diffs[i] = d
        finally:
            self._memo, self._distilled = None, None
        for i, remotes in slices.items():
            if i in full or i in edits:
                continue
            d = self._recompute_slices(i, remotes)
            if d is not None:
                diffs[i] = d
        if diffs and not policy_change:
            self._repo.bump()
        return ChangeResult(self.revision, {i: diffs[i] for i in sorted(diffs)})

    def _recompute_whole(self, i: int) -> PolicyDiff | None:
        ident = self._identities.get(i)
        old = self._resolved.get(i)
        if ident is None or not ident.is_endpoint:
            self._resolved.pop(i, None)
            self._subjects.pop(i, None)
            return diff_policies(old, None, i)
        rids = tuple(self._rule_ids_for(i))
        shared = self._shared(i, rids)
        if shared.policy.identity == i:
            new = shared.policy
        else:
            p = shared.policy
            new = ResolvedPolicy(i, p.ingress_enforced, p.egress_enforced, p.entries, p.names)
        self._subjects[i] = shared.subject
        self._resolved[i] = new
        if old is None:
            return diff_policies(old, new, i)
        made = shared.diffs.get(id(old.entries))
        if (
            made is not None
            and made[0].entries is old.entries
            and made[0].names == old.names
            and made[0].ingress_enforced == old.ingress_enforced
            and made[0].egress_enforced == old.egress_enforced
        ):
            return None if made[1] is None else _for_identity(made[1], i)
        d = diff_policies(old, new, i)
        shared.diffs[id(old.entries)] = (old, d)
        return d

    def _ruleset(self, rids: tuple[RuleId, ...]) -> _RuleSetShare:
        """What is shared in this flush by the subjects with rules ``rids``."""
        ruleset = self._distilled.get(rids) if self._distilled is not None else None
        if ruleset is None:
            srules = SubjectRules.of((rid[0], self._rules[rid]) for rid in rids)
            needs = any(
                pr.direction is Direction.INGRESS and pr.has_named_ports for _, r in srules.rules for pr in r.peer_rules
            )
            sub = _Subject(rids, srules, names_follow_remotes(srules), _plain(srules))
            ruleset = _RuleSetShare(sub, needs, sub.plain)
            if self._distilled is not None:
                self._distilled[rids] = ruleset
        return ruleset

    def _shared(self, i: int, rids: tuple[RuleId, ...]) -> _Distilled:
        """Subject ``i``'s policy under rules ``rids``, computed once per rule set and flush."""
        ruleset = self._ruleset(rids)
        ports_key = tuple(sorted(self.named_ports(i).items())) if ruleset.needs_own_ports else None
        shared = ruleset.by_ports.get(ports_key)
        if shared is None:
            policy = resolve_subject(i, ruleset.subject.rules, self, memo=self._memo)
            shared = ruleset.by_ports[ports_key] = _Distilled(ruleset.subject, policy)
        return shared

    def _recompute_edited(self, i: int, remotes: AbstractSet[int], slices: set[int] | None) -> PolicyDiff | None:
        """Subject ``i`` after rule edits that may have changed its entries for ``remotes`` only
        (identity 0: the wildcard entries), and identity changes for ``slices``.

        When ``i``'s rule set is the same rules (edited in place), its enforcement and
        requirements did not change and no rule names ports by name or has DNS/FQDN rules, its
        entries for every other remote are what they were: each remote's entries come from the
        rules that select it, and an edited rule selects only ``remotes``, before and after. So
        only those runs are recomputed, from every rule of the subject (allow/deny overlap
        between rules stays right). Otherwise, or when that is most of its entries, it is
        recomputed whole.
        """
        old = self._resolved.get(i)
        sub = self._subjects.get(i)
        ident = self._identities.get(i)
        if old is None or sub is None or ident is None or not ident.is_endpoint:
            return self._recompute_whole(i)
        rids = tuple(self._rule_ids_for(i))
        if rids != sub.rids:
            return self._recompute_whole(i)
        ruleset = self._ruleset(rids)
        new_sub = ruleset.subject
        new_rules, old_rules = new_sub.rules, sub.rules
        if not ruleset.plain or (
            old_rules is not new_rules
            and (
                old_rules.ingress_enforced != new_rules.ingress_enforced
                or old_rules.egress_enforced != new_rules.egress_enforced
                or old_rules.ingress_requirements != new_rules.ingress_requirements
                or old_rules.egress_requirements != new_rules.egress_requirements
                or not sub.plain
            )
        ):
            return self._recompute_whole(i)
        wanted = remotes if not slices else remotes | slices
        entries = old.entries
        if len(wanted) > _SLICES_BEFORE_FULL and len(wanted) * 4 > len(entries):
            return self._recompute_whole(i)
        made = ruleset.edits.get(id(old.entries)) if not slices else None
        if (
            made is not None
            and made[0].entries is old.entries
            and made[1] is remotes
            and made[0].names == old.names
            and made[0].ingress_enforced == old.ingress_enforced
            and made[0].egress_enforced == old.egress_enforced
        ):
            p = made[2]
            new = ResolvedPolicy(i, p.ingress_enforced, p.egress_enforced, p.entries, p.names)
            self._subjects[i] = new_sub
            self._resolved[i] = new
            return None if made[3] is None else _for_identity(made[3], i)
        own_ports = self.named_ports(i)

        def run_of(x: int) -> list[int]:
            if x == WILDCARD_IDENTITY:
                return wildcard_run(new_rules)
            return new_sub.index.slice(x, own_ports, self) if x in self._identities else []

        runs, added, removed = changed_runs(entries, ((x, run_of(x)) for x in wanted))
        # A new set, not an edit: policies handed out never change.
        new = ResolvedPolicy(
            i,
            new_rules.ingress_enforced,
            new_rules.egress_enforced,
            entries.with_runs(runs) if runs else entries,
            old.names,
        )
        d: PolicyDiff | None = None
        if runs or old.ingress_enforced != new.ingress_enforced or old.egress_enforced != new.egress_enforced:
            d = PolicyDiff(i, new.ingress_enforced, new.egress_enforced, EntrySet(sorted(added)), KeySet(removed))
        self._subjects[i] = new_sub
        self._resolved[i] = new
        if not slices:
            ruleset.edits[id(old.entries)] = (old, remotes, new, d)
        return d

    def _recompute_slices(self, i: int, remotes: set[int]) -> PolicyDiff | None:
        """Recompute subject ``i``'s entries for each remote in ``remotes``; its other entries stay.

        Valid because ``i``'s rule set did not change (else it would be in
        the whole-recompute set): only what the remotes are did.
        """
        sub = self._subjects.get(i)
        old = self._resolved.get(i)
        if sub is None or old is None:
            return None
        entries = old.entries
        own_ports = self.named_ports(i)
        names = resolve_names(sub.rules, self) if sub.names_follow_remotes else old.names
        names_diff = None if names == old.names else names
        runs, added, removed = changed_runs(
            entries, ((x, sub.index.slice(x, own_ports, self) if x in self._identities else []) for x in remotes)
        )
        if not runs and names_diff is None:
            return None
        # A new set, not an edit: policies handed out never change.
        self._resolved[i] = ResolvedPolicy(
            i, old.ingress_enforced, old.egress_enforced, entries.with_runs(runs) if runs else entries, names
        )
        return PolicyDiff(
            i, old.ingress_enforced, old.egress_enforced, EntrySet(sorted(added)), KeySet(removed), names=names_diff
        )


def changed_runs(
    entries: EntrySet, wanted: Iterable[tuple[int, list[int]]]
) -> tuple[dict[int, list[int]], list[int], list[int]]:
    """Of each remote's wanted run of codes, those that differ from ``entries``' own run: by
    remote, with the codes they add and the codes they remove."""
    codes = entries.codes
    runs: dict[int, list[int]] = {}
    added: list[int] = []
    removed: list[int] = []
    for x, run in wanted:
        low, high = entries.run(x)
        if high - low == len(run) and codes[low:high].tolist() == run:
            continue
        runs[x] = run
        run_added, run_removed = changes(codes[low:high], run)
        added.extend(run_added)
        removed.extend(run_removed)
    return runs, added, removed
