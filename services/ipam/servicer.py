"""gRPC front of ipam: IdentityService and IPAMService. Translation only, no logic.

Allocator errors carry the status code to answer with (:mod:`services.ipam.errors`);
an etcd outage longer than the store's patience is UNAVAILABLE.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import grpc

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc
from services.common.access import caller
from services.common.errors import Code, PalisadeError, clip
from services.common.grpcserver import Status
from services.common.labels import CIDR_HOLDER_NODE, labels_from_wire
from services.common.log import get_logger
from services.common.validation import validate_identity_label, validate_name, validate_namespace
from services.ipam.errors import IpamError
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocation, IPAllocator
from services.ipam.kv import StoreError, StoreUnavailable
from services.ipam.model import RESERVED, Kind, carries, classify, kind_of, reserved_identity
from services.ipam.nodecidr import CIDRSource, NodeRecord
from services.ipam.pods import OwnerChanged, PodManager, ReferenceChanged
from services.ipam.podwatch import named_ports_from_proto
from services.ipam.publish import IdentityPublisher

log = get_logger("grpc")


_FAMILY = {4: ipam_pb2.FAMILY_IPV4, 6: ipam_pb2.FAMILY_IPV6}
_FAMILY_IN = {ipam_pb2.FAMILY_IPV4: 4, ipam_pb2.FAMILY_IPV6: 6}
_SOURCE = {
    CIDRSource.NODE_SPEC: ipam_pb2.CIDR_SOURCE_NODE_SPEC,
    CIDRSource.ANNOTATION: ipam_pb2.CIDR_SOURCE_ANNOTATION,
    CIDRSource.POOL: ipam_pb2.CIDR_SOURCE_POOL,
}


_OWNER = re.compile(r"[!-~]{1,512}")


def check_node(node: str, field: str = "node") -> None:
    """A node name, as Kubernetes names nodes (a DNS-1123 subdomain)."""
    validate_name(node, field)


def check_owner(owner: str, field: str = "owner") -> None:
    """Who holds an address or reference, e.g. ``pod/<namespace>/<name>``: printable, no spaces, bounded."""
    if not _OWNER.fullmatch(owner):
        raise PalisadeError(
            f"{field} {clip(repr(owner), 120)} is invalid: must be 1-512 printable characters without spaces, "
            "e.g. pod/<namespace>/<name>",
            Code.INVALID_ARGUMENT,
        )


def check_policy_holder(node: str, kind: Kind) -> None:
    """The policy service holds CIDR identities only, and only under its own pseudo-node."""
    if kind is not Kind.CIDR or node != CIDR_HOLDER_NODE:
        raise IpamError(
            f"the policy service holds only CIDR identities (cidr: labels), on node {CIDR_HOLDER_NODE}; "
            f"got a {kind} identity on node {node!r}",
            Code.PERMISSION_DENIED,
        )


def check_labels(labels: Iterable[common_pb2.Label], field: str) -> None:
    for i, label in enumerate(labels):
        validate_identity_label(label.source, label.key, label.value, f"{field}[{i}]")


def store_status(exc: Exception, method: str) -> Status | None:
    """etcd's failures as the API answers them (the interceptor of ``services.common.grpcserver`` asks)."""
    if isinstance(exc, StoreUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, StoreError):
        log.error("etcd refused a request", method=method, error=str(exc))
        return grpc.StatusCode.INTERNAL, f"{exc}; this is a bug or a misconfigured etcd, see ipam logs"
    return None


def allocation_proto(a: IPAllocation) -> ipam_pb2.IPAllocation:
    return ipam_pb2.IPAllocation(
        ip=a.ip, node=a.node, owner=a.owner, family=_FAMILY[a.family], cidr=a.cidr, gateway=a.gateway
    )


def node_proto(record: NodeRecord) -> ipam_pb2.NodeCIDR:
    return ipam_pb2.NodeCIDR(node=record.node, cidrs=[str(c.cidr) for c in record.cidrs], source=_SOURCE[record.source])


