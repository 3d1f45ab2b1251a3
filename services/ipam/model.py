"""Identities as ipam hands them out: numbering ranges and label-set classification. Pure.

Cluster identities (label sets of pods) are numbered 256-65535 as in Cilium;
reserved identities keep Cilium's fixed numbers and are never stored; CIDR
identities (a ``cidr:`` label plus ``reserved:world``) are numbered from
``1 << 24`` like Cilium's local identities, so they never collide with cluster
identities, but ipam allocates them cluster-wide so every node agrees.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress

from palisade.v1 import common_pb2, identity_pb2
from services.common.errors import Code
from services.common.labels import (
    CLUSTER_RESERVED_IDENTITIES,
    Label,
    LabelSet,
    LabelSource,
    ReservedIdentity,
    cidr_identity_labels,
    filter_identity_labels,
)
from services.ipam.errors import IpamError

MIN_CLUSTER_ID = 256
MAX_CLUSTER_ID = 65535
MIN_CIDR_ID = 1 << 24
MAX_CIDR_ID = (1 << 25) - 1

#: Reserved identities ipam answers for (Cilium's numbers 1-7).
RESERVED = CLUSTER_RESERVED_IDENTITIES
_RESERVED_BY_KEY = {r.label_key: r for r in RESERVED}


class Kind(enum.StrEnum):
    RESERVED = "reserved"
    CLUSTER = "cluster"
    CIDR = "cidr"

    def to_proto(self) -> identity_pb2.IdentityKind.ValueType:
        return {
            Kind.RESERVED: identity_pb2.IDENTITY_KIND_RESERVED,
            Kind.CLUSTER: identity_pb2.IDENTITY_KIND_CLUSTER,
            Kind.CIDR: identity_pb2.IDENTITY_KIND_CIDR,
        }[self]


@dataclasses.dataclass(frozen=True, slots=True)
class IdRange:
    """The numbers one kind of identity is allocated from (inclusive)."""

    low: int
    high: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.low <= value <= self.high

    @property
    def size(self) -> int:
        return self.high - self.low + 1


CLUSTER_RANGE = IdRange(MIN_CLUSTER_ID, MAX_CLUSTER_ID)
CIDR_RANGE = IdRange(MIN_CIDR_ID, MAX_CIDR_ID)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    id: int
    labels: LabelSet

    @property
    def kind(self) -> Kind:
        return kind_of(self.id)

    @property
    def cidr(self) -> str:
        """The prefix of a CIDR identity ("" otherwise)."""
        for label in self.labels:
            if label.source == LabelSource.CIDR:
                return cidr_of(label)
        return ""

    def to_proto(self, references: int = 0) -> identity_pb2.Identity:
        return identity_pb2.Identity(
            id=self.id,
            labels=[common_pb2.Label(source=x.source, key=x.key, value=x.value) for x in self.labels],
            kind=self.kind.to_proto(),
            cidr=self.cidr,
            references=references,
        )


def kind_of(identity: int) -> Kind:
    if identity in CIDR_RANGE:
        return Kind.CIDR
    if identity < MIN_CLUSTER_ID:
        return Kind.RESERVED
    return Kind.CLUSTER


def cidr_of(label: Label) -> str:
    """The prefix a ``cidr:`` label names (IPv6 is written with ``-`` for ``:`` in labels)."""
    text = label.key
    if "-" in text:
        text = text.replace("-", ":")
    return str(ipaddress.ip_network(text, strict=False))


def reserved_identity(identity: ReservedIdentity) -> Identity:
    return Identity(int(identity), LabelSet((Label(LabelSource.RESERVED, identity.label_key),)))


def classify(raw: LabelSet) -> tuple[Kind, LabelSet, Identity | None]:
    """Filter a requested label set and say what kind of identity it is.

    Returns (kind, identity labels, the reserved identity when kind is RESERVED).
    Like Cilium, ``reserved:host`` anywhere makes the host identity, and a lone
    reserved label its reserved identity. Raises INVALID_ARGUMENT for what cannot
    be an identity.
    """
    labels = filter_identity_labels(raw)
    if not labels:
        raise IpamError(
            "no identity-relevant labels given; pass the pod's labels (e.g. k8s:app=web)",
            Code.INVALID_ARGUMENT,
        )
    reserved = [x for x in labels if x.source == LabelSource.RESERVED]
    cidrs = [x for x in labels if x.source == LabelSource.CIDR]
    if cidrs:
        if len(cidrs) > 1:
            raise IpamError(
                f"a CIDR identity has exactly one cidr: label, got {len(cidrs)}; allocate one identity per prefix",
                Code.INVALID_ARGUMENT,
            )
        try:
            prefix = cidr_of(cidrs[0])
        except ValueError:
            raise IpamError(
                f"label {cidrs[0]} does not name a prefix; use e.g. cidr:10.0.0.0/8", Code.INVALID_ARGUMENT
            ) from None
        others = [x for x in labels if x.source not in (LabelSource.CIDR, LabelSource.RESERVED)]
        if others or any(x.key != ReservedIdentity.WORLD.label_key for x in reserved):
            raise IpamError(
                "a CIDR identity carries only its cidr: label (and reserved:world); drop the other labels",
                Code.INVALID_ARGUMENT,
            )
        return Kind.CIDR, cidr_identity_labels(prefix), None
    if reserved:
        keys = {x.key for x in reserved}
        if ReservedIdentity.HOST.label_key in keys:
            return Kind.RESERVED, labels, reserved_identity(ReservedIdentity.HOST)
        if len(labels) == 1 and reserved[0].key in _RESERVED_BY_KEY:
            return Kind.RESERVED, labels, reserved_identity(_RESERVED_BY_KEY[reserved[0].key])
        raise IpamError(
            f"reserved labels ({', '.join(sorted(str(x) for x in reserved))}) name fixed identities and cannot be "
            "combined with other labels; allocate the reserved label alone or drop it",
            Code.INVALID_ARGUMENT,
        )
    return Kind.CLUSTER, labels, None


def reserved_by_id(identity: int) -> Identity | None:
    for r in RESERVED:
        if int(r) == identity:
            return reserved_identity(r)
    return None


def carries(labels: LabelSet, wanted: Label) -> bool:
    """Whether ``labels`` has ``wanted``; an ``unspec`` or ``any`` source matches every source."""
    source = LabelSource.ANY if wanted.source in (LabelSource.UNSPEC, LabelSource.ANY) else wanted.source
    return any(x.value == wanted.value for x in labels.lookup(source, wanted.key))
