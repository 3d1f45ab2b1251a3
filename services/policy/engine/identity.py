"""Identities as the engine sees them, reserved identities, entities, and a local allocator.

An identity is a number plus a label set. Cluster identities are 256-65535
(allocated by ipam); reserved identities keep Cilium's numbers; CIDR identities
are local to a node in Cilium (``1 << 24`` and up) and this allocator follows
that so they never collide with cluster identities.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.common.labels import (
    CLUSTER_NAME_DEFAULT,
    CLUSTER_RESERVED_IDENTITIES,
    LABEL_POLICY_CLUSTER,
    Label,
    LabelSet,
    LabelSource,
    ReservedIdentity,
    cidr_identity_labels,
    reserved_labels,
)
from services.policy.engine.model import IPAddress, IPNetwork, IpProto
from services.policy.engine.selector import EndpointSelector, Operator, Requirement, Selector

MIN_CLUSTER_IDENTITY = 256
MAX_CLUSTER_IDENTITY = 65535
LOCAL_IDENTITY_FLAG = 1 << 24

#: Reserved identities an engine knows from the start.
DEFAULT_RESERVED = CLUSTER_RESERVED_IDENTITIES

_WORLD_PREFIXES: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/0"),
    ipaddress.ip_network("::/0"),
)


@dataclass(frozen=True, slots=True)
class Identity:
    """A numeric identity and its labels."""

    id: int
    labels: LabelSet

    @property
    def prefixes(self) -> tuple[IPNetwork, ...]:
        """Prefixes this identity stands for: its ``cidr:`` labels; world is ``/0``."""
        return prefixes_of(self.id, self.labels)

    @property
    def is_endpoint(self) -> bool:
        """Whether policy is computed *for* this identity (a pod, health or init)."""
        return (
            MIN_CLUSTER_IDENTITY <= self.id <= MAX_CLUSTER_IDENTITY
            or self.id in (ReservedIdentity.HEALTH, ReservedIdentity.INIT)
        ) and not self.labels.has_source(LabelSource.CIDR)


def prefixes_of(identity: int, labels: LabelSet) -> tuple[IPNetwork, ...]:
    if identity in (ReservedIdentity.WORLD, ReservedIdentity.WORLD_IPV4):
        return _WORLD_PREFIXES if identity == ReservedIdentity.WORLD else _WORLD_PREFIXES[:1]
    if identity == ReservedIdentity.WORLD_IPV6:
        return _WORLD_PREFIXES[1:]
    out: list[IPNetwork] = []
    for label in labels:
        if label.source == LabelSource.CIDR:
            text = label.key
            if "-" in text:
                text = text.replace("-", ":")
            try:
                out.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                continue
    return tuple(out)


@dataclass(frozen=True, slots=True)
class IdentityState:
    """An identity plus what the ipcache and pods say about it.

    ``ips``: endpoint addresses mapped to this identity (for ipBlock/CIDR
    selection). ``named_ports``: union over its pods of container port name ->
    {(protocol, number)}.
    """

    identity: Identity
    ips: frozenset[IPAddress] = frozenset()
    named_ports: Mapping[str, frozenset[tuple[IpProto, int]]] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return self.identity.id

    @property
    def labels(self) -> LabelSet:
        return self.identity.labels

    @property
    def prefixes(self) -> tuple[IPNetwork, ...]:
        return self.identity.prefixes


def reserved_identity(which: ReservedIdentity) -> Identity:
    return Identity(int(which), reserved_labels(which))


def _reserved_sel(name: str) -> EndpointSelector:
    return EndpointSelector((Requirement(LabelSource.RESERVED, name, Operator.EXISTS),))


#: The entities that are reserved identities inside the cluster: each selects its own, and
#: ``cluster`` selects them all (with the cluster's endpoints).
IN_CLUSTER_ENTITIES = ("host", "remote-node", "kube-apiserver", "ingress", "init", "health", "unmanaged")
#: Entity names accepted in from/toEntities.
ENTITIES = ("all", "world", "world-ipv4", "world-ipv6", "cluster", *IN_CLUSTER_ENTITIES, "none")


def entity_selectors(entity: str, *, cluster: str = CLUSTER_NAME_DEFAULT) -> tuple[Selector, ...] | None:
    """Selectors for an entity; ``None`` means every identity (``all``).

    ``cluster`` is every endpoint of this cluster plus the reserved in-cluster
    identities, as in Cilium; ``world`` selects ``reserved:world`` which CIDR
    identities carry too. Raises KeyError for an unknown entity.
    """
    if entity == "all":
        return None
    if entity == "none":
        return ()
    if entity in ("world", "world-ipv4", "world-ipv6"):
        return (_reserved_sel("world"),)
    if entity == "cluster":
        return (
            EndpointSelector((Requirement(LabelSource.K8S, LABEL_POLICY_CLUSTER, Operator.IN, (cluster,)),)),
            *(_reserved_sel(n) for n in IN_CLUSTER_ENTITIES),
        )
    if entity in ENTITIES:
        return (_reserved_sel(entity),)
    raise KeyError(entity)


class LocalAllocator:
    """Pure in-memory identity allocator for offline use (``analyze``, tests).

    Same labels, same identity; cluster identities from 256, CIDR identities
    from ``1 << 24``. Reserved identities are pre-populated.
    """

    def __init__(self) -> None:
        self._by_labels: dict[LabelSet, Identity] = {}
        self._next_cluster = MIN_CLUSTER_IDENTITY
        self._next_local = LOCAL_IDENTITY_FLAG + 1
        for r in DEFAULT_RESERVED:
            ident = reserved_identity(r)
            self._by_labels[ident.labels] = ident

    def allocate(self, labels: LabelSet) -> Identity:
        found = self._by_labels.get(labels)
        if found is not None:
            return found
        if labels.has_source(LabelSource.CIDR):
            number = self._next_local
            self._next_local += 1
        else:
            if self._next_cluster > MAX_CLUSTER_IDENTITY:
                raise RuntimeError("cluster identity space exhausted")
            number = self._next_cluster
            self._next_cluster += 1
        ident = Identity(number, labels)
        self._by_labels[labels] = ident
        return ident

    def allocate_cidr(self, prefix: IPNetwork | str) -> Identity:
        return self.allocate(cidr_identity_labels(prefix))

    def lookup(self, labels: LabelSet) -> Identity | None:
        return self._by_labels.get(labels)

    def identities(self) -> Iterable[Identity]:
        return sorted(self._by_labels.values(), key=lambda i: i.id)


def label(source: str, key: str, value: str = "") -> Label:
    """Shorthand used by tests and callers building label sets by hand."""
    return Label(source, key, value)
