"""Regeneration orders: which node gets what (the span), per-node sequencing, chunking.

Pure. After every engine change the planner decides, per node, from the
identities present there (the ipcache) and the engine's per-identity diffs:

* an identity that changed and is present on the node: its diff;
* an identity newly present (or newly known) on the node: its full policy;
* an identity that left the node: listed in ``removed_identities``;
* nothing of the node changed but the revision moved: a bare revision bump, at most one
  per node per ``bump_interval`` (a node owed one gets it with its next order, or from
  :meth:`OrderPlanner.plan_owed` once the interval has passed). A bump changes nothing a
  node enforces and needs no report; sent at every commit it made each identity change in
  a 1,000-node cluster cost 1,000 orders and a report of every endpoint of every node.

Each order takes the node's next sequence number (persisted by the service, so
a restart continues it); a datapath that sees a gap asks for a resync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field

from services.policy.engine.model import EntryKey, NameRules, Verdict
from services.policy.engine.policyengine import PolicyDiff
from services.policy.engine.resolve import ResolvedPolicy

PolicyOf = Callable[[int], ResolvedPolicy | None]


@dataclass(frozen=True, slots=True)
class PolicyEpoch:
    """The policy epoch: what must survive a restart, the last revision and every node's last order sequence."""

    revision: int = 0
    sequences: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class OrderDiff:
    """One identity's part of an order: drop ``remove``, then set ``add``; ``full`` replaces all.

    One object per identity and plan, shared by every node's order, so the edge encodes it once.
    """

    identity: int
    ingress_enforced: bool
    egress_enforced: bool
    add: Mapping[EntryKey, Verdict] = field(default_factory=dict)
    remove: Set[EntryKey] = frozenset()
    full: bool = False
    #: Audit mode (see ``audit``): entries of audited policies to set and to drop (with ``full``,
    #: ``audit_add`` is the whole overlay), and the directions only audited policies enforce.
    audit_add: Mapping[EntryKey, Verdict] = field(default_factory=dict)
    audit_remove: Mapping[EntryKey, Verdict] = field(default_factory=dict)
    audit_ingress: bool = False
    audit_egress: bool = False
    #: The identity's whole set of ``toFQDNs``/DNS rules (audited ones marked) when it changed
    #: (always with ``full``); None: unchanged.
    names: NameRules | None = None

    @classmethod
    def of(cls, diff: PolicyDiff) -> OrderDiff:
        """An incremental diff (a key whose verdict changed is in both ``remove`` and ``add``)."""
        return cls(
            diff.identity, diff.ingress_enforced, diff.egress_enforced, diff.added, diff.removed, names=diff.names
        )

    @classmethod
    def whole(cls, policy: ResolvedPolicy) -> OrderDiff:
        """The whole policy of an identity, replacing whatever the receiver had."""
        return cls(
            policy.identity,
            policy.ingress_enforced,
            policy.egress_enforced,
            policy.entries,
            full=True,
            names=policy.names,
        )


@dataclass(frozen=True, slots=True)
class PlannedOrder:
    """One node's order before encoding."""

    node: str
    sequence: int
    revision: int
    diffs: tuple[OrderDiff, ...] = ()
    removed: tuple[int, ...] = ()
    replace: bool = False
    caused_at: float = 0.0

    @property
    def is_bump(self) -> bool:
        return not self.diffs and not self.removed and not self.replace

    def changed_identities(self) -> list[int]:
        return [d.identity for d in self.diffs]


