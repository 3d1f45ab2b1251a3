"""Resolve the rules selecting one subject identity into policy map entries.

Output per subject: for each direction whether it is *enforced* (some rule
selecting the subject puts it in default-deny) and a map
``EntryKey(direction, remote identity, protocol, port_low, port_high) -> ALLOW|DENY``,
held packed (:mod:`entries`: one 64-bit code per entry); resolution works on the codes.

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
it, its named ports). :meth:`PeerIndex.slice` computes exactly that slice, so
an identity change costs the entries naming that identity, not whole subjects.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.policy.engine.entries import EntrySet, decode_key, identity_part, merge, rule_part
from services.policy.engine.model import (
    ALL_PORTS,
    WILDCARD_IDENTITY,
    Direction,
    DnsRule,
    EntryKey,
    FqdnRule,
    IpProto,
    NameRules,
    PeerRule,
    PolicyRef,
    PortSpec,
    Rule,
    Verdict,
)
from services.policy.engine.selector import EndpointSelector, Selector

NamedPorts = Mapping[str, frozenset[tuple[IpProto, int]]]


class ResolveContext(Protocol):
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
    """The computed policy of one subject identity (shared by all its endpoints).

    ``entries`` is always an :class:`EntrySet` (a mapping given here is packed). ``names`` are
    its ``toFQDNs`` and DNS rules (see :func:`resolve_names`).
    """

    identity: int
    ingress_enforced: bool
    egress_enforced: bool
    entries: EntrySet = field(default_factory=EntrySet)
    names: NameRules = field(default_factory=NameRules)

    def __post_init__(self) -> None:
        if not isinstance(self.entries, EntrySet):
            object.__setattr__(self, "entries", EntrySet.of(self.entries))

    def enforced(self, direction: Direction) -> bool:
        return self.ingress_enforced if direction is Direction.INGRESS else self.egress_enforced

    def matching(self, direction: Direction, remote: int, protocol: int, port: int) -> list[tuple[EntryKey, Verdict]]:
        """Entries covering a packet (exact remote and wildcard remote)."""
        out: list[tuple[EntryKey, Verdict]] = []
        for ident in (remote, WILDCARD_IDENTITY) if remote != WILDCARD_IDENTITY else (remote,):
            for key, verdict in self.entries.remote(direction, ident):
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


_PORT_PROTOCOLS = (IpProto.TCP, IpProto.UDP, IpProto.SCTP)


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

    def requirements(self, direction: Direction) -> tuple[Selector, ...]:
        return self.ingress_requirements if direction is Direction.INGRESS else self.egress_requirements

    def requirement_sets(self, ctx: ResolveContext) -> dict[Direction, list[set[int]]]:
        return {
            Direction.INGRESS: [ctx.selection_set(s) for s in self.ingress_requirements],
            Direction.EGRESS: [ctx.selection_set(s) for s in self.egress_requirements],
        }


def _named(ports: NamedPorts, spec: PortSpec) -> list[tuple[IpProto, int]]:
    found = ports.get(spec.name, frozenset())
    if spec.protocol is IpProto.ANY:
        return sorted(found)
    return sorted(pp for pp in found if pp[0] == spec.protocol)


def _named_parts(direction: Direction, ports: NamedPorts, spec: PortSpec) -> list[int]:
    """The key codes (without identity) of a named port spec resolved against ``ports``."""
    return [rule_part(direction, proto, n, n) for proto, n in _named(ports, spec)]


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


def _entry_codes(
    pr: PeerRule,
    remotes: Iterable[int] | None,
    own_ports: NamedPorts,
    ctx: ResolveContext,
    *,
    only: int | None = None,
) -> list[int]:
    """The key codes one peer rule produces for ``remotes`` (``None``: every remote).

    With ``only`` set, just the keys whose remote identity is ``only``: for a
    peer rule without peers these are its egress named-port expansions.
    """
    d = pr.direction
    wild: Iterable[int] = remotes if remotes is not None else (() if only is not None else (WILDCARD_IDENTITY,))
    out: list[int] = []
    for spec in pr.ports:
        if spec.name:
            if d is Direction.INGRESS:
                parts = _named_parts(d, own_ports, spec)
                out.extend(identity_part(r) | part for r in wild for part in parts)
                continue
            if remotes is not None:
                targets: Iterable[int] = remotes
            elif only is not None:
                targets = (only,)
            else:
                targets = ctx.identities_with_named_port(spec.name)
            for r in targets:
                rp = identity_part(r)
                out.extend(rp | part for part in _named_parts(d, ctx.named_ports(r), spec))
            continue
        for part in _port_parts(d, spec):
            out.extend([identity_part(r) | part for r in wild])
    return out


_Signature = tuple[Direction, Verdict, tuple[Selector, ...] | None, tuple[PortSpec, ...]]

#: Key codes of peer rules already resolved in one engine flush (see :func:`resolve_subject`).
Memo = dict[Any, Sequence[int]]


def _signature(pr: PeerRule) -> _Signature:
    """What a peer rule's entries depend on within one subject (its requirements act subject-wide)."""
    return (pr.direction, pr.verdict, pr.peers, pr.ports)


