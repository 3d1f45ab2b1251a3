"""Where a policy came from, and how the two sources share one engine without clobbering.

The engine keys policies by :class:`PolicyRef`. A policy imported over gRPC and a
Kubernetes object with the same name must both be enforced and never replace each
other, so API copies enter the engine with ``source="api"`` on their ref.
"""

from __future__ import annotations

import dataclasses
import enum

from services.policy.engine.model import PolicyKind, PolicyRef


class Source(enum.StrEnum):
    KUBERNETES = "kubernetes"
    API = "api"


def engine_key(source: Source, key: PolicyRef) -> PolicyRef:
    """The key a policy has inside the engine: API copies carry their source."""
    if source is Source.API:
        return dataclasses.replace(key, source=Source.API.value)
    return key


def split_engine_key(key: PolicyRef) -> tuple[Source, PolicyRef]:
    """Inverse of :func:`engine_key`."""
    if key.source == Source.API.value:
        return Source.API, dataclasses.replace(key, source="")
    return Source.KUBERNETES, key


_KIND_ALIASES = {
    "networkpolicy": PolicyKind.NETWORK_POLICY,
    "networkpolicies": PolicyKind.NETWORK_POLICY,
    "netpol": PolicyKind.NETWORK_POLICY,
    "ciliumnetworkpolicy": PolicyKind.CILIUM_NETWORK_POLICY,
    "ciliumnetworkpolicies": PolicyKind.CILIUM_NETWORK_POLICY,
    "cnp": PolicyKind.CILIUM_NETWORK_POLICY,
    "ciliumclusterwidenetworkpolicy": PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY,
    "ciliumclusterwidenetworkpolicies": PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY,
    "ccnp": PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY,
}

#: Subject tokens of the policy kinds on ``palisade.k8s.<token>.>``.
KIND_TOKENS = {
    "networkpolicy": PolicyKind.NETWORK_POLICY,
    "ciliumnetworkpolicy": PolicyKind.CILIUM_NETWORK_POLICY,
    "ciliumclusterwidenetworkpolicy": PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY,
}


def parse_kind(text: str) -> PolicyKind | None:
    """A policy kind from its name, plural or short name (case-insensitive); None if unknown."""
    return _KIND_ALIASES.get(text.strip().lower())


def object_key(kind: PolicyKind, namespace: str, name: str) -> PolicyRef:
    """The key of an object as users name it: cluster-wide kinds have no namespace, others default."""
    if kind is PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY:
        return PolicyRef(kind, "", name)
    return PolicyRef(kind, namespace or "default", name)
