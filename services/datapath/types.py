"""The datapath's own value types.

The datapath keeps its own copy of the policy key and entry (like Cilium's
``pkg/policy/types``) so it never imports the policy engine. Protobuf stops at the
edges: ``wire`` translates requests, orders and resync answers into these types where
they enter (the servicer, the order consumer, the gRPC clients), so the endpoint
manager, the realizer and the facade below them never see a protobuf message.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from enum import StrEnum
from typing import NamedTuple

#: Reserved identities the datapath itself relies on (Cilium's numbers).
IDENTITY_ANY = 0
IDENTITY_HOST = 1
IDENTITY_WORLD = 2
#: Reserved identity of an endpoint whose pod is not known yet (Cilium's reserved:init).
IDENTITY_INIT = 5

MAX_PORT = 0xFFFF
MAX_IDENTITY = 0xFFFF_FFFF

#: Node-local identities of addresses the node's DNS proxy learned (Cilium's local identity scope
#: starts at 1 << 24; ipam's cluster-wide CIDR identities take 1 << 24 .. (1 << 25) - 1, so the node
#: takes the next block). Entries with these remote identities are the proxy's: the realizer's full
#: syncs and the ipcache's prune leave them alone.
#: ipam's CIDR identities (cluster-wide, every node agrees on them).
MIN_CIDR_IDENTITY = 1 << 24
MAX_CIDR_IDENTITY = (1 << 25) - 1
MIN_LOCAL_IDENTITY = 1 << 25
MAX_LOCAL_IDENTITY = (1 << 26) - 1


def is_local_identity(identity: int) -> bool:
    return MIN_LOCAL_IDENTITY <= identity <= MAX_LOCAL_IDENTITY


def is_cidr_identity(identity: int) -> bool:
    return MIN_CIDR_IDENTITY <= identity <= MAX_CIDR_IDENTITY


class Direction(StrEnum):
    """Traffic direction seen from the local endpoint."""

    #: Traffic entering the endpoint (tc egress of its host veth).
    INGRESS = "ingress"
    #: Traffic leaving the endpoint (tc ingress of its host veth).
    EGRESS = "egress"

    @property
    def wire(self) -> int:
        """The value in BPF keys (the protobuf ``Direction`` numbers)."""
        return 1 if self is Direction.INGRESS else 2

    @classmethod
    def from_wire(cls, value: int) -> Direction:
        if value == 1:
            return cls.INGRESS
        if value == 2:
            return cls.EGRESS
        raise ValueError(f"unknown direction {value}")


class L4Proto(StrEnum):
    """L4 protocol; ``ANY`` matches every protocol."""

    ANY = "any"
    ICMP = "icmp"
    TCP = "tcp"
    UDP = "udp"
    ICMPV6 = "icmpv6"
    SCTP = "sctp"

    @property
    def number(self) -> int:
        """The IP protocol number (0 for ANY), as BPF keys and the protobuf enum use it."""
        return _PROTO_NUMBERS[self]

    @property
    def has_ports(self) -> bool:
        return self in (L4Proto.TCP, L4Proto.UDP, L4Proto.SCTP, L4Proto.ANY)

    @classmethod
    def from_number(cls, number: int) -> L4Proto:
        for proto, num in _PROTO_NUMBERS.items():
            if num == number:
                return proto
        raise ValueError(f"unsupported IP protocol {number}")


_PROTO_NUMBERS = {
    L4Proto.ANY: 0,
    L4Proto.ICMP: 1,
    L4Proto.TCP: 6,
    L4Proto.UDP: 17,
    L4Proto.ICMPV6: 58,
    L4Proto.SCTP: 132,
}


class Verdict(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    #: In a policy entry: a deny of a policy in audit mode. In a flow event: the packet passed, and a
    #: policy in audit mode would have dropped it.
    AUDIT = "audit"
    #: In a policy entry only: an allow of a policy in audit mode, in a direction that only audited
    #: policies put in default deny (what passes there is not audited).
    AUDIT_ALLOW = "audit-allow"

    @property
    def wire(self) -> int:
        """The value in BPF keys and events (the protobuf ``Verdict`` numbers)."""
        return _VERDICT_NUMBERS[self]

    @property
    def audit(self) -> bool:
        return self in (Verdict.AUDIT, Verdict.AUDIT_ALLOW)

    @classmethod
    def from_wire(cls, value: int) -> Verdict:
        for verdict, number in _VERDICT_NUMBERS.items():
            if number == value:
                return verdict
        raise ValueError(f"unknown verdict {value}")


_VERDICT_NUMBERS = {Verdict.ALLOW: 1, Verdict.DENY: 2, Verdict.AUDIT: 3, Verdict.AUDIT_ALLOW: 4}


class Reason(StrEnum):
    """Why a packet was forwarded or dropped; numbers follow the protobuf ``FlowReason``."""

    POLICY_ALLOW = "policy-allow"
    POLICY_DENY = "policy-deny"
    DEFAULT_DENY = "default-deny"
    ESTABLISHED = "established"
    NOT_ENFORCED = "not-enforced"
    #: An IP packet too short to parse; the datapath drops it (no protobuf equivalent).
    INVALID = "invalid"
    #: A connection to a service frontend without backends: rejected (ICMP port unreachable).
    NO_BACKEND = "no-backend"
    #: A connection whose tuple (after DNAT) another live flow of its client held, and no free
    #: source port to give it: dropped.
    NO_PORT = "no-port"

    @property
    def wire(self) -> int:
        return _REASON_NUMBERS[self]

    @property
    def is_drop(self) -> bool:
        return self in (Reason.POLICY_DENY, Reason.DEFAULT_DENY, Reason.INVALID, Reason.NO_BACKEND, Reason.NO_PORT)

    @classmethod
    def from_wire(cls, value: int) -> Reason:
        for reason, num in _REASON_NUMBERS.items():
            if num == value:
                return reason
        raise ValueError(f"unknown reason {value}")


_REASON_NUMBERS = {
    Reason.POLICY_ALLOW: 1,
    Reason.POLICY_DENY: 2,
    Reason.DEFAULT_DENY: 3,
    Reason.ESTABLISHED: 4,
    Reason.NOT_ENFORCED: 5,
    Reason.INVALID: 6,
    Reason.NO_BACKEND: 7,
    Reason.NO_PORT: 8,
}


@dataclasses.dataclass(frozen=True, order=True)
class PolicyKey:
    """Who (remote identity), which direction, which protocol and destination ports.

    ``remote_identity`` 0 is any identity; ``protocol`` ANY is any protocol;
    ``port_low`` 0 is all ports (stored as 0-0). A ``port_high`` of 0 with a
    non-zero ``port_low`` means the single port ``port_low`` (protobuf leaves it
    unset for single ports). Both are normalized here so equal keys compare equal.
    """

    direction: Direction
    remote_identity: int = IDENTITY_ANY
    protocol: L4Proto = L4Proto.ANY
    port_low: int = 0
    port_high: int = 0
    #: A key of a policy in audit mode: a key space of its own (an entry's verdict sets it).
    audit: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "direction", Direction(self.direction))
        object.__setattr__(self, "protocol", L4Proto(self.protocol))
        if not 0 <= self.remote_identity <= MAX_IDENTITY:
            raise ValueError(f"remote identity {self.remote_identity} out of range")
        if not (0 <= self.port_low <= MAX_PORT and 0 <= self.port_high <= MAX_PORT):
            raise ValueError(f"ports {self.port_low}-{self.port_high} out of range")
        if self.port_low == 0:
            object.__setattr__(self, "port_high", 0)
        elif self.port_high == 0:
            object.__setattr__(self, "port_high", self.port_low)
        if self.port_high < self.port_low:
            raise ValueError(f"port range {self.port_low}-{self.port_high} is empty")
        if self.port_low and not self.protocol.has_ports:
            raise ValueError(f"{self.protocol} has no ports (got {self.port_low}-{self.port_high})")

    @property
    def port_range(self) -> tuple[int, int]:
        """The inclusive range of destination ports the key covers."""
        if self.port_low == 0:
            return (0, MAX_PORT)
        return (self.port_low, self.port_high)


@dataclasses.dataclass(frozen=True, order=True)
class PolicyEntry:
    key: PolicyKey
    verdict: Verdict = Verdict.ALLOW

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        if self.key.audit != self.verdict.audit:
            object.__setattr__(self, "key", dataclasses.replace(self.key, audit=self.verdict.audit))


@dataclasses.dataclass(frozen=True)
class Enforcement:
    """Whether each direction is enforced; an unenforced direction is allow-all."""

    ingress: bool = False
    egress: bool = False
    #: The direction is default deny only by policies in audit mode: what they would drop passes,
    #: reported as audit (AUDIT_ALLOW entries say what they allow).
    audit_ingress: bool = False
    audit_egress: bool = False

    def enforced(self, direction: Direction) -> bool:
        return self.ingress if direction is Direction.INGRESS else self.egress

    def audited(self, direction: Direction) -> bool:
        return self.audit_ingress if direction is Direction.INGRESS else self.audit_egress


@dataclasses.dataclass(frozen=True)
class EndpointSpec:
    """A local pod as the datapath needs it: where its veth is and what it is."""

    id: int
    #: Host-side veth: the programs attach here.
    ifindex: int
    host_ifname: str
    #: The pod's addresses (IPv4 and/or IPv6), without prefix length.
    ips: tuple[str, ...]
    identity: int
    #: The MACs of the veth's host and pod ends, where known (Palisade made the veth): local
    #: delivery then needs no lookup of the host's neighbour table.
    host_mac: str = ""
    pod_mac: str = ""

    def __post_init__(self) -> None:
        # The highest id depends on the map sizes: the datapath checks it (``max_endpoint_id``).
        if self.id <= 0:
            raise ValueError(f"endpoint id {self.id} must be positive")
        if self.ifindex <= 0:
            raise ValueError(f"ifindex {self.ifindex} must be positive")
        if not 0 < self.identity <= MAX_IDENTITY:
            raise ValueError(f"identity {self.identity} out of range")
        object.__setattr__(self, "ips", tuple(str(ipaddress.ip_address(ip)) for ip in self.ips))


@dataclasses.dataclass(frozen=True)
class PinnedEndpoint:
    """What the pinned maps remember of an endpoint (for restore after a restart)."""

    id: int
    ifindex: int
    identity: int
    ips: tuple[str, ...]
    enforcement: Enforcement
    #: Whether both tc programs are still attached to ``ifindex``.
    attached: bool
    #: Short hash of the template both hooks run (None if detached or mixed); compare with
    #: ``Datapath.template.short`` to find endpoints a restarted agent should re-attach.
    template: str | None = None


@dataclasses.dataclass(frozen=True)
class FlowEvent:
    """One flow event: every drop, and each new allowed connection."""

    #: Unix time in seconds.
    time: float
    endpoint_id: int
    ifindex: int
    direction: Direction
    verdict: Verdict
    reason: Reason
    source_identity: int
    destination_identity: int
    source_ip: str
    destination_ip: str
    source_port: int
    destination_port: int
    #: IP protocol number (not every protocol seen on the wire has an ``L4Proto`` member).
    protocol: int


@dataclasses.dataclass(frozen=True, order=True)
class CounterKey:
    endpoint_id: int
    reason: Reason
    direction: Direction


@dataclasses.dataclass(frozen=True)
class CounterValue:
    packets: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class Counters:
    """Per endpoint, reason and direction packet/byte counts, summed over CPUs."""

    values: dict[CounterKey, CounterValue]
    #: Flow events the ring buffer had no room for.
    events_lost: int

    def packets(
        self, *, endpoint_id: int | None = None, reason: Reason | None = None, direction: Direction | None = None
    ) -> int:
        return sum(
            v.packets
            for k, v in self.values.items()
            if (endpoint_id is None or k.endpoint_id == endpoint_id)
            and (reason is None or k.reason is reason)
            and (direction is None or k.direction is direction)
        )


@dataclasses.dataclass(frozen=True)
class PolicyChange:
    """What a policy write did to the kernel map (in LPM prefixes, not entries)."""

    added: int
    removed: int
    enforcement_changed: bool

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.enforcement_changed)


# --- endpoints ------------------------------------------------------------------------------


class Label(NamedTuple):
    """One pod label as ``source:key=value`` (a plain tuple, so endpoint state files stay lists)."""

    source: str
    key: str
    value: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Address:
    """One pod address as IPAMService allocated it."""

    ip: str
    #: The node pod CIDR the address belongs to, e.g. "10.244.0.0/24".
    cidr: str
    #: The gateway of that CIDR (its first address), the pod's default route.
    gateway: str
    #: 4 or 6.
    family: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class IpAllocation:
    """An address IPAMService holds for an owner on this node."""

    owner: str
    address: Address


@dataclasses.dataclass(frozen=True, kw_only=True)
class PortRecord:
    """A container port of a pod (named ones reach the ipcache for named-port policies)."""

    name: str
    port: int
    #: IP protocol number (6 TCP, 17 UDP, 132 SCTP).
    protocol: int


class EndpointState(StrEnum):
    """Where an endpoint's policy stands (the values are the metrics' ``state`` label)."""

    #: Its identity's policy is not known yet (before the first resync).
    WAITING = "waiting"
    #: Its map holds its identity's policy at ``realized_revision``.
    READY = "ready"
    #: Its map is being written.
    REGENERATING = "regenerating"
    #: Re-adopted after a restart; the pinned map enforces what it held until the resync.
    RESTORING = "restoring"
    #: A write failed; the error says why and the periodic repair retries.
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointRequest:
    """A CreateEndpoint request, translated at the service edge."""

    namespace: str
    pod: str
    #: Path of an existing network namespace to adopt; empty creates one.
    netns: str = ""
    #: The pod's labels, when it is not known to the bus; empty resolves it via IdentityService.
    labels: tuple[Label, ...] = ()
    ports: tuple[PortRecord, ...] = ()
    #: 4 and/or 6; empty means IPv4 only.
    families: tuple[int, ...] = ()
    #: Exact addresses asked for (one per family); empty lets IPAM pick.
    ips: tuple[str, ...] = ()
    #: Reserve ``ips`` even outside the node's pod CIDR.
    outside_pool: bool = False
    #: The container runtime's sandbox id (CNI); an endpoint of the same id or pod is replaced.
    container_id: str = ""
    #: The pod-side interface to create (empty: eth0).
    ifname: str = ""
    #: Chained CNI: the host-side veth another plugin made; attached to, never deleted.
    adopt_host_ifname: str = ""
    #: Start with the init identity while the pod is unknown, instead of failing.
    init_identity: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pod}"


# --- orders and resyncs -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FqdnRule:
    """Egress to the addresses learned for names ``selector`` matches (a ``toFQDNs`` rule)."""

    #: Lower-case, no trailing dot: an exact name or a pattern (``*`` any name, ``*`` in a label).
    selector: str
    #: ANY with ports 0-0: every port.
    protocol: L4Proto = L4Proto.ANY
    port_low: int = 0
    port_high: int = 0
    #: ALLOW, or AUDIT_ALLOW for a policy in audit mode.
    verdict: Verdict = Verdict.ALLOW

    def entry(self, remote_identity: int) -> PolicyEntry:
        """The egress entry this rule gives a learned address's identity."""
        key = PolicyKey(Direction.EGRESS, remote_identity, self.protocol, self.port_low, self.port_high)
        return PolicyEntry(key, self.verdict)