class IdentityServicer(identity_pb2_grpc.IdentityServiceServicer):
    def __init__(self, allocator: IdentityAllocator, publisher: IdentityPublisher, pods: PodManager) -> None:
        self._allocator = allocator
        self._publisher = publisher
        self._pods = pods

    async def AllocateIdentity(
        self, request: identity_pb2.AllocateIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.AllocateIdentityResponse:
        check_labels(request.labels, "labels")
        # Empty node and owner are fine for reserved label sets (no reference); the allocator says when not.
        if request.node:
            check_node(request.node)
        if request.owner:
            check_owner(request.owner)
        labels = labels_from_wire(request.labels)
        if caller(context) == "policy":
            check_policy_holder(request.node, classify(labels)[0])
        result = await self._allocator.allocate(labels, request.node, request.owner)
        if result.revision:
            if result.new:
                await self._publisher.created(result.identity, result.revision)
            else:
                await self._publisher.seen(result.identity, result.revision)
            self._pods.submit(ReferenceChanged(request.node, request.owner, held=True))
        return identity_pb2.AllocateIdentityResponse(
            identity=result.identity.to_proto(result.references), new=result.new
        )

    async def ReleaseIdentity(
        self, request: identity_pb2.ReleaseIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ReleaseIdentityResponse:
        if request.node:
            check_node(request.node)
        if request.owner:
            check_owner(request.owner)
        if any(int(r) == request.id for r in RESERVED):
            raise IpamError(f"identity {request.id} is reserved and holds no references", Code.INVALID_ARGUMENT)
        if caller(context) == "policy":
            check_policy_holder(request.node, kind_of(request.id))
        last = await self._allocator.release(request.id, request.node, request.owner)
        self._pods.submit(ReferenceChanged(request.node, request.owner, held=False))
        return identity_pb2.ReleaseIdentityResponse(last_reference=last)

    async def GetIdentity(
        self, request: identity_pb2.GetIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.Identity:
        found = await self._allocator.get(request.id)
        if found is None:
            raise IpamError(
                f"identity {request.id} does not exist; ListIdentities shows the allocated ones",
                Code.NOT_FOUND,
            )
        refs = 0 if request.id < 256 else await self._allocator.references(request.id)
        return found.to_proto(refs)

    async def ListIdentities(
        self, request: identity_pb2.ListIdentitiesRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ListIdentitiesResponse:
        check_labels(request.selector, "selector")
        selector = labels_from_wire(request.selector)
        identities = await self._allocator.list_all()
        if request.include_reserved:
            identities = [reserved_identity(r) for r in RESERVED] + identities
        counts = await self._allocator.reference_counts()
        out = [
            ident.to_proto(counts.get(ident.id, 0))
            for ident in identities
            if all(carries(ident.labels, wanted) for wanted in selector)
        ]
        return identity_pb2.ListIdentitiesResponse(identities=out)

    async def ResolvePod(
        self, request: identity_pb2.ResolvePodRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ResolvePodResponse:
        validate_namespace(request.namespace, "namespace")
        validate_name(request.name, "name")
        found = self._pods.resolve(request.namespace, request.name)
        if found is None:
            raise IpamError(
                f"pod {request.namespace}/{request.name} is unknown; is it created and is the watcher running?",
                Code.NOT_FOUND,
            )
        if found.identity is None:
            raise IpamError(
                f"pod {request.namespace}/{request.name} has no identity: {found.reason}",
                Code.FAILED_PRECONDITION,
            )
        # The count as the watch keeps it, not read from etcd: a datapath asks this on every CNI
        # ADD, and a read there waited for the address transaction it runs beside (GetIdentity reads).
        refs = self._allocator.known_references(found.identity.id)
        return identity_pb2.ResolvePodResponse(
            identity=found.identity.to_proto(refs), ips=list(found.ips), node=found.node
        )


class IPAMServicer(ipam_pb2_grpc.IPAMServiceServicer):
    def __init__(self, ipalloc: IPAllocator, pods: PodManager) -> None:
        self._ipalloc = ipalloc
        self._pods = pods

    async def AllocateIP(
        self, request: ipam_pb2.AllocateIPRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.IPAllocation:
        check_node(request.node)
        check_owner(request.owner)
        family = _FAMILY_IN.get(request.family)
        ports = named_ports_from_proto(request.named_ports)
        result = await self._ipalloc.allocate(
            request.node, request.owner, family, request.ip, outside_pool=request.outside_pool
        )
        self._pods.submit(OwnerChanged(result.node, result.owner, ports))
        return allocation_proto(result)

    async def ReleaseIP(
        self, request: ipam_pb2.ReleaseIPRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.ReleaseIPResponse:
        check_node(request.node)
        if request.owner:
            check_owner(request.owner)
        result = await self._ipalloc.release(request.node, request.ip, request.owner)
        self._pods.submit(OwnerChanged(result.node, result.owner))
        return ipam_pb2.ReleaseIPResponse()

    async def GetNodeCIDR(
        self, request: ipam_pb2.GetNodeCIDRRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.NodeCIDR:
        check_node(request.node)
        return node_proto(await self._ipalloc.node_cidrs(request.node))

    async def ListAllocations(
        self, request: ipam_pb2.ListAllocationsRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.ListAllocationsResponse:
        if request.node:
            check_node(request.node)
        allocations, nodes = self._ipalloc.list(request.node)
        return ipam_pb2.ListAllocationsResponse(
            allocations=[allocation_proto(a) for a in allocations], nodes=[node_proto(n) for n in nodes]
        )