class OrderPlanner:
    """Per-node sequences, last revision sent, and the identities each node holds."""

    def __init__(self, sequences: Mapping[str, int] | None = None, *, bump_interval: float = 0.0) -> None:
        self._seq: dict[str, int] = dict(sequences or {})
        self._sent: dict[str, int] = {}
        #: Least seconds between two bare bumps to one node (0: a bump with every commit).
        self._bump_interval = bump_interval
        #: When each node was last sent a bare bump.
        self._bumped: dict[str, float] = {}
        #: Nodes behind the revision only by bumps held back.
        self._owed: set[str] = set()
        self._delivered: dict[str, set[int]] = {}
        self._holders: dict[int, set[str]] = {}

    # --- read side ------------------------------------------------------------------------

    def sequences(self) -> dict[str, int]:
        return dict(self._seq)

    def sequence(self, node: str) -> int:
        return self._seq.get(node, 0)

    def nodes(self) -> list[str]:
        return sorted(self._seq)

    def delivered(self, node: str) -> set[int]:
        """Identities whose policy the node has been sent (what a resync must return)."""
        return set(self._delivered.get(node, ()))

    # --- planning ---------------------------------------------------------------------------

    def plan_replace(
        self,
        *,
        revision: int,
        nodes: Iterable[str],
        local: Callable[[str], set[int]],
        policy_of: PolicyOf,
        caused_at: float,
    ) -> list[PlannedOrder]:
        """The whole state of every node (first orders after a start): every diff full."""
        orders = []
        full: dict[int, OrderDiff] = {}
        for node in sorted(set(nodes) | set(self._seq)):
            for identity in self._delivered.pop(node, set()):
                self._unhold(identity, node)
            diffs = []
            for identity in sorted(local(node)):
                policy = policy_of(identity)
                if policy is None:
                    continue
                if identity not in full:
                    full[identity] = OrderDiff.whole(policy)
                diffs.append(full[identity])
                self._hold(identity, node)
            orders.append(self._order(node, revision, tuple(diffs), (), True, caused_at))
        return orders

    def plan(
        self,
        *,
        revision: int,
        diffs: Mapping[int, PolicyDiff],
        dirty: Iterable[tuple[str, int]],
        nodes: Iterable[str],
        local_nodes: Callable[[int], set[str]],
        is_local: Callable[[str, int], bool],
        policy_of: PolicyOf,
        caused_at: float,
        now: float = 0.0,
    ) -> list[PlannedOrder]:
        """Orders after one change.

        ``diffs``: the engine's per-identity diffs; ``dirty``: (node, identity) pairs whose
        presence on the node changed; ``nodes``: the nodes hosting identities; ``now``: the
        commit's time, for holding back bumps.
        """
        candidates: dict[str, set[int]] = {}
        for node, identity in dirty:
            candidates.setdefault(node, set()).add(identity)
        for identity in diffs:
            for node in local_nodes(identity) | self._holders.get(identity, set()):
                candidates.setdefault(node, set()).add(identity)
        converted: dict[int, OrderDiff] = {}
        # Full and incremental forms of one identity can both be needed in one plan.
        full_forms: dict[int, OrderDiff] = {}
        orders = []
        # Nodes holding nothing (their pods are gone) need no revision bumps; their sequence is kept.
        holding = {node for node, held in self._delivered.items() if held}
        self._owed &= set(nodes) | holding
        for node in sorted(set(nodes) | holding | set(candidates)):
            held = self._delivered.setdefault(node, set())
            out: list[OrderDiff] = []
            removed: list[int] = []
            for identity in sorted(candidates.get(node, ())):
                want = is_local(node, identity) and policy_of(identity) is not None
                had = identity in held
                if want and not had:
                    if identity not in full_forms:
                        policy = policy_of(identity)
                        assert policy is not None
                        full_forms[identity] = OrderDiff.whole(policy)
                    out.append(full_forms[identity])
                    self._hold(identity, node)
                elif had and not want:
                    removed.append(identity)
                    self._unhold(identity, node)
                elif want and identity in diffs:
                    if identity not in converted:
                        converted[identity] = OrderDiff.of(diffs[identity])
                    out.append(converted[identity])
            if not held:
                self._delivered.pop(node, None)
            if out or removed:
                self._owed.discard(node)
                orders.append(self._order(node, revision, tuple(out), tuple(removed), False, caused_at))
            elif revision > self._sent.get(node, 0):
                bump = self._bump(node, revision, caused_at, now)
                if bump is not None:
                    orders.append(bump)
        return orders

    def plan_owed(self, *, revision: int, now: float) -> list[PlannedOrder]:
        """The bumps held back whose interval has passed (with no change to carry them)."""
        orders = []
        for node in sorted(self._owed):
            bump = self._bump(node, revision, now, now)
            if bump is not None:
                orders.append(bump)
        return orders

    def owes(self) -> bool:
        return bool(self._owed)

    def _bump(self, node: str, revision: int, caused_at: float, now: float) -> PlannedOrder | None:
        if revision <= self._sent.get(node, 0):
            self._owed.discard(node)
            return None
        last = self._bumped.get(node)
        if last is not None and now - last < self._bump_interval:
            self._owed.add(node)
            return None
        self._owed.discard(node)
        self._bumped[node] = now
        return self._order(node, revision, (), (), False, caused_at)

    def _order(
        self,
        node: str,
        revision: int,
        diffs: tuple[OrderDiff, ...],
        removed: tuple[int, ...],
        replace: bool,
        caused_at: float,
    ) -> PlannedOrder:
        self._seq[node] = self._seq.get(node, 0) + 1
        self._sent[node] = max(self._sent.get(node, 0), revision)
        return PlannedOrder(node, self._seq[node], revision, diffs, removed, replace, caused_at)

    def adopt(self, node: str, identity: int) -> None:
        """The node got this identity's policy outside an order (a Resync naming it)."""
        self._hold(identity, node)

    def _hold(self, identity: int, node: str) -> None:
        self._delivered.setdefault(node, set()).add(identity)
        self._holders.setdefault(identity, set()).add(node)

    def _unhold(self, identity: int, node: str) -> None:
        held = self._delivered.get(node)
        if held is not None:
            held.discard(identity)
        holders = self._holders.get(identity)
        if holders is not None:
            holders.discard(node)
            if not holders:
                del self._holders[identity]
