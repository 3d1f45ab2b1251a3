"""Resolve the rules selecting one subject identity into policy map entries.

Output per subject: for each direction whether it is *enforced* (some rule
selecting the subject puts it in default-deny) and a map
``EntryKey(direction, remote identity, protocol, port_low, port_high) -> ALLOW|DENY``.

Entry conventions (the datapath contract):

* remote identity 0 = any remote identity; protocol ANY (0) = any protocol;
  ports 0..0 = any port (for ICMP the port fields are the ICMP type).
* Allow and deny entries are both kept; deny wins. A packet's verdict in one
  direction is: DENY if any entry covering it is DENY; else ALLOW if any entry
  covering it is ALLOW; else DROP if the direction is enforced, ALLOW if not.
  "Covering" means identity in {remote, 0}, protocol in {proto, ANY} and the
  port inside the range. :func:`lookup` is the reference implementation.
* In a direction that is not enforced only DENY entries are kept (allows
  would change nothing).

Named ports are resolved here: for ingress against the subject's own named
ports, for egress against each remote identity's named ports (a wildcard
remote is expanded to every identity that has the name).

Every entry with remote identity X depends only on the rule set selecting the
subject, the subject's own named ports, and X itself (which selectors select
it, its named ports). :func:`resolve_remote` computes exactly that slice, so
an identity change costs the entries naming that identity, not whole subjects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol as TypingProtocol

from services.policy.engine.model import (
    ALL_PORTS,
    WILDCARD_IDENTITY,
    Direction,
    EntryKey,
    PeerRule,
    PolicyRef,
    PortSpec,
    Protocol,
    Rule,
    Verdict,
)
from services.policy.engine.selector import EndpointSelector, Selector

NamedPorts = Mapping[str, frozenset[tuple[Protocol, int]]]


class ResolveContext(TypingProtocol):
    """What resolution needs from the engine's state."""

    def selection_set(self, selector: Selector) -> set[int]: ...

    def named_ports(self, identity: int) -> NamedPorts: ...

    def identities_with_named_port(self, name: str) -> Iterable[int]: ...

    def selectors_selecting(self, identity: int) -> AbstractSet[Selector]: ...


@dataclass(frozen=True, slots=True, order=True)
class RuleRef:
    """Which rule produced an entry: policy, rule path, peer-rule path."""

    policy: PolicyRef
    rule: str
    peer_rule: str
    verdict: Verdict

    def __str__(self) -> str:
        return f"{self.policy}: {self.peer_rule} ({self.verdict.value})"


@dataclass(frozen=True)
class ResolvedPolicy:
    """The computed policy of one subject identity (shared by all its endpoints)."""

    identity: int
    ingress_enforced: bool
    egress_enforced: bool
    entries: Mapping[EntryKey, Verdict] = field(default_factory=dict)

    def enforced(self, direction: Direction) -> bool:
        return self.ingress_enforced if direction is Direction.INGRESS else self.egress_enforced

    @cached_property
    def _by_remote(self) -> dict[tuple[Direction, int], list[tuple[EntryKey, Verdict]]]:
        out: dict[tuple[Direction, int], list[tuple[EntryKey, Verdict]]] = {}
        for key, verdict in self.entries.items():
            out.setdefault((key.direction, key.identity), []).append((key, verdict))
        return out

    def matching(self, direction: Direction, remote: int, protocol: int, port: int) -> list[tuple[EntryKey, Verdict]]:
        """Entries covering a packet (exact remote and wildcard remote)."""
        out: list[tuple[EntryKey, Verdict]] = []
        for ident in (remote, WILDCARD_IDENTITY) if remote != WILDCARD_IDENTITY else (remote,):
            for key, verdict in self._by_remote.get((direction, ident), ()):
                if key.covers(protocol=protocol, port=port):
                    out.append((key, verdict))
        return out


@dataclass(frozen=True, slots=True)
class Decision:
    """A verdict for one direction, and why."""

    allowed: bool
    reason: str  # "deny-entry" | "allow-entry" | "default-deny" | "default-allow"
    entries: tuple[EntryKey, ...] = ()


def lookup(policy: ResolvedPolicy | None, direction: Direction, remote: int, protocol: int, port: int) -> Decision:
    """Reference datapath lookup (see module docstring)."""
    if policy is None:
        return Decision(True, "default-allow")
    found = policy.matching(direction, remote, protocol, port)
    denies = tuple(k for k, v in found if v is Verdict.DENY)
    if denies:
        return Decision(False, "deny-entry", denies)
    allows = tuple(k for k, v in found if v is Verdict.ALLOW)
    if allows:
        return Decision(True, "allow-entry", allows)
    if policy.enforced(direction):
        return Decision(False, "default-deny")
    return Decision(True, "default-allow")


_PORT_PROTOCOLS = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)


