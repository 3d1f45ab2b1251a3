"""The datapath service shell: NATS and DatapathService (UNIMPLEMENTED until built)."""

from __future__ import annotations

from palisade.v1 import datapath_pb2, datapath_pb2_grpc
from services.common.bus import REGEN_STREAM
from services.common.grpcserver import unimplemented
from services.common.runner import ServiceContext, run_service
from services.datapath.config import DatapathConfig


async def setup(ctx: ServiceContext[DatapathConfig]) -> None:
    bus = await ctx.bus()
    await bus.ensure_stream(REGEN_STREAM)
    datapath_pb2_grpc.add_DatapathServiceServicer_to_server(
        unimplemented(datapath_pb2_grpc.DatapathServiceServicer), ctx.server.server
    )
    ctx.server.add_service(datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"].full_name)
    await ctx.server.set_serving(True)


def main(argv: list[str] | None = None) -> int:
    return run_service("datapath", DatapathConfig, setup, argv)
