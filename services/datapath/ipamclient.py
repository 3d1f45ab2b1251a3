"""The datapath's client of IdentityService and IPAMService.

:class:`IpamPort` is what the endpoint manager needs, in the datapath's own types;
:class:`GrpcIpam` implements it over one gRPC channel, translating replies with
``wire`` and every failed call into :class:`UpstreamError` with the status code the
service answered, so the manager never imports grpc. :class:`NodeIpam` turns those
failures into answers to the request at hand (an endpoint error naming what failed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

import grpc

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc
from services.common.errors import Code
from services.datapath import types as dt
from services.datapath import wire
from services.datapath.addresspick import AddressPicker
from services.datapath.errors import (
    EndpointError,
    EndpointNotFound,
    InvalidRequest,
    UpstreamError,
    UpstreamUnavailable,
)

T = TypeVar("T")


class IpamPort(Protocol):
    """What the datapath needs from IdentityService and IPAMService; failures raise :class:`UpstreamError`."""

    async def allocate_identity(self, labels: Sequence[dt.Label], node: str, owner: str) -> int: ...

    async def release_identity(self, identity: int, node: str, owner: str) -> None: ...

    async def resolve_pod(self, namespace: str, name: str) -> int: ...

    async def allocate_ip(
        self,
        node: str,
        owner: str,
        family: int,
        ip: str = "",
        ports: Sequence[dt.PortRecord] = (),
        *,
        outside_pool: bool = False,
    ) -> dt.Address:
        """An address of ``family`` (4 or 6) for ``owner``, exactly ``ip`` when given.

        ``ports`` are the pod's container ports (the named ones reach the ipcache); ``outside_pool``
        lets ``ip`` lie outside the node's pod CIDR.
        """
        ...

    async def release_ip(self, node: str, ip: str, owner: str) -> None: ...

    async def allocations(self, node: str) -> list[dt.IpAllocation]: ...


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
        self,
        node: str,
        owner: str,
        family: int,
        ip: str = "",
        ports: Sequence[dt.PortRecord] = (),
        *,
        outside_pool: bool = False,
    ) -> dt.Address:
        request = ipam_pb2.AllocateIPRequest(
            node=node, owner=owner, family=wire.family_to_proto(family), ip=ip, outside_pool=outside_pool
        )
        for port in ports:
            if port.name and port.name not in request.named_ports:  # the first of a name wins, as in a pod spec
                request.named_ports[port.name].port = port.port
                request.named_ports[port.name].protocol = port.protocol or common_pb2.PROTOCOL_TCP  # type: ignore[assignment]
        response = await _call("IPAMService", self._ipam.AllocateIP(request, timeout=self._timeout))
        return wire.address_from_proto(response)

    async def release_ip(self, node: str, ip: str, owner: str) -> None:
        request = ipam_pb2.ReleaseIPRequest(node=node, ip=ip, owner=owner)
        await _call("IPAMService", self._ipam.ReleaseIP(request, timeout=self._timeout))

    async def node_cidrs(self, node: str) -> list[str]:
        """The node's pod CIDRs, IPv4 first (ipam assigns them if the node has none yet)."""
        request = ipam_pb2.GetNodeCIDRRequest(node=node)
        response = await _call("IPAMService", self._ipam.GetNodeCIDR(request, timeout=self._timeout))
        return list(response.cidrs)

    async def allocations(self, node: str) -> list[dt.IpAllocation]:
        request = ipam_pb2.ListAllocationsRequest(node=node)
        response = await _call("IPAMService", self._ipam.ListAllocations(request, timeout=self._timeout))
        return [wire.allocation_from_proto(a) for a in response.allocations]


def answer(what: str, exc: UpstreamError) -> EndpointError:
    """The answer to a request whose call to another service failed."""
    if exc.code is Code.INVALID_ARGUMENT:
        return InvalidRequest(f"cannot {what}: {exc.message}")
    if exc.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
        return UpstreamUnavailable(
            f"cannot {what}: {exc.service} is not reachable ({exc.message}); retry when it is up"
        )
    return EndpointError(f"cannot {what}: {exc.code}: {exc.message}", exc.code)