def _frozen_ports(ports: NamedPorts) -> tuple[tuple[str, frozenset[tuple[IpProto, int]]], ...]:
    return tuple(sorted(ports.items()))


def resolve_subject(
    subject: int,
    rules: Iterable[tuple[PolicyRef, Rule]] | SubjectRules,
    ctx: ResolveContext,
    *,
    explain: dict[EntryKey, list[RuleRef]] | None = None,
    memo: Memo | None = None,
) -> ResolvedPolicy:
    """Compute a subject's entries from the rules that select it.

    ``rules`` must be exactly the rules whose subject selector selects
    ``subject``. When ``explain`` is given it is filled with the rules that
    produced each entry (used by traces).

    ``memo`` shares work between subjects while selections do not change (one
    engine flush): a peer rule's codes depend only on its signature, the
    subject's requirements when it selects endpoints, and the subject's own
    named ports when it names ingress ports, so every subject with an equal
    peer rule (each policy of a team allowing DNS, or the cluster) reuses them.
    """
    srules = rules if isinstance(rules, SubjectRules) else SubjectRules.of(rules)
    reqs = srules.requirement_sets(ctx)
    own_ports = ctx.named_ports(subject)
    frozen_ports: tuple[tuple[str, frozenset[tuple[IpProto, int]]], ...] | None = None
    allow: set[int] = set()
    deny: set[int] = set()
    # Policies repeat peer rules: an equal one adds nothing, so it is skipped, unless the
    # caller wants every rule's share.
    done: set[_Signature] | None = set() if explain is None else None
    for pkey, rule in srules.rules:
        for pr in rule.peer_rules:
            d = pr.direction
            if pr.verdict is Verdict.ALLOW and not srules.enforced(d):
                continue
            codes: Sequence[int] | None = None
            memo_key: Any = None
            if done is not None:
                signature = _signature(pr)
                if signature in done:
                    continue
                done.add(signature)
                if memo is not None:
                    needs_reqs = bool(reqs[d]) and any(isinstance(s, EndpointSelector) for s in pr.peers or ())
                    needs_ports = d is Direction.INGRESS and pr.has_named_ports
                    if needs_ports and frozen_ports is None:
                        frozen_ports = _frozen_ports(own_ports)
                    memo_key = (
                        signature,
                        srules.requirements(d) if needs_reqs else None,
                        frozen_ports if needs_ports else None,
                    )
                    codes = memo.get(memo_key)
            if codes is None:
                remotes = _remotes(pr, ctx, reqs[d])
                codes = [] if remotes is not None and not remotes else _entry_codes(pr, remotes, own_ports, ctx)
                if memo_key is not None and memo is not None:
                    # Packed: a flush may hold thousands of these, and int objects cost 5 times more.
                    codes = memo[memo_key] = array("Q", codes)
            (deny if pr.verdict is Verdict.DENY else allow).update(codes)
            if explain is not None:
                ref = RuleRef(pkey, rule.origin, pr.origin, pr.verdict)
                for c in codes:
                    explain.setdefault(decode_key(c), []).append(ref)
    names = resolve_names(srules, ctx, reqs[Direction.EGRESS])
    return ResolvedPolicy(subject, srules.ingress_enforced, srules.egress_enforced, EntrySet.build(allow, deny), names)


_DNS_PROTOCOLS = (IpProto.UDP, IpProto.TCP)