@dataclasses.dataclass(frozen=True)
class DnsRule:
    """DNS traffic the node's proxy must see: queries to this server and port, names allowed."""

    #: The DNS server's identity; 0: any.
    remote_identity: int
    protocol: L4Proto
    port: int
    #: Selectors in ``FqdnRule.selector``'s form; a query must match one.
    selectors: tuple[str, ...] = ()
    #: Of a policy in audit mode: a name it does not allow is forwarded and reported, not refused.
    audit: bool = False


@dataclasses.dataclass(frozen=True)
class NameRules:
    """One identity's FQDN and DNS rules: what its pods may resolve and reach by name."""

    fqdn: tuple[FqdnRule, ...] = ()
    dns: tuple[DnsRule, ...] = ()


#: An identity without name rules.
NO_NAMES = NameRules()


@dataclasses.dataclass(frozen=True)
class IdentityPolicyDiff:
    """A change of one identity's policy: ``full`` replaces it; otherwise removes, then adds."""

    identity: int
    enforcement: Enforcement
    add: tuple[PolicyEntry, ...] = ()
    remove: tuple[PolicyKey, ...] = ()
    full: bool = False
    #: The identity's name rules when they changed (they replace the node's whole set); None: unchanged.
    names: NameRules | None = None


@dataclasses.dataclass(frozen=True)
class PolicySnapshot:
    """One identity's whole policy, as a resync (or a replace order) gives it."""

    identity: int
    enforcement: Enforcement
    entries: tuple[PolicyEntry, ...] = ()
    names: NameRules = NO_NAMES