class NodeIpam:
    """IPAM as one node's endpoint manager uses it: each failure becomes an answer naming what failed.

    Every answer for an address of this node teaches :attr:`picker` the node's pod CIDR.
    """

    def __init__(self, port: IpamPort, node: str) -> None:
        self._port = port
        self._node = node
        self.picker = AddressPicker()
        #: Addresses picked here that IPAM recorded, and that it refused (the create then asked it).
        self.picks_recorded = 0
        self.picks_refused = 0

    async def call(self, what: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except UpstreamError as exc:
            raise answer(what, exc) from None

    async def resolve_pod(self, namespace: str, pod: str) -> int:
        try:
            return await self._port.resolve_pod(namespace, pod)
        except UpstreamError as exc:
            if exc.code is Code.NOT_FOUND:
                raise EndpointNotFound(
                    f"pod {namespace}/{pod} is unknown to IdentityService; give its labels in the request, "
                    "or wait until the watcher published the pod"
                ) from None
            raise answer(f"resolve the identity of {namespace}/{pod}", exc) from None

    async def allocate_ip(
        self, owner: str, family: int, ports: Sequence[dt.PortRecord], ip: str = "", *, outside_pool: bool = False
    ) -> dt.Address:
        """The next free address of ``family``, or the one a half-finished earlier create left to ``owner``.

        With ``ip``, exactly that address (reserving it again for the same owner is idempotent).
        """
        if ip:
            address = await self.call(
                f"reserve {ip} for {owner}",
                self._port.allocate_ip(self._node, owner, family, ip, ports, outside_pool=outside_pool),
            )
            self.picker.learn(address, chosen_by_ipam=False)
            return address
        try:
            address = await self._port.allocate_ip(self._node, owner, family, ports=ports)
            self.picker.learn(address, chosen_by_ipam=True)
            return address
        except UpstreamError as exc:
            if exc.code is not Code.ALREADY_EXISTS:
                raise answer(f"allocate an address for {owner}", exc) from None
        # A create that failed half-way (or a crash) left the owner's address allocated: adopt it.
        for alloc in await self.call(f"list allocations of {self._node}", self._port.allocations(self._node)):
            if alloc.owner == owner and alloc.address.family == family:
                # Reserving it again by address is idempotent and hands ipam this request's ports.
                ip = alloc.address.ip
                return await self.call(
                    f"reserve {ip} for {owner}", self._port.allocate_ip(self._node, owner, family, ip, ports)
                )
        raise UpstreamUnavailable(f"IPAMService says {owner} already has an address but does not list it; retry")

    async def reserve_picked(self, owner: str, picked: dt.Address, ports: Sequence[dt.PortRecord]) -> dt.Address | None:
        """Record ``picked`` (from :attr:`picker`) for ``owner``; None when ipam refuses it.

        Refused because another owner holds it (taken meanwhile by another process), ``owner`` holds
        another address already (a half-finished earlier create), or it is not in the node's CIDR
        (the CIDR changed: the picker forgets it). The create then asks ipam to choose instead.
        """
        try:
            address = await self._port.allocate_ip(self._node, owner, picked.family, picked.ip, ports)
        except UpstreamError as exc:
            if exc.code not in (Code.INVALID_ARGUMENT, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION):
                raise answer(f"reserve {picked.ip} for {owner}", exc) from None
            if exc.code is Code.INVALID_ARGUMENT:
                self.picker.forget(picked.family)
            self.picks_refused += 1
            return None
        self.picker.learn(address, chosen_by_ipam=False)
        self.picks_recorded += 1
        return address

    async def release_ip_quietly(self, ip: str, owner: str) -> None:
        """Release an address; one IPAM no longer holds for ``owner`` is already released."""
        try:
            await self._port.release_ip(self._node, ip, owner)
        except UpstreamError as exc:
            if exc.code not in (Code.NOT_FOUND, Code.FAILED_PRECONDITION):
                raise

    async def release_identity_quietly(self, identity: int, owner: str) -> None:
        try:
            await self._port.release_identity(identity, self._node, owner)
        except UpstreamError as exc:
            if exc.code is not Code.NOT_FOUND:
                raise
