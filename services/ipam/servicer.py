"""gRPC front of ipam: IdentityService and IPAMService. Translation only, no logic.

Allocator errors carry the status code to answer with (:mod:`services.ipam.errors`);
an etcd outage longer than the store's patience is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc

from palisade.v1 import identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc
from services.common.log import get_logger
from services.ipam import metrics
from services.ipam.errors import ErrorCode, IpamError
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocation, IPAllocator
from services.ipam.kv import StoreError, StoreUnavailable
from services.ipam.model import RESERVED, carries, labels_from_proto, reserved_identity
from services.ipam.nodecidr import CIDRSource, NodeRecord
from services.ipam.pods import OwnerChanged, PodManager, ReferenceChanged
from services.ipam.podwatch import named_ports_from_proto
from services.ipam.publish import IdentityPublisher

log = get_logger("grpc")

T = TypeVar("T")

_FAMILY = {4: ipam_pb2.FAMILY_IPV4, 6: ipam_pb2.FAMILY_IPV6}
_FAMILY_IN = {ipam_pb2.FAMILY_IPV4: 4, ipam_pb2.FAMILY_IPV6: 6}
_SOURCE = {
    CIDRSource.NODE_SPEC: ipam_pb2.CIDR_SOURCE_NODE_SPEC,
    CIDRSource.ANNOTATION: ipam_pb2.CIDR_SOURCE_ANNOTATION,
    CIDRSource.POOL: ipam_pb2.CIDR_SOURCE_POOL,
}


async def _abort(context: grpc.aio.ServicerContext, code: str, message: str) -> NoReturn:
    await context.abort(getattr(grpc.StatusCode, code), message)
    raise AssertionError("abort returned")  # abort always raises


async def _call(context: grpc.aio.ServicerContext, method: str, body: Callable[[], Awaitable[T]]) -> T:
    started = time.perf_counter()
    code = "UNKNOWN"  # what grpc answers for an unexpected exception
    try:
        result = await body()
        code = "OK"
        return result
    except IpamError as exc:
        code = exc.code.value
        await _abort(context, code, exc.message)
    except StoreUnavailable as exc:
        code = ErrorCode.UNAVAILABLE.value
        await _abort(context, code, str(exc))
    except StoreError as exc:
        code = "INTERNAL"
        log.error("etcd refused a request", method=method, error=str(exc))
        await _abort(context, code, f"{exc}; this is a bug or a misconfigured etcd, see ipam logs")
    except asyncio.CancelledError:
        code = "CANCELLED"
        raise
    finally:
        metrics.served(method, code, time.perf_counter() - started)


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
        async def body() -> identity_pb2.AllocateIdentityResponse:
            result = await self._allocator.allocate(labels_from_proto(request.labels), request.node, request.owner)
            if result.revision:
                await self._publisher.seen(result.identity, result.revision)
                self._pods.submit(ReferenceChanged(request.node, request.owner, held=True))
            refs = await self._allocator.references(result.identity.id) if result.revision else 0
            return identity_pb2.AllocateIdentityResponse(identity=result.identity.to_proto(refs), new=result.new)

        return await _call(context, "AllocateIdentity", body)

    async def ReleaseIdentity(
        self, request: identity_pb2.ReleaseIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ReleaseIdentityResponse:
        async def body() -> identity_pb2.ReleaseIdentityResponse:
            if any(int(r) == request.id for r in RESERVED):
                raise IpamError(
                    ErrorCode.INVALID_ARGUMENT, f"identity {request.id} is reserved and holds no references"
                )
            last = await self._allocator.release(request.id, request.node, request.owner)
            self._pods.submit(ReferenceChanged(request.node, request.owner, held=False))
            return identity_pb2.ReleaseIdentityResponse(last_reference=last)

        return await _call(context, "ReleaseIdentity", body)

    async def GetIdentity(
        self, request: identity_pb2.GetIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.Identity:
        async def body() -> identity_pb2.Identity:
            found = await self._allocator.get(request.id)
            if found is None:
                raise IpamError(
                    ErrorCode.NOT_FOUND,
                    f"identity {request.id} does not exist; ListIdentities shows the allocated ones",
                )
            refs = 0 if request.id < 256 else await self._allocator.references(request.id)
            return found.to_proto(refs)

        return await _call(context, "GetIdentity", body)

    async def ListIdentities(
        self, request: identity_pb2.ListIdentitiesRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ListIdentitiesResponse:
        async def body() -> identity_pb2.ListIdentitiesResponse:
            selector = labels_from_proto(request.selector)
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

        return await _call(context, "ListIdentities", body)

    async def ResolvePod(
        self, request: identity_pb2.ResolvePodRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ResolvePodResponse:
        async def body() -> identity_pb2.ResolvePodResponse:
            found = self._pods.resolve(request.namespace, request.name)
            if found is None:
                raise IpamError(
                    ErrorCode.NOT_FOUND,
                    f"pod {request.namespace}/{request.name} is unknown; is it created and is the watcher running?",
                )
            if found.identity is None:
                raise IpamError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"pod {request.namespace}/{request.name} has no identity: {found.reason}",
                )
            refs = await self._allocator.references(found.identity.id)
            return identity_pb2.ResolvePodResponse(
                identity=found.identity.to_proto(refs), ips=list(found.ips), node=found.node
            )

        return await _call(context, "ResolvePod", body)


class IPAMServicer(ipam_pb2_grpc.IPAMServiceServicer):
    def __init__(self, ipalloc: IPAllocator, pods: PodManager) -> None:
        self._ipalloc = ipalloc
        self._pods = pods

    async def AllocateIP(
        self, request: ipam_pb2.AllocateIPRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.IPAllocation:
        async def body() -> ipam_pb2.IPAllocation:
            family = _FAMILY_IN.get(request.family)
            ports = named_ports_from_proto(request.named_ports)
            result = await self._ipalloc.allocate(request.node, request.owner, family, request.ip)
            self._pods.submit(OwnerChanged(result.node, result.owner, ports))
            return allocation_proto(result)

        return await _call(context, "AllocateIP", body)

    async def ReleaseIP(
        self, request: ipam_pb2.ReleaseIPRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.ReleaseIPResponse:
        async def body() -> ipam_pb2.ReleaseIPResponse:
            result = await self._ipalloc.release(request.node, request.ip, request.owner)
            self._pods.submit(OwnerChanged(result.node, result.owner))
            return ipam_pb2.ReleaseIPResponse()

        return await _call(context, "ReleaseIP", body)

    async def GetNodeCIDR(
        self, request: ipam_pb2.GetNodeCIDRRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.NodeCIDR:
        async def body() -> ipam_pb2.NodeCIDR:
            return node_proto(await self._ipalloc.node_cidrs(request.node))

        return await _call(context, "GetNodeCIDR", body)

    async def ListAllocations(
        self, request: ipam_pb2.ListAllocationsRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.ListAllocationsResponse:
        async def body() -> ipam_pb2.ListAllocationsResponse:
            allocations, nodes = self._ipalloc.list(request.node)
            return ipam_pb2.ListAllocationsResponse(
                allocations=[allocation_proto(a) for a in allocations], nodes=[node_proto(n) for n in nodes]
            )

        return await _call(context, "ListAllocations", body)