def fqdn_rules_of(pr: PeerRule) -> list[FqdnRule]:
    """The ``toFQDNs`` rules one peer rule makes: each selector on each of its ports."""
    out: list[FqdnRule] = []
    for selector in pr.fqdns:
        for spec in pr.ports:
            out.append(FqdnRule(selector, spec.protocol, spec.port_low, spec.port_high))
    return out


def dns_rules_of(pr: PeerRule, remotes: Iterable[int] | None) -> list[DnsRule]:
    """The DNS rules one peer rule makes for ``remotes`` (None: any server): per remote, each
    UDP/TCP port of a ``toPorts`` element with ``rules.dns``, with that element's selectors."""
    targets = sorted(remotes) if remotes is not None else [WILDCARD_IDENTITY]
    out: list[DnsRule] = []
    for dp in pr.dns:
        for spec in dp.ports:
            if spec.protocol not in _DNS_PROTOCOLS:
                continue  # DNS runs on UDP and TCP; the L4 entry of another protocol stays as written
            out.extend(DnsRule(r, spec.protocol, spec.port_low, dp.selectors) for r in targets)
    return out


def has_names(srules: SubjectRules) -> bool:
    return any(pr.fqdns or pr.dns for _, rule in srules.rules for pr in rule.peer_rules)


def resolve_names(srules: SubjectRules, ctx: ResolveContext, requirements: list[set[int]] | None = None) -> NameRules:
    """A subject's rules on names: every ``toFQDNs`` selector on each port of its egress allows, and
    each DNS rule for every identity its peer rule selects (the DNS servers) and port.

    A DNS rule's L4 part (the DNS traffic itself) is an ordinary allow entry of the same peer
    rule. A direction that is not enforced keeps no ``toFQDNs`` allows (they would change
    nothing) but keeps its DNS rules: they decide which names the subject may resolve.
    """
    if not has_names(srules):
        return NameRules()
    reqs = requirements if requirements is not None else srules.requirement_sets(ctx)[Direction.EGRESS]
    fqdn: list[FqdnRule] = []
    dns: list[DnsRule] = []
    for _, rule in srules.rules:
        for pr in rule.peer_rules:
            if pr.direction is not Direction.EGRESS or pr.verdict is not Verdict.ALLOW:
                continue
            if pr.fqdns and srules.egress_enforced:
                fqdn.extend(fqdn_rules_of(pr))
            if pr.dns:
                dns.extend(dns_rules_of(pr, _remotes(pr, ctx, reqs)))
    return NameRules.of(fqdn, dns)


def has_named_ports(srules: SubjectRules) -> bool:
    return any(pr.has_named_ports for _, rule in srules.rules for pr in rule.peer_rules)


def wildcard_run(srules: SubjectRules) -> list[int]:
    """The codes of a subject's entries for every remote (identity 0: peer rules without peers), sorted.

    Exactly :func:`resolve_subject`'s entries whose remote identity is the wildcard, for rules
    that name no port by name (a named port resolves per remote or per subject).
    """
    allow: set[int] = set()
    deny: set[int] = set()
    wild = identity_part(WILDCARD_IDENTITY)
    for _, rule in srules.rules:
        for pr in rule.peer_rules:
            if pr.peers is not None or (pr.verdict is Verdict.ALLOW and not srules.enforced(pr.direction)):
                continue
            target = deny if pr.verdict is Verdict.DENY else allow
            for spec in pr.ports:
                target.update(wild | part for part in _port_parts(pr.direction, spec))
    return merge(allow, deny)


def names_follow_remotes(srules: SubjectRules) -> bool:
    """Whether the subject's names change with identities (its DNS rules name their servers)."""
    return any(pr.dns and pr.peers is not None for _, rule in srules.rules for pr in rule.peer_rules)


@dataclass(frozen=True, slots=True)
class _Peer:
    """One peer rule of a subject, its numbered ports already packed (see :class:`PeerIndex`)."""

    direction: Direction
    deny: bool
    #: Without peers (every remote): only its egress named ports name a remote.
    wildcard: bool
    parts: tuple[int, ...]
    named: tuple[PortSpec, ...]


