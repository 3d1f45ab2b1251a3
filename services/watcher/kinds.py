"""The eight Kubernetes kinds Palisade watches: where the API serves them and how they are named on the bus.

Pure data: nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from palisade.v1 import k8s_pb2


class Kind(enum.StrEnum):
    """A watched kind; the value is its subject token (see the K8sKind comments in k8s.proto)."""

    NAMESPACE = "namespace"
    POD = "pod"
    NODE = "node"
    NETWORK_POLICY = "networkpolicy"
    CILIUM_NETWORK_POLICY = "ciliumnetworkpolicy"
    CILIUM_CLUSTERWIDE_NETWORK_POLICY = "ciliumclusterwidenetworkpolicy"
    SERVICE = "service"
    ENDPOINT_SLICE = "endpointslice"


@dataclass(frozen=True, slots=True)
class KindInfo:
    """Where and how one kind is served by the Kubernetes API."""

    kind: Kind
    #: The proto enum value carried in K8sDelta.kind.
    proto: k8s_pb2.K8sKind.ValueType
    #: ``kind`` as written in objects, e.g. "NetworkPolicy".
    api_kind: str
    #: API group; "" is the core group.
    group: str
    version: str
    plural: str
    namespaced: bool
    #: Served by a CustomResourceDefinition that may not be installed.
    custom: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_path(self) -> str:
        """The cluster-wide collection path (all namespaces for namespaced kinds)."""
        if self.group:
            return f"/apis/{self.group}/{self.version}/{self.plural}"
        return f"/api/{self.version}/{self.plural}"


KINDS: tuple[KindInfo, ...] = (
    KindInfo(Kind.NAMESPACE, k8s_pb2.K8S_KIND_NAMESPACE, "Namespace", "", "v1", "namespaces", namespaced=False),
    KindInfo(Kind.POD, k8s_pb2.K8S_KIND_POD, "Pod", "", "v1", "pods", namespaced=True),
    KindInfo(Kind.NODE, k8s_pb2.K8S_KIND_NODE, "Node", "", "v1", "nodes", namespaced=False),
    KindInfo(
        Kind.NETWORK_POLICY,
        k8s_pb2.K8S_KIND_NETWORK_POLICY,
        "NetworkPolicy",
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        namespaced=True,
    ),
    KindInfo(
        Kind.CILIUM_NETWORK_POLICY,
        k8s_pb2.K8S_KIND_CILIUM_NETWORK_POLICY,
        "CiliumNetworkPolicy",
        "cilium.io",
        "v2",
        "ciliumnetworkpolicies",
        namespaced=True,
        custom=True,
    ),
    KindInfo(
        Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY,
        k8s_pb2.K8S_KIND_CILIUM_CLUSTERWIDE_NETWORK_POLICY,
        "CiliumClusterwideNetworkPolicy",
        "cilium.io",
        "v2",
        "ciliumclusterwidenetworkpolicies",
        namespaced=False,
        custom=True,
    ),
    KindInfo(Kind.SERVICE, k8s_pb2.K8S_KIND_SERVICE, "Service", "", "v1", "services", namespaced=True),
    KindInfo(
        Kind.ENDPOINT_SLICE,
        k8s_pb2.K8S_KIND_ENDPOINT_SLICE,
        "EndpointSlice",
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        namespaced=True,
    ),
)

BY_KIND: dict[Kind, KindInfo] = {info.kind: info for info in KINDS}
BY_PROTO: dict[int, KindInfo] = {int(info.proto): info for info in KINDS}
_BY_GROUP_KIND: dict[tuple[str, str], KindInfo] = {(info.group, info.api_kind): info for info in KINDS}


def api_group(api_version: str) -> str:
    """The group of an apiVersion: "v1" -> "", "cilium.io/v2" -> "cilium.io"."""
    group, _, _ = api_version.rpartition("/")
    return group


def lookup(api_version: str, api_kind: str) -> KindInfo | None:
    """The watched kind an object's apiVersion/kind denotes, or None if Palisade does not watch it.

    Any version of the right group matches, so older manifests (e.g. cilium.io/v2alpha1)
    still reach the policy service, which judges the version itself.
    """
    return _BY_GROUP_KIND.get((api_group(api_version), api_kind))