@dataclasses.dataclass(frozen=True)
class ResyncState:
    """The node's whole policy at an order sequence: the answer to a resync."""

    sequence: int
    revision: int
    policies: tuple[PolicySnapshot, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Order:
    """One regeneration order, or one chunk of it, as received."""

    sequence: int
    revision: int
    node: str = ""
    diffs: tuple[IdentityPolicyDiff, ...] = ()
    #: Chunk index and count (``chunks`` <= 1: not chunked).
    chunk: int = 0
    chunks: int = 0
    #: Fetch the node's state with a resync instead (also set for an order that could not be read).
    fetch: bool = False
    #: Identities the node no longer hosts.
    removed: tuple[int, ...] = ()
    #: The diffs are the node's whole state.
    replace: bool = False


@dataclasses.dataclass(frozen=True)
class OrderBatch:
    """A complete order (all chunks) ready to apply."""

    sequence: int
    revision: int
    diffs: tuple[IdentityPolicyDiff, ...]
    #: When the order's first chunk reached this node (time.monotonic()).
    arrived: float = 0.0
    #: Identities the node no longer hosts: their policy is dropped.
    removed: tuple[int, ...] = ()
    #: The diffs are the node's whole state (applied like a resync answer).
    replace: bool = False

    def as_resync(self) -> ResyncState:
        """The state a ``replace`` order stands for: each identity's full policy. Pure."""
        return ResyncState(
            self.sequence,
            self.revision,
            tuple(PolicySnapshot(d.identity, d.enforcement, d.add) for d in self.diffs),
        )


@dataclasses.dataclass(frozen=True)
class Realized:
    """One endpoint's realized revision, to report; with ``error``, the revision it failed to realize."""

    endpoint_id: int
    identity: int
    revision: int
    pod: str
    error: str = ""


# -- services (load-balancing) ------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Frontend:
    """Where a service is reached: a ClusterIP, a port and TCP, UDP or SCTP."""

    address: str
    port: int
    protocol: L4Proto

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}/{self.protocol.value.upper()}"


@dataclasses.dataclass(frozen=True, order=True)
class Backend:
    """A ready endpoint of a service: the pod address and the resolved target port."""

    address: str
    port: int


@dataclasses.dataclass(frozen=True)
class LbService:
    """One frontend and the backends connections to it are spread over."""

    frontend: Frontend
    backends: tuple[Backend, ...] = ()
    #: ClientIP session affinity timeout in seconds; 0 is no affinity.
    affinity_timeout: int = 0


@dataclasses.dataclass(frozen=True)
class LbState:
    """A frontend as the kernel maps hold it: its service id and backends by backend id."""

    frontend: Frontend
    id: int
    backends: dict[int, Backend]
    affinity_timeout: int = 0
