"""Every replica answers PolicyService; a follower passes each call to the leader.

Revisions, realized reports, resyncs and imported policies live with the leader, so a
follower answering from its own engine could contradict it (a revision it never
handed out, a policy it has not seen imported). A follower therefore forwards each
call, with the caller's deadline, and returns the leader's answer or error as its own
(like etcd followers serving linearizable reads through the leader); a dry-run import
too, as it answers with the revision the import would make, which is the leader's. Clients and
datapaths may thus use any replica, and keep working across a failover once the new
leader is in place.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import symbol_database
from google.protobuf.message import Message

from palisade.v1 import policy_pb2, policy_pb2_grpc
from services.common.errors import Code, PalisadeError
from services.common.grpcserver import Status, open_channel
from services.common.trust import Credentials
from services.policy.election import Election
from services.policy.servicer import NOT_SYNCED

SERVICE = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"]
#: Set on forwarded calls: a replica that is not the leader either refuses them (no loops).
FORWARDED = "palisade-forwarded-by"

Handler = Callable[..., Awaitable[Any]]


#: Reads that need nothing only the leader has: answered from this replica's engine while no
#: leader is known (a lone replica starting, an election under way), as a single service would.
_READS = frozenset({"GetPolicy", "ListPolicies", "Trace", "Diff"})


class Forwarder:
    """Calls the leader on behalf of this follower, one channel per leader address."""

    def __init__(self, election: Election, credentials: Credentials | None) -> None:
        self._election = election
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, "policy", self._credentials)
        return channel

    async def call(self, method: str, request: Message, context: grpc.aio.ServicerContext) -> Any:
        wait = (
            f"retry in a few seconds: a follower takes over within about {2 * self._election.lease:g}s of the "
            "leader's loss"
        )
        if any(key == FORWARDED for key, _ in context.invocation_metadata() or ()):
            raise PalisadeError(f"policy replica {self._election.member} no longer leads; {wait}", Code.UNAVAILABLE)
        leader = self._election.leader
        if leader is None or not leader.address or leader.address == self._election.address():
            if not self._election.candidate:
                raise PalisadeError(NOT_SYNCED, Code.UNAVAILABLE)
            raise PalisadeError(f"no policy leader right now (an election is under way); {wait}", Code.UNAVAILABLE)
        output = symbol_database.Default().GetSymbol(SERVICE.methods_by_name[method].output_type.full_name)
        stub = self._channel(leader.address).unary_unary(
            f"/{SERVICE.full_name}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=output.FromString,
        )
        try:
            return await stub(
                request,
                timeout=context.time_remaining(),
                metadata=((FORWARDED, self._election.member),),
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE and not err.details().startswith(("policy", "no policy")):
                raise PalisadeError(
                    f"the policy leader {leader.name} at {leader.address} is unreachable ({err.details()}); {wait}",
                    Code.UNAVAILABLE,
                ) from None
            raise  # the leader's answer, relayed as it is (see relayed_status)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def relayed_status(exc: Exception, method: str) -> Status | None:
    """The leader's answer to a forwarded call reaches the caller unchanged."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return None


def routed(servicer: policy_pb2_grpc.PolicyServiceServicer, election: Election, forwarder: Forwarder) -> Any:
    """A PolicyService that runs ``servicer`` on the leader and forwards from a follower."""

    def make(name: str) -> Handler:
        local: Handler = getattr(servicer, name)

        async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            if election.leading.is_set():
                return await local(request, context)
            if name in _READS and election.leader is None:
                return await local(request, context)
            return await forwarder.call(name, request, context)

        return handler

    methods = {m.name: make(m.name) for m in SERVICE.methods}
    return type("RoutedPolicyService", (policy_pb2_grpc.PolicyServiceServicer,), methods)()
