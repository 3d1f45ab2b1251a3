"""The datapath's client of IdentityService and IPAMService.

:class:`IpamPort` is what the endpoint manager needs, in the datapath's own types;
:class:`GrpcIpam` implements it over one gRPC channel, translating replies with
``wire`` and every failed call into :class:`UpstreamError` with the status code the
service answered, so the manager never imports grpc.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

import grpc

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc
from services.common.errors import Code
from services.datapath import types as dt
from services.datapath import wire
from services.datapath.errors import UpstreamError

T = TypeVar("T")


class IpamPort(Protocol):
    """What the datapath needs from IdentityService and IPAMService; failures raise :class:`UpstreamError`."""

    async def allocate_identity(self, labels: Sequence[dt.Label], node: str, owner: str) -> int: ...

    async def release_identity(self, identity: int, node: str, owner: str) -> None: ...

    async def resolve_pod(self, namespace: str, name: str) -> int: ...

    async def allocate_ip(
        self, node: str, owner: str, family: int, ip: str = "", ports: Sequence[dt.PortRecord] = ()
    ) -> dt.Address:
        """An address of ``family`` (4 or 6) for ``owner``, exactly ``ip`` when given.

        ``ports`` are the pod's container ports (the named ones reach the ipcache).
        """
        ...

    async def release_ip(self, node: str, ip: str, owner: str) -> None: ...

    async def allocations(self, node: str) -> list[dt.Allocation]: ...


def upstream_code(code: grpc.StatusCode) -> Code:
    """The :class:`Code` of a gRPC status (INTERNAL for the ones Palisade never answers with)."""
    return Code.__members__.get(code.name, Code.INTERNAL)


async def _call(service: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise UpstreamError(service, exc.details() or exc.code().name, upstream_code(exc.code())) from None


class GrpcIpam:
    """IdentityService and IPAMService over one gRPC channel."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self._identity = identity_pb2_grpc.IdentityServiceStub(channel)
        self._ipam = ipam_pb2_grpc.IPAMServiceStub(channel)
        self._timeout = timeout

    async def allocate_identity(self, labels: Sequence[dt.Label], node: str, owner: str) -> int:
        request = identity_pb2.AllocateIdentityRequest(
            labels=[wire.label_to_proto(x) for x in labels], node=node, owner=owner
        )
        response = await _call("IdentityService", self._identity.AllocateIdentity(request, timeout=self._timeout))
        return int(response.identity.id)

    async def release_identity(self, identity: int, node: str, owner: str) -> None:
        request = identity_pb2.ReleaseIdentityRequest(id=identity, node=node, owner=owner)
        await _call("IdentityService", self._identity.ReleaseIdentity(request, timeout=self._timeout))

    async def resolve_pod(self, namespace: str, name: str) -> int:
        request = identity_pb2.ResolvePodRequest(namespace=namespace, name=name)
        response = await _call("IdentityService", self._identity.ResolvePod(request, timeout=self._timeout))
        return int(response.identity.id)

    async def allocate_ip(
        self, node: str, owner: str, family: int, ip: str = "", ports: Sequence[dt.PortRecord] = ()
    ) -> dt.Address:
        request = ipam_pb2.AllocateIPRequest(node=node, owner=owner, family=wire.family_to_proto(family), ip=ip)
        for port in ports:
            if port.name and port.name not in request.named_ports:  # the first of a name wins, as in a pod spec
                request.named_ports[port.name].port = port.port
                request.named_ports[port.name].protocol = port.protocol or common_pb2.PROTOCOL_TCP  # type: ignore[assignment]
        response = await _call("IPAMService", self._ipam.AllocateIP(request, timeout=self._timeout))
        return wire.address_from_proto(response)

    async def release_ip(self, node: str, ip: str, owner: str) -> None:
        request = ipam_pb2.ReleaseIPRequest(node=node, ip=ip, owner=owner)
        await _call("IPAMService", self._ipam.ReleaseIP(request, timeout=self._timeout))

    async def allocations(self, node: str) -> list[dt.Allocation]:
        request = ipam_pb2.ListAllocationsRequest(node=node)
        response = await _call("IPAMService", self._ipam.ListAllocations(request, timeout=self._timeout))
        return [wire.allocation_from_proto(a) for a in response.allocations]
