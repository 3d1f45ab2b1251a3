"""Typed policy model: what parsed policies and resolved entries look like.

Parsing turns Kubernetes/Cilium documents into these frozen dataclasses; the
resolver turns them into :class:`EntryKey` -> :class:`Verdict` maps per subject
identity. Nothing here knows about YAML, BPF or the network.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.policy.engine.selector import EndpointSelector, Selector

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Remote identity 0 in an entry means "any remote identity" (Cilium's wildcard).
WILDCARD_IDENTITY = 0


class Direction(enum.StrEnum):
    INGRESS = "INGRESS"
    EGRESS = "EGRESS"


class IpProto(enum.IntEnum):
    """IP protocol numbers; ANY (0) matches every protocol."""

    ANY = 0
    ICMP = 1
    TCP = 6
    UDP = 17
    ICMPV6 = 58
    SCTP = 132


class Verdict(enum.StrEnum):
    ALLOW = "ALLOW"
    DENY = "DENY"


class PolicyKind(enum.StrEnum):
    NETWORK_POLICY = "NetworkPolicy"
    CILIUM_NETWORK_POLICY = "CiliumNetworkPolicy"
    CILIUM_CLUSTERWIDE_NETWORK_POLICY = "CiliumClusterwideNetworkPolicy"


@dataclass(frozen=True, slots=True, order=True)
class PolicyRef:
    """Names a policy object (``ObjectRef`` on the wire): kind, namespace ("" when cluster-wide), name.

    ``source`` tells apart objects of the same name from different sources inside the engine:
    "" for objects watched from Kubernetes, "api" for policies imported over the API.
    """

    kind: PolicyKind
    namespace: str
    name: str
    source: str = ""

    def __str__(self) -> str:
        text = f"{self.kind.value} {self.namespace}/{self.name}" if self.namespace else f"{self.kind.value} {self.name}"
        return f"{text} ({self.source})" if self.source else text


class PolicyValidationError(ValueError):
    """A policy document is invalid; names the object and the field path."""

    def __init__(self, obj: str, path: str, message: str) -> None:
        self.object = obj
        self.path = path
        self.message = message
        super().__init__(f"{obj}: {path}: {message}" if path else f"{obj}: {message}")


@dataclass(frozen=True, slots=True, order=True)
class PortSpec:
    """One port match of a rule.

    ``port_low == port_high == 0`` means all ports of ``protocol`` (not for ICMP). ``name`` set
    means a named port still to be resolved against container ports. For ICMP
    and ICMPv6, ``port_low``/``port_high`` carry the ICMP type.
    """

    protocol: IpProto
    port_low: int = 0
    port_high: int = 0
    name: str = ""

    def __str__(self) -> str:
        port = self.name or (
            str(self.port_low) if self.port_low == self.port_high else f"{self.port_low}-{self.port_high}"
        )
        return f"{port}/{self.protocol.name}"


_ICMP_PROTOCOLS = frozenset((IpProto.ICMP, IpProto.ICMPV6))

#: The single port spec of a rule without ports: every protocol, every port.
ALL_PORTS = PortSpec(IpProto.ANY, 0, 0)


@dataclass(frozen=True, slots=True)
class ServiceRef:
    """A ``toServices`` item: one Service by name, or the Services whose labels a selector matches.

    ``namespace`` None is every namespace (a clusterwide policy that names none).
    The engine expands it into the Services' backends (see ``servicepeers``).
    """

    namespace: str | None
    name: str | None = None
    selector: EndpointSelector | None = None

    def __str__(self) -> str:
        where = self.namespace if self.namespace is not None else "*"
        return f"service {where}/{self.name}" if self.name else f"services {where}/{self.selector}"


@dataclass(frozen=True, slots=True, order=True)
class DnsPorts:
    """The DNS rules of one ``toPorts`` element (``rules.dns``): the names a subject may resolve
    through these ports (selectors in :mod:`services.common.fqdn`'s normal form)."""

    ports: tuple[PortSpec, ...]
    selectors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PeerRule:
    """One ingress/egress element: which remote identities, which ports, allow or deny.

    ``peers is None`` means every remote identity (entry identity 0). An empty
    tuple selects nothing (Cilium's empty rule ``ingress: [{}]``).
    ``requirements`` (fromRequires/toRequires) further restrict the identities
    selected by endpoint selectors. ``origin`` is the field path, for traces.
    ``services`` are the ``toServices`` items as written; the engine adds their
    backends' selectors to ``peers`` while the Services exist.
    ``fqdns`` are the ``toFQDNs`` selectors (they add no peer identity: the node learns their
    addresses); ``dns`` the DNS rules of its ``toPorts``.
    """

    direction: Direction
    verdict: Verdict
    peers: tuple[Selector, ...] | None
    ports: tuple[PortSpec, ...] = (ALL_PORTS,)
    requirements: tuple[Selector, ...] = ()
    origin: str = ""
    services: tuple[ServiceRef, ...] = ()
    fqdns: tuple[str, ...] = ()
    dns: tuple[DnsPorts, ...] = ()

    @property
    def has_named_ports(self) -> bool:
        return any(p.name for p in self.ports)


@dataclass(frozen=True, slots=True)
class Rule:
    """One subject selector with its peer rules (a CNP ``spec``/``specs[i]`` or a KNP spec).

    ``enforce_ingress``/``enforce_egress`` say whether this rule puts selected
    subjects in default-deny for that direction.
    """

    subject: EndpointSelector
    enforce_ingress: bool
    enforce_egress: bool
    peer_rules: tuple[PeerRule, ...]
    origin: str = "spec"
    description: str = ""


@dataclass(frozen=True, slots=True, order=True)
class FqdnRule:
    """A subject's egress allow to the addresses of the names ``selector`` selects, on these ports.

    ``PortSpec``'s conventions: protocol ANY with ports 0-0 is every port. ``audit``: the allow of
    a policy in audit mode.
    """

    selector: str
    protocol: IpProto
    port_low: int
    port_high: int
    audit: bool = False

    def covers(self, *, protocol: int, port: int) -> bool:
        key = EntryKey(Direction.EGRESS, WILDCARD_IDENTITY, self.protocol, self.port_low, self.port_high)
        return key.covers(protocol=protocol, port=port)

    def __str__(self) -> str:
        ports = "*" if self.port_low == self.port_high == 0 else f"{self.port_low}-{self.port_high}"
        if self.port_low == self.port_high != 0:
            ports = str(self.port_low)
        return f"toFQDNs {self.selector} {self.protocol.name}/{ports}" + (" (audit)" if self.audit else "")


@dataclass(frozen=True, slots=True, order=True)
class DnsRule:
    """Queries the subject sends to ``remote_identity`` (0: any) on ``protocol``/``port`` go through
    the node's DNS proxy, which answers only names one of ``selectors`` selects."""

    remote_identity: int
    protocol: IpProto
    port: int
    selectors: tuple[str, ...]
    audit: bool = False

    def __str__(self) -> str:
        return f"dns to id={self.remote_identity} {self.protocol.name}/{self.port}: {', '.join(self.selectors)}" + (
            " (audit)" if self.audit else ""
        )


@dataclass(frozen=True, slots=True)
class NameRules:
    """A subject's rules on DNS names (sorted, without duplicates): what its node's DNS proxy enforces."""

    fqdn: tuple[FqdnRule, ...] = ()
    dns: tuple[DnsRule, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.fqdn or self.dns)

    @classmethod
    def of(cls, fqdn: Iterable[FqdnRule], dns: Iterable[DnsRule]) -> NameRules:
        """Sorted and merged: DNS rules of one server, port and mode are one rule with every selector."""
        merged: dict[tuple[int, IpProto, int, bool], set[str]] = {}
        for d in dns:
            merged.setdefault((d.remote_identity, d.protocol, d.port, d.audit), set()).update(d.selectors)
        return cls(
            tuple(sorted(set(fqdn))),
            tuple(sorted(DnsRule(r, p, n, tuple(sorted(s)), a) for (r, p, n, a), s in merged.items())),
        )

    def audited(self) -> NameRules:
        """These rules as a policy in audit mode's."""
        return NameRules(
            tuple(replace(f, audit=True) for f in self.fqdn), tuple(replace(d, audit=True) for d in self.dns)
        )

    def __or__(self, other: NameRules) -> NameRules:
        return NameRules.of((*self.fqdn, *other.fqdn), (*self.dns, *other.dns))


class PolicyMode(enum.StrEnum):
    """How a policy takes effect: enforced, or in audit (computed, never dropping)."""

    ENFORCE = "enforce"
    AUDIT = "audit"


#: The annotation that puts a policy object in audit mode (``audit``) or enforces it (``enforce``, the default).
MODE_ANNOTATION = "policy.palisade.io/mode"


@dataclass(frozen=True, slots=True)
class Policy:
    """A parsed policy object: its rules, and what it asks that is not enforced.

    ``unsupported`` lists ``path: feature`` strings; ``warnings`` lists
    accepted-but-notable things (deprecations, ignored fields).
    """

    key: PolicyRef
    rules: tuple[Rule, ...]
    unsupported: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    mode: PolicyMode = PolicyMode.ENFORCE

    def referenced_selectors(self) -> set[Selector]:
        out: set[Selector] = set()
        for rule in self.rules:
            out.add(rule.subject)
            for pr in rule.peer_rules:
                out.update(pr.peers or ())
                out.update(pr.requirements)
        return out


@dataclass(frozen=True, slots=True, order=True)
class EntryKey:
    """A policy map key: direction, remote identity (0 = any), protocol (0 = any), ports.

    ``port_low == port_high == 0`` means every port of the protocol, except for
    ICMP/ICMPv6 where the port fields carry the ICMP type (0 is echo reply).
    """

    direction: Direction
    identity: int
    protocol: IpProto
    port_low: int
    port_high: int

    def covers(self, *, protocol: int, port: int) -> bool:
        """Whether this key matches a packet of ``protocol`` to ``port`` (ICMP: type)."""
        if self.protocol == IpProto.ANY:
            return self.port_low == self.port_high == 0 or (
                protocol not in _ICMP_PROTOCOLS and self.port_low <= port <= self.port_high
            )
        if self.protocol != protocol:
            return False
        if self.port_low == self.port_high == 0 and protocol not in _ICMP_PROTOCOLS:
            return True
        return self.port_low <= port <= self.port_high

    def __str__(self) -> str:
        ports = (
            "*"
            if self.port_low == self.port_high == 0
            else (str(self.port_low) if self.port_low == self.port_high else f"{self.port_low}-{self.port_high}")
        )
        return f"{self.direction.value} id={self.identity} {self.protocol.name}/{ports}"
