"""Policy trace: would a connection be allowed, and which rules decided it.

Like ``cilium policy trace``: for a source and a destination (identities or bare
label sets), a port and a protocol, evaluate the source's egress and the
destination's ingress directly from the rules in the repository. This walks
the rules instead of the computed entries, so it doubles as an independent
check of the resolver (tests compare both).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.labels import LabelSet, LabelSource, cidr_identity_labels
from services.policy.engine.identity import Identity, IdentityState
from services.policy.engine.model import (
    ALL_PORTS,
    Direction,
    IPAddress,
    IpProto,
    PeerRule,
    PolicyRef,
    PortSpec,
    Rule,
    Verdict,
)
from services.policy.engine.names import DnsDecision, NameEgress, dns_decision, name_egress
from services.policy.engine.policyengine import PolicyEngine
from services.policy.engine.resolve import NamedPorts, RuleRef
from services.policy.engine.selector import EndpointSelector, IdentityView

_ICMP = (IpProto.ICMP, IpProto.ICMPV6)
_PORT_PROTOCOLS = (IpProto.TCP, IpProto.UDP, IpProto.SCTP)


@dataclass(frozen=True, slots=True)
class TraceEndpoint:
    """One end of a traced connection: an identity, or labels not (yet) allocated."""

    labels: LabelSet
    identity: int = 0
    ips: frozenset[IPAddress] = frozenset()
    named_ports: Mapping[str, frozenset[tuple[IpProto, int]]] = field(default_factory=dict)

    @property
    def is_endpoint(self) -> bool:
        if self.identity:
            return Identity(self.identity, self.labels).is_endpoint
        return not (self.labels.has_source(LabelSource.RESERVED) or self.labels.has_source(LabelSource.CIDR))

    def view(self) -> IdentityView:
        return IdentityState(Identity(self.identity, self.labels), self.ips)


@dataclass(frozen=True, slots=True)
class TraceSide:
    """The verdict of one direction (the source's egress or the destination's ingress)."""

    direction: Direction
    allowed: bool
    reason: str  # "deny-rule" | "allow-rule" | "fqdn-rule" | "default-deny" | "default-allow"
    enforced: bool
    selecting: tuple[str, ...] = ()
    matched: tuple[RuleRef, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceResult:
    allowed: bool
    egress: TraceSide
    ingress: TraceSide
    #: With a destination by name: how the source's rules on names judged it.
    names: NameEgress | None = None

    def render(self) -> str:
        lines: list[str] = []
        if self.names is not None:
            lines += self.names.render().splitlines()
        for side, title in ((self.egress, "Egress (source)"), (self.ingress, "Ingress (destination)")):
            lines.append(f"{title}: {'ALLOWED' if side.allowed else 'DENIED'} ({side.reason})")
            lines.append(f"  enforced: {side.enforced}")
            for s in side.selecting:
                lines.append(f"  selected by: {s}")
            for ref in side.matched:
                lines.append(f"  matched: {ref}")
        lines.append(f"Final verdict: {'ALLOWED' if self.allowed else 'DENIED'}")
        return "\n".join(lines)


def endpoint_of(engine: PolicyEngine, identity: int) -> TraceEndpoint:
    ident = engine.identity(identity)
    if ident is None:
        raise KeyError(f"unknown identity {identity}")
    return TraceEndpoint(ident.labels, ident.id, engine.ips_of(identity), engine.named_ports(identity))


def _port_matches(spec: PortSpec, protocol: int, port: int, named: NamedPorts) -> bool:
    if spec.name:
        found = named.get(spec.name, frozenset())
        return any(p == protocol and n == port and (spec.protocol in (IpProto.ANY, p)) for p, n in found)
    if spec == ALL_PORTS:
        return True
    protos = _PORT_PROTOCOLS if spec.protocol is IpProto.ANY else (spec.protocol,)
    if protocol not in protos:
        return False
    if spec.port_low == spec.port_high == 0 and protocol not in _ICMP:
        return True
    return spec.port_low <= port <= spec.port_high


def _peer_matches(pr: PeerRule, remote: TraceEndpoint, requirements: list[EndpointSelector]) -> bool:
    if pr.peers is None:
        return True
    view = remote.view()
    for sel in pr.peers:
        if not sel.matches(view):
            continue
        if isinstance(sel, EndpointSelector) and not all(r.matches(view) for r in requirements):
            continue
        return True
    return False


def _side(
    rules: list[tuple[PolicyRef, Rule]],
    direction: Direction,
    subject: TraceEndpoint,
    remote: TraceEndpoint,
    protocol: int,
    port: int,
) -> TraceSide:
    if not subject.is_endpoint:
        return TraceSide(direction, True, "default-allow", False, ("not a pod endpoint",))
    enforced = any(r.enforce_ingress if direction is Direction.INGRESS else r.enforce_egress for _, r in rules)
    requirements = [
        req
        for _, r in rules
        for pr in r.peer_rules
        if pr.direction is direction
        for req in pr.requirements
        if isinstance(req, EndpointSelector)
    ]
    named = subject.named_ports if direction is Direction.INGRESS else remote.named_ports
    allows: list[RuleRef] = []
    denies: list[RuleRef] = []
    selecting: list[str] = []
    for key, rule in rules:
        selecting.append(f"{key}: {rule.origin}")
        for pr in rule.peer_rules:
            if pr.direction is not direction:
                continue
            if pr.verdict is Verdict.ALLOW and not enforced:
                continue
            if not _peer_matches(pr, remote, requirements):
                continue
            if not any(_port_matches(s, protocol, port, named) for s in pr.ports):
                continue
            ref = RuleRef(key, rule.origin, pr.origin, pr.verdict)
            (denies if pr.verdict is Verdict.DENY else allows).append(ref)
    sel = tuple(selecting)
    if denies:
        return TraceSide(direction, False, "deny-rule", enforced, sel, tuple(denies))
    if allows:
        return TraceSide(direction, True, "allow-rule", enforced, sel, tuple(allows))
    if enforced:
        return TraceSide(direction, False, "default-deny", enforced, sel)
    return TraceSide(direction, True, "default-allow", enforced, sel)


def _rules_selecting(engine: PolicyEngine, ep: TraceEndpoint) -> list[tuple[PolicyRef, Rule]]:
    view = ep.view()
    return [(policy.key, rule) for policy in engine.repository for rule in policy.rules if rule.subject.matches(view)]


def trace(
    engine: PolicyEngine,
    *,
    src: TraceEndpoint | int,
    dst: TraceEndpoint | int,
    port: int,
    protocol: IpProto = IpProto.TCP,
    fqdn: str = "",
) -> TraceResult:
    """Trace a new connection from ``src`` to ``dst`` on ``port``/``protocol``.

    ``fqdn``: ``dst`` is an address the source got in an answer for this name (see
    :func:`address_endpoint`); its ``toFQDNs`` and DNS rules then take part (see ``names``).
    """
    s = endpoint_of(engine, src) if isinstance(src, int) else src
    d = endpoint_of(engine, dst) if isinstance(dst, int) else dst
    src_rules = _rules_selecting(engine, s)
    egress = _side(src_rules, Direction.EGRESS, s, d, protocol, port)
    ingress = _side(_rules_selecting(engine, d), Direction.INGRESS, d, s, protocol, port)
    names: NameEgress | None = None
    if fqdn and s.is_endpoint:
        by_default = egress.reason in ("default-deny", "default-allow")
        names = name_egress(src_rules, fqdn, protocol, port, allowed=egress.allowed, by_default=by_default)
        if names.reason == "fqdn-rule":
            matched = tuple(dict.fromkeys(m.rule for m in names.matched))
            egress = TraceSide(Direction.EGRESS, True, "fqdn-rule", egress.enforced, egress.selecting, matched)
    return TraceResult(egress.allowed and ingress.allowed, egress, ingress, names)


def address_endpoint(engine: PolicyEngine, ip: IPAddress) -> TraceEndpoint | int:
    """What an address is to policy: its pod's identity, else the CIDR identity of the address."""
    known = engine.identity_of_address(ip)
    if known is not None and engine.identity(known) is not None:
        return known
    net = ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}")
    labels = cidr_identity_labels(net)
    ident = engine.identity_by_labels(labels)
    if ident is not None:
        return ident.id
    return TraceEndpoint(labels, 0, frozenset({ip}))


def dns_query(engine: PolicyEngine, src: TraceEndpoint | int, name: str) -> DnsDecision:
    """May ``src`` resolve ``name`` through its node's DNS proxy?"""
    s = endpoint_of(engine, src) if isinstance(src, int) else src
    return dns_decision(_rules_selecting(engine, s), name)
