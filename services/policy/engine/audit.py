"""Audit mode: what policies in audit mode add to an identity's map, beside its enforced policy. Pure.

The enforcing engine never holds an audited policy. A second engine, the enforcing one plus every
audited policy (``full_engine``), says what the identity's policy would be were they enforced. The
difference is the identity's *overlay*, written to the maps in key spaces of their own:

- an audited deny (``Verdict.DENY`` here, ``VERDICT_AUDIT`` on the wire): a key the full policy
  denies and the enforced one does not;
- an audited allow (``Verdict.ALLOW`` here, ``VERDICT_AUDIT_ALLOW`` on the wire): the full policy's
  allows in a direction only audited policies put in default deny (``ingress``/``egress``).

The datapath passes what the enforced policy passes and reports it with verdict audit when an
audited deny covers it, or when its direction is audit-only default deny and no audited allow
covers it. What the enforced policy drops stays dropped.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from services.policy.engine.ipcache import is_endpoint_identity
from services.policy.engine.model import Direction, EntryKey, NameRules, Policy, Verdict
from services.policy.engine.orders import OrderDiff, PlannedOrder
from services.policy.engine.policyengine import PolicyEngine
from services.policy.engine.resolve import ResolvedPolicy


@dataclass(frozen=True, slots=True)
class AuditOverlay:
    identity: int
    #: DENY: an audited deny; ALLOW: an audited allow (in an audit-only direction).
    entries: Mapping[EntryKey, Verdict] = field(default_factory=dict)
    #: The direction is default deny only by audited policies.
    ingress: bool = False
    egress: bool = False
    #: The ``toFQDNs``/DNS rules only audited policies make (each marked ``audit``).
    names: NameRules = field(default_factory=NameRules)


def overlay_names(enforced: NameRules, full: NameRules) -> NameRules:
    """The rules on names of the full policy that the enforced one lacks, marked audited."""
    return NameRules.of(
        [f for f in full.fqdn if f not in enforced.fqdn], [d for d in full.dns if d not in enforced.dns]
    ).audited()


def combined_names(enforced: NameRules, audit: AuditOverlay | None) -> NameRules:
    """What a node enforces on names for an identity: its enforced rules and its audited ones."""
    return enforced | audit.names if audit is not None and audit.names else enforced


def overlay(enforced: ResolvedPolicy | None, full: ResolvedPolicy | None, identity: int) -> AuditOverlay | None:
    """The overlay of one identity (None when audited policies add nothing to it)."""
    if full is None:
        return None
    held = dict(enforced.entries.items()) if enforced is not None else {}
    ingress = full.ingress_enforced and not (enforced is not None and enforced.ingress_enforced)
    egress = full.egress_enforced and not (enforced is not None and enforced.egress_enforced)
    entries: dict[EntryKey, Verdict] = {}
    for key, verdict in full.entries.items():
        if verdict is Verdict.DENY:
            if held.get(key) is not Verdict.DENY:
                entries[key] = Verdict.DENY
        elif ingress if key.direction is Direction.INGRESS else egress:
            entries[key] = Verdict.ALLOW
    names = overlay_names(enforced.names if enforced is not None else NameRules(), full.names)
    if not entries and not ingress and not egress and not names:
        return None
    return AuditOverlay(identity, entries, ingress, egress, names)


def full_engine(engine: PolicyEngine, audited: Iterable[Policy]) -> PolicyEngine:
    """A copy of ``engine`` that enforces ``audited`` too (the engine itself is not touched)."""
    full = copy.deepcopy(engine)
    full.begin_batch()
    for policy in audited:
        full.upsert_policy(policy)
    full.end_batch()
    return full


def overlays(engine: PolicyEngine, full: PolicyEngine) -> dict[int, AuditOverlay]:
    """Every endpoint identity's overlay."""
    out: dict[int, AuditOverlay] = {}
    for identity, policy in full.policies().items():
        if not is_endpoint_identity(identity):
            continue
        found = overlay(engine.policy_for(identity), policy, identity)
        if found is not None:
            out[identity] = found
    return out


def delta(
    old: AuditOverlay | None, new: AuditOverlay | None
) -> tuple[dict[EntryKey, Verdict], dict[EntryKey, Verdict]]:
    """(add, remove) bringing a map holding ``old`` to ``new``; a removal keeps its verdict, which
    names the key space it lives in."""
    before = old.entries if old is not None else {}
    after = new.entries if new is not None else {}
    add = {k: v for k, v in after.items() if before.get(k) is not v}
    remove = {k: v for k, v in before.items() if after.get(k) is not v}
    return add, remove


def with_audit(
    orders: Iterable[PlannedOrder],
    old: Mapping[int, AuditOverlay],
    new: Mapping[int, AuditOverlay],
    names_of: Callable[[int], NameRules] = lambda _: NameRules(),
) -> list[PlannedOrder]:
    """The orders with each identity's audit part: the whole overlay in full diffs, the change in
    incremental ones, the audit-only directions in both (diff objects stay shared across nodes).

    Rules on names travel whole: when the enforced or the audited ones changed, the diff carries
    both (``names_of``: an identity's enforced rules on names, for a diff that did not change them)."""
    memo: dict[int, OrderDiff] = {}

    def decorate(d: OrderDiff) -> OrderDiff:
        done = memo.get(id(d))
        if done is not None:
            return done
        before, after = old.get(d.identity), new.get(d.identity)
        if before is None and after is None:
            out = d
        else:
            add, remove = delta(None if d.full else before, after)
            names = d.names
            before_names = before.names if before is not None else NameRules()
            after_names = after.names if after is not None else NameRules()
            if d.full or names is not None or before_names != after_names:
                enforced = names if names is not None else names_of(d.identity)
                names = combined_names(enforced, after)
            out = dataclasses.replace(
                d,
                audit_add=add,
                audit_remove={} if d.full else remove,
                audit_ingress=after.ingress if after is not None else False,
                audit_egress=after.egress if after is not None else False,
                names=names,
            )
        memo[id(d)] = out
        return out

    return [dataclasses.replace(o, diffs=tuple(decorate(d) for d in o.diffs)) for o in orders]
