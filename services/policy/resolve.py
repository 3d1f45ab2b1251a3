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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol as TypingProtocol

from services.policy.model import (
    ALL_PORTS,
    WILDCARD_IDENTITY,
    Direction,
    EntryKey,
    PeerRule,
    PolicyKey,
    PortSpec,
    Protocol,
    Rule,
    Verdict,
)
from services.policy.selector import EndpointSelector, Selector

NamedPorts = Mapping[str, frozenset[tuple[Protocol, int]]]


class ResolveContext(TypingProtocol):
    """What resolution needs from the engine's state."""

    def selection_set(self, selector: Selector) -> set[int]: ...

    def named_ports(self, identity: int) -> NamedPorts: ...

    def identities_with_named_port(self, name: str) -> Iterable[int]: ...


@dataclass(frozen=True, slots=True, order=True)
class RuleRef:
    """Which rule produced an entry: policy, rule path, peer-rule path."""

    policy: PolicyKey
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


def resolve_subject(
    subject: int,
    rules: Iterable[tuple[PolicyKey, Rule]],
    ctx: ResolveContext,
    *,
    explain: dict[EntryKey, list[RuleRef]] | None = None,
) -> ResolvedPolicy:
    """Compute a subject's entries from the rules that select it.

    ``rules`` must be exactly the rules whose subject selector selects
    ``subject``. When ``explain`` is given it is filled with the rules that
    produced each entry (used by traces).
    """
    rules = list(rules)
    ingress_enforced = any(r.enforce_ingress for _, r in rules)
    egress_enforced = any(r.enforce_egress for _, r in rules)
    reqs: dict[Direction, list[set[int]]] = {Direction.INGRESS: [], Direction.EGRESS: []}
    for _, rule in rules:
        for pr in rule.peer_rules:
            for sel in pr.requirements:
                reqs[pr.direction].append(ctx.selection_set(sel))
    own_ports = ctx.named_ports(subject)
    entries: dict[EntryKey, Verdict] = {}

    def put(key: EntryKey, verdict: Verdict, ref: RuleRef) -> None:
        if verdict is Verdict.DENY or entries.get(key) is Verdict.DENY:
            entries[key] = Verdict.DENY
        else:
            entries[key] = Verdict.ALLOW
        if explain is not None:
            explain.setdefault(key, []).append(ref)

    for pkey, rule in rules:
        for pr in rule.peer_rules:
            d = pr.direction
            if pr.verdict is Verdict.ALLOW and not (ingress_enforced if d is Direction.INGRESS else egress_enforced):
                continue
            remotes = _remotes(pr, ctx, reqs[d])
            if remotes is not None and not remotes:
                continue
            ref = RuleRef(pkey, rule.origin, pr.origin, pr.verdict)
            wild = (WILDCARD_IDENTITY,) if remotes is None else sorted(remotes)
            for spec in pr.ports:
                if spec.name:
                    if d is Direction.INGRESS:
                        numbers = _named(own_ports, spec)
                        for r in wild:
                            for proto, n in numbers:
                                put(EntryKey(d, r, proto, n, n), pr.verdict, ref)
                    else:
                        targets = sorted(ctx.identities_with_named_port(spec.name)) if remotes is None else wild
                        for r in targets:
                            for proto, n in _named(ctx.named_ports(r), spec):
                                put(EntryKey(d, r, proto, n, n), pr.verdict, ref)
                    continue
                if spec == ALL_PORTS:
                    for r in wild:
                        put(EntryKey(d, r, Protocol.ANY, 0, 0), pr.verdict, ref)
                    continue
                protos = _PORT_PROTOCOLS if spec.protocol is Protocol.ANY else (spec.protocol,)
                for r in wild:
                    for proto in protos:
                        put(EntryKey(d, r, proto, spec.port_low, spec.port_high), pr.verdict, ref)
    return ResolvedPolicy(subject, ingress_enforced, egress_enforced, entries)