def _port_parts(direction: Direction, spec: PortSpec) -> list[int]:
    """The key codes (without identity) of a numbered port spec."""
    if spec == ALL_PORTS:
        return [rule_part(direction, IpProto.ANY, 0, 0)]
    protos = _PORT_PROTOCOLS if spec.protocol is IpProto.ANY else (spec.protocol,)
    return [rule_part(direction, proto, spec.port_low, spec.port_high) for proto in protos]


def _peer(pr: PeerRule) -> _Peer:
    parts: list[int] = []
    for spec in pr.ports:
        if not spec.name:
            parts.extend(_port_parts(pr.direction, spec))
    named = tuple(spec for spec in pr.ports if spec.name)
    return _Peer(pr.direction, pr.verdict is Verdict.DENY, pr.peers is None, tuple(parts), named)


@dataclass(frozen=True, slots=True)
class PeerIndex:
    """A subject's peer rules by the selectors naming their peers: what an identity change walks.

    Only peer rules with a peer selecting a remote, and egress rules without peers that
    use named ports, can give entries for that remote: an identity change walks those,
    not every rule of every subject it touches. Built once per rule set: peer rules
    with equal signatures appear once, and allows of a direction not enforced not at all.
    """

    by_selector: Mapping[Selector, tuple[_Peer, ...]]
    named_egress: tuple[_Peer, ...]
    ingress_requirements: tuple[Selector, ...]
    egress_requirements: tuple[Selector, ...]

    def slice(self, remote: int, own_ports: NamedPorts, ctx: ResolveContext) -> list[int]:
        """The codes of the subject's entries whose remote identity is ``remote``, sorted.

        Exactly :func:`resolve_subject`'s entries restricted to keys with
        ``identity == remote``, computed without looking at any other remote:
        this is what an identity change (add, remove, relabel, IPs, named ports)
        recomputes for every subject whose rules may select it. ``remote`` must
        be an identity the context knows (not the wildcard 0).
        """
        selecting = ctx.selectors_selecting(remote)
        remote_ports = ctx.named_ports(remote)
        # fromRequires/toRequires: an endpoint selector counts only for a remote meeting them all.
        meets_ingress = all(s in selecting for s in self.ingress_requirements)
        meets_egress = all(s in selecting for s in self.egress_requirements)
        found: dict[int, _Peer] = {}
        by_selector = self.by_selector
        if len(by_selector) <= len(selecting):
            groups = [(sel, peers) for sel, peers in by_selector.items() if sel in selecting]
        else:
            groups = [(sel, by_selector[sel]) for sel in selecting if sel in by_selector]
        for sel, peers in groups:
            if isinstance(sel, EndpointSelector) and not (meets_ingress and meets_egress):
                for p in peers:
                    if meets_ingress if p.direction is Direction.INGRESS else meets_egress:
                        found[id(p)] = p
            else:
                for p in peers:
                    found[id(p)] = p
        if remote_ports:
            for p in self.named_egress:
                found[id(p)] = p
        if not found:
            return []
        allow: set[int] = set()
        deny: set[int] = set()
        ip = identity_part(remote)
        for p in found.values():
            target = deny if p.deny else allow
            if not p.wildcard:
                target.update([ip | part for part in p.parts])
            for spec in p.named:
                ports = own_ports if p.direction is Direction.INGRESS else remote_ports
                target.update([ip | part for part in _named_parts(p.direction, ports, spec)])
        return merge(allow, deny)


def peer_index(srules: SubjectRules) -> PeerIndex:
    by_selector: dict[Selector, list[_Peer]] = {}
    named: list[_Peer] = []
    seen: set[_Signature] = set()
    for _, rule in srules.rules:
        for pr in rule.peer_rules:
            if pr.verdict is Verdict.ALLOW and not srules.enforced(pr.direction):
                continue
            if pr.peers is None and (pr.direction is Direction.INGRESS or not pr.has_named_ports):
                continue  # only wildcard entries (identity 0), which no remote's change touches
            signature = _signature(pr)
            if signature in seen:
                continue
            seen.add(signature)
            peer = _peer(pr)
            if pr.peers is None:
                named.append(peer)
                continue
            for sel in pr.peers:
                by_selector.setdefault(sel, []).append(peer)
    return PeerIndex(
        {sel: tuple(peers) for sel, peers in by_selector.items()},
        tuple(named),
        srules.ingress_requirements,
        srules.egress_requirements,
    )
