"""The ipam service shell: NATS, etcd, IdentityService and IPAMService (UNIMPLEMENTED until built)."""

from __future__ import annotations

from palisade.v1 import identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc
from services.common.bus import IDENTITY_STREAM, IPCACHE_STREAM
from services.common.grpcserver import unimplemented
from services.common.runner import ServiceContext, run_service
from services.ipam.config import IPAMConfig


async def setup(ctx: ServiceContext[IPAMConfig]) -> None:
    bus = await ctx.bus()
    await bus.ensure_streams(IDENTITY_STREAM, IPCACHE_STREAM)
    await ctx.etcd()
    identity_pb2_grpc.add_IdentityServiceServicer_to_server(
        unimplemented(identity_pb2_grpc.IdentityServiceServicer), ctx.server.server
    )
    ipam_pb2_grpc.add_IPAMServiceServicer_to_server(unimplemented(ipam_pb2_grpc.IPAMServiceServicer), ctx.server.server)
    ctx.server.add_service(identity_pb2.DESCRIPTOR.services_by_name["IdentityService"].full_name)
    ctx.server.add_service(ipam_pb2.DESCRIPTOR.services_by_name["IPAMService"].full_name)
    await ctx.server.set_serving(True)


def main(argv: list[str] | None = None) -> int:
    return run_service("ipam", IPAMConfig, setup, argv)
