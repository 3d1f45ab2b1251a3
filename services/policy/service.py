"""The policy service shell: NATS, and PolicyService (methods UNIMPLEMENTED until built)."""

from __future__ import annotations

from palisade.v1 import policy_pb2, policy_pb2_grpc
from services.common.bus import ALL_STREAMS
from services.common.grpcserver import unimplemented
from services.common.runner import ServiceContext, run_service
from services.policy.config import PolicyConfig


async def setup(ctx: ServiceContext[PolicyConfig]) -> None:
    bus = await ctx.bus()
    await bus.ensure_streams(*ALL_STREAMS)
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(
        unimplemented(policy_pb2_grpc.PolicyServiceServicer), ctx.server.server
    )
    ctx.server.add_service(policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name)
    await ctx.server.set_serving(True)


def main(argv: list[str] | None = None) -> int:
    return run_service("policy", PolicyConfig, setup, argv)
