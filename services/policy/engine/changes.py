"""The engine's inputs, in its own types: what the service's edge decodes each message into.

The policy service receives Kubernetes deltas, identity updates and ipcache entries
as protobufs on the bus; ``services.policy.wire`` turns them into these before
anything here sees them, so the engine never knows a wire format or a subject.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.labels import LabelSet
from services.policy.engine.model import PolicyKind


class ObjectKind(enum.StrEnum):
    """The Kubernetes kinds the engine takes in (``OTHER``: any kind it ignores)."""

    NETWORK_POLICY = PolicyKind.NETWORK_POLICY.value
    CILIUM_NETWORK_POLICY = PolicyKind.CILIUM_NETWORK_POLICY.value
    CILIUM_CLUSTERWIDE_NETWORK_POLICY = PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY.value
    SERVICE = "Service"
    ENDPOINT_SLICE = "EndpointSlice"
    NODE = "Node"
    #: For its audit annotation (``policy.palisade.io/mode``) only.
    NAMESPACE = "Namespace"
    OTHER = ""

    @property
    def policy_kind(self) -> PolicyKind | None:
        """The policy kind this is, or None for kinds that are not policies."""
        try:
            return PolicyKind(self.value)
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class ObjectDelta:
    """One Kubernetes object changed (or was deleted), its body decoded from JSON."""

    kind: ObjectKind
    namespace: str
    name: str
    deleted: bool = False
    #: The object's JSON text as received (what a rejected policy shows).
    text: str = ""
    #: The decoded JSON value (None when deleted or when ``error`` is set).
    body: object = None
    #: Why the text is not JSON ("" when it is).
    error: str = ""
    #: Where the object came from ("" means kubernetes) and which file or document of it.
    source: str = ""
    origin: str = ""
    #: Another object of the same name that this one shadows or is shadowed by.
    conflict: str = ""


@dataclass(frozen=True, slots=True)
class IdentityChange:
    """An identity allocated, relabelled or released."""

    number: int
    labels: LabelSet = field(default_factory=LabelSet)
    deleted: bool = False