@dataclass(frozen=True, slots=True)
class SubjectRules:
    """The rules selecting one subject, and what they decide for every remote at once.

    Enforcement and ``fromRequires``/``toRequires`` are properties of the whole
    rule set: any rule selecting the subject can put a direction in
    default-deny, and the requirements of every rule restrict the endpoint
    peers of every rule in that direction. Both change only when the rule set
    does, so the engine keeps one of these per subject and reuses it for
    per-remote updates.
    """

    rules: tuple[tuple[PolicyRef, Rule], ...]
    ingress_enforced: bool
    egress_enforced: bool
    ingress_requirements: tuple[Selector, ...] = ()
    egress_requirements: tuple[Selector, ...] = ()

    @classmethod
    def of(cls, rules: Iterable[tuple[PolicyRef, Rule]]) -> SubjectRules:
        ordered = tuple(rules)
        reqs: dict[Direction, list[Selector]] = {Direction.INGRESS: [], Direction.EGRESS: []}
        for _, rule in ordered:
            for pr in rule.peer_rules:
                reqs[pr.direction].extend(pr.requirements)
        return cls(
            ordered,
            any(r.enforce_ingress for _, r in ordered),
            any(r.enforce_egress for _, r in ordered),
            tuple(reqs[Direction.INGRESS]),
            tuple(reqs[Direction.EGRESS]),
        )

    def enforced(self, direction: Direction) -> bool:
        return self.ingress_enforced if direction is Direction.INGRESS else self.egress_enforced

    def requirement_sets(self, ctx: ResolveContext) -> dict[Direction, list[set[int]]]:
        return {
            Direction.INGRESS: [ctx.selection_set(s) for s in self.ingress_requirements],
            Direction.EGRESS: [ctx.selection_set(s) for s in self.egress_requirements],
        }


def _named(ports: NamedPorts, spec: PortSpec) -> list[tuple[Protocol, int]]:
    found = ports.get(spec.name, frozenset())
    if spec.protocol is Protocol.ANY:
        return sorted(found)
    return sorted(pp for pp in found if pp[0] == spec.protocol)


def _remotes(pr: PeerRule, ctx: ResolveContext, requirements: list[set[int]]) -> set[int] | None:
    """Remote identities of a peer rule; ``None`` for every identity."""
    if pr.peers is None:
        return None
    out: set[int] = set()
    for sel in pr.peers:
        selected = ctx.selection_set(sel)
        if requirements and isinstance(sel, EndpointSelector):
            selected = selected.intersection(*requirements)
        out |= selected
    return out


def _selects(pr: PeerRule, selecting: AbstractSet[Selector], meets_requirements: bool) -> bool:
    """Whether the remote selected by ``selecting`` is among :func:`_remotes` (peer rule with peers)."""
    for sel in pr.peers or ():
        if sel in selecting and (meets_requirements or not isinstance(sel, EndpointSelector)):
            return True
    return False


def _entry_keys(
    pr: PeerRule,
    remotes: Sequence[int] | None,
    own_ports: NamedPorts,
    ctx: ResolveContext,
    *,
    only: int | None = None,
) -> Iterator[EntryKey]:
    """The keys one peer rule produces for ``remotes`` (sorted; ``None``: every remote).

    With ``only`` set, just the keys whose remote identity is ``only``: for a
    peer rule without peers these are its egress named-port expansions.
    """
    d = pr.direction
    wild: Sequence[int] = remotes if remotes is not None else (() if only is not None else (WILDCARD_IDENTITY,))
    for spec in pr.ports:
        if spec.name:
            if d is Direction.INGRESS:
                numbers = _named(own_ports, spec)
                for r in wild:
                    for proto, n in numbers:
                        yield EntryKey(d, r, proto, n, n)
                continue
            if remotes is not None:
                targets: Sequence[int] = remotes
            elif only is not None:
                targets = (only,)
            else:
                targets = sorted(ctx.identities_with_named_port(spec.name))
            for r in targets:
                for proto, n in _named(ctx.named_ports(r), spec):
                    yield EntryKey(d, r, proto, n, n)
            continue
        if spec == ALL_PORTS:
            for r in wild:
                yield EntryKey(d, r, Protocol.ANY, 0, 0)
            continue
        protos = _PORT_PROTOCOLS if spec.protocol is Protocol.ANY else (spec.protocol,)
        for r in wild:
            for proto in protos:
                yield EntryKey(d, r, proto, spec.port_low, spec.port_high)


_Signature = tuple[Direction, Verdict, tuple[Selector, ...] | None, tuple[PortSpec, ...]]


def _signature(pr: PeerRule) -> _Signature:
    """What a peer rule's entries depend on within one subject (its requirements act subject-wide)."""
    return (pr.direction, pr.verdict, pr.peers, pr.ports)


def _put(entries: dict[EntryKey, Verdict], key: EntryKey, verdict: Verdict) -> None:
    """Deny wins: a key keeps DENY once any rule denies it; an allow never overwrites."""
    if verdict is Verdict.DENY:
        entries[key] = Verdict.DENY
    else:
        entries.setdefault(key, Verdict.ALLOW)


