"""The one error type and the one abort helper, over a real gRPC server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from palisade.v1 import common_pb2, common_pb2_grpc
from services.common.errors import MAX_MESSAGE, Code, PalisadeError, abort_with, clip
from services.common.grpcserver import unimplemented


class Failing(common_pb2_grpc.StatusServiceServicer):
    def __init__(self, error: PalisadeError) -> None:
        self.error = error

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ServiceStatus:
        await abort_with(context, self.error)


@asynccontextmanager
async def _serve(servicer: common_pb2_grpc.StatusServiceServicer) -> AsyncIterator[common_pb2_grpc.StatusServiceStub]:
    server = grpc.aio.server()
    common_pb2_grpc.add_StatusServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield common_pb2_grpc.StatusServiceStub(channel)
    finally:
        await server.stop(None)


async def _status_of(servicer: common_pb2_grpc.StatusServiceServicer) -> grpc.aio.AioRpcError:
    async with _serve(servicer) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    return err.value


def test_error_without_a_code_is_internal() -> None:
    assert PalisadeError("boom").code is Code.INTERNAL
    assert PalisadeError("gone", Code.NOT_FOUND).code is Code.NOT_FOUND


def test_clip_says_how_much_was_cut() -> None:
    assert clip("short") == "short"
    assert clip("x" * 15, limit=10) == "x" * 10 + "… (5 more characters)"


async def test_abort_with_answers_the_errors_code_and_clipped_message() -> None:
    err = await _status_of(Failing(PalisadeError("y" * (3 * MAX_MESSAGE), Code.FAILED_PRECONDITION)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == clip("y" * (3 * MAX_MESSAGE))


async def test_unimplemented_servicer_answers_unimplemented() -> None:
    err = await _status_of(unimplemented(common_pb2_grpc.StatusServiceServicer))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.details() == "StatusServiceServicer.GetStatus is not implemented yet"