def resolve_subject(
    subject: int,
    rules: Iterable[tuple[PolicyRef, Rule]] | SubjectRules,
    ctx: ResolveContext,
    *,
    explain: dict[EntryKey, list[RuleRef]] | None = None,
) -> ResolvedPolicy:
    """Compute a subject's entries from the rules that select it.

    ``rules`` must be exactly the rules whose subject selector selects
    ``subject``. When ``explain`` is given it is filled with the rules that
    produced each entry (used by traces).
    """
    srules = rules if isinstance(rules, SubjectRules) else SubjectRules.of(rules)
    reqs = srules.requirement_sets(ctx)
    own_ports = ctx.named_ports(subject)
    entries: dict[EntryKey, Verdict] = {}
    # Policies repeat peer rules (every one of a team's policies allowing DNS, or the cluster):
    # an equal one adds nothing, so it is skipped, unless the caller wants every rule's share.
    done: set[_Signature] | None = set() if explain is None else None
    for pkey, rule in srules.rules:
        for pr in rule.peer_rules:
            d = pr.direction
            if pr.verdict is Verdict.ALLOW and not srules.enforced(d):
                continue
            if done is not None:
                signature = _signature(pr)
                if signature in done:
                    continue
                done.add(signature)
            remotes = _remotes(pr, ctx, reqs[d])
            if remotes is not None and not remotes:
                continue
            ref = RuleRef(pkey, rule.origin, pr.origin, pr.verdict)
            for key in _entry_keys(pr, None if remotes is None else sorted(remotes), own_ports, ctx):
                _put(entries, key, pr.verdict)
                if explain is not None:
                    explain.setdefault(key, []).append(ref)
    return ResolvedPolicy(subject, srules.ingress_enforced, srules.egress_enforced, entries)


def resolve_remote(
    subject: int,
    remote: int,
    srules: SubjectRules,
    ctx: ResolveContext,
    *,
    peer_rules: Iterable[PeerRule] | None = None,
) -> dict[EntryKey, Verdict]:
    """The entries of ``subject`` whose remote identity is ``remote``.

    Exactly ``resolve_subject(subject, ...).entries`` restricted to keys with
    ``identity == remote``, computed without looking at any other remote:
    this is what an identity change (add, remove, relabel, IPs, named ports)
    recomputes for every subject whose rules may select it. ``remote`` must
    be an identity the context knows (not the wildcard 0). ``peer_rules``
    optionally narrows the peer rules walked to those of ``srules`` that can
    name ``remote`` at all (see :func:`peer_index`); enforcement and
    requirements still come from the whole of ``srules``.
    """
    selecting = ctx.selectors_selecting(remote)
    meets = {
        Direction.INGRESS: all(s in selecting for s in srules.ingress_requirements),
        Direction.EGRESS: all(s in selecting for s in srules.egress_requirements),
    }
    own_ports = ctx.named_ports(subject)
    entries: dict[EntryKey, Verdict] = {}
    only = (remote,)
    done: set[_Signature] = set()
    if peer_rules is None:
        peer_rules = (pr for _, rule in srules.rules for pr in rule.peer_rules)
    for pr in peer_rules:
        d = pr.direction
        if pr.verdict is Verdict.ALLOW and not srules.enforced(d):
            continue
        signature = _signature(pr)
        if signature in done:
            continue
        done.add(signature)
        if pr.peers is None:
            if d is Direction.INGRESS or not pr.has_named_ports:
                continue
            remotes: Sequence[int] | None = None
        elif _selects(pr, selecting, meets[d]):
            remotes = only
        else:
            continue
        for key in _entry_keys(pr, remotes, own_ports, ctx, only=remote):
            _put(entries, key, pr.verdict)
    return entries


@dataclass(frozen=True, slots=True)
class PeerIndex:
    """A subject's peer rules by the selectors naming their peers, for :func:`resolve_remote`.

    Only peer rules with a peer selecting a remote, and egress rules without peers that
    use named ports, can give entries for that remote: an identity change walks those,
    not every rule of every subject it touches.
    """

    by_selector: Mapping[Selector, tuple[PeerRule, ...]]
    named_egress: tuple[PeerRule, ...]

    def reaching(self, selecting: AbstractSet[Selector], has_named_ports: bool) -> list[PeerRule]:
        """The peer rules that may have entries for a remote selected by ``selecting``."""
        found: dict[int, PeerRule] = {}
        if len(self.by_selector) <= len(selecting):
            groups = [prs for sel, prs in self.by_selector.items() if sel in selecting]
        else:
            groups = [self.by_selector[sel] for sel in selecting if sel in self.by_selector]
        for prs in groups:
            for pr in prs:
                found[id(pr)] = pr
        if has_named_ports:
            for pr in self.named_egress:
                found[id(pr)] = pr
        return list(found.values())


def peer_index(srules: SubjectRules) -> PeerIndex:
    by_selector: dict[Selector, list[PeerRule]] = {}
    named: list[PeerRule] = []
    for _, rule in srules.rules:
        for pr in rule.peer_rules:
            if pr.peers is None:
                if pr.direction is Direction.EGRESS and pr.has_named_ports:
                    named.append(pr)
                continue
            for sel in pr.peers:
                by_selector.setdefault(sel, []).append(pr)
    return PeerIndex({sel: tuple(prs) for sel, prs in by_selector.items()}, tuple(named))
