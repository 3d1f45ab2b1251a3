"""The one error type and the one error interceptor, over a real gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from palisade.v1 import common_pb2, common_pb2_grpc
from services.common.access import wrap_handler
from services.common.errors import MAX_MESSAGE, Code, PalisadeError, clip
from services.common.grpcserver import ErrorInterceptor, HandlerWrap, Status, WrappedHandlers, unimplemented


class Failing(common_pb2_grpc.StatusServiceServicer):
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ServiceStatus:
        raise self.error


class Answering(common_pb2_grpc.StatusServiceServicer):
    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ServiceStatus:
        return common_pb2.ServiceStatus(service="ok")


class Aborting(common_pb2_grpc.StatusServiceServicer):
    """A servicer that aborts by itself (as a library's may): the interceptor passes its status on."""

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ServiceStatus:
        await context.abort(grpc.StatusCode.NOT_FOUND, "gone")
        raise AssertionError("grpc abort returned")


class Outage(Exception):
    pass


def outage_status(exc: Exception, method: str) -> Status | None:
    if isinstance(exc, Outage):
        return grpc.StatusCode.UNAVAILABLE, f"{method}: {exc}; retry later"
    return None


@asynccontextmanager
async def _serve(
    servicer: common_pb2_grpc.StatusServiceServicer, errors: ErrorInterceptor | None = None
) -> AsyncIterator[common_pb2_grpc.StatusServiceStub]:
    before = asyncio.all_tasks()
    server = grpc.aio.server(interceptors=[errors or ErrorInterceptor()])
    common_pb2_grpc.add_StatusServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield common_pb2_grpc.StatusServiceStub(channel)
    finally:
        await server.stop(None)
        # stop() returns before the tasks of the calls it cut short have ended (under load, a few
        # loop turns later): wait for them, so the test ends with the server quiet.
        serving = asyncio.all_tasks() - before - {asyncio.current_task()}
        if serving:
            await asyncio.wait(serving, timeout=5)


async def _status_of(
    servicer: common_pb2_grpc.StatusServiceServicer, errors: ErrorInterceptor | None = None
) -> grpc.aio.AioRpcError:
    async with _serve(servicer, errors) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    return err.value


def test_error_without_a_code_is_internal() -> None:
    assert PalisadeError("boom").code is Code.INTERNAL
    assert PalisadeError("gone", Code.NOT_FOUND).code is Code.NOT_FOUND


def test_clip_says_how_much_was_cut() -> None:
    assert clip("short") == "short"
    assert clip("x" * 15, limit=10) == "x" * 10 + "… (5 more characters)"


async def test_a_raised_error_answers_its_code_and_clipped_message() -> None:
    err = await _status_of(Failing(PalisadeError("y" * (3 * MAX_MESSAGE), Code.FAILED_PRECONDITION)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == clip("y" * (3 * MAX_MESSAGE))


async def test_a_service_mapping_answers_for_its_own_exceptions() -> None:
    errors = ErrorInterceptor()
    errors.add_mapping(outage_status)
    err = await _status_of(Failing(Outage("etcd is down")), errors)
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, "GetStatus: etcd is down; retry later")


async def test_an_exception_no_mapping_knows_is_unknown() -> None:
    err = await _status_of(Failing(Outage("etcd is down")))
    assert err.code() == grpc.StatusCode.UNKNOWN


async def test_observers_see_each_calls_method_and_code() -> None:
    seen: list[tuple[str, str]] = []
    for servicer in (Answering(), Failing(PalisadeError("no", Code.INVALID_ARGUMENT)), Aborting()):
        errors = ErrorInterceptor()
        errors.add_observer(lambda method, code, seconds: seen.append((method, code)))
        async with _serve(servicer, errors) as stub:
            try:
                await stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                pass
    assert seen == [("GetStatus", "OK"), ("GetStatus", "INVALID_ARGUMENT"), ("GetStatus", "NOT_FOUND")]


async def test_unimplemented_servicer_answers_unimplemented() -> None:
    err = await _status_of(unimplemented(common_pb2_grpc.StatusServiceServicer))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.details() == "StatusServiceServicer.GetStatus is not implemented yet"


async def test_each_methods_handler_is_wrapped_once_and_its_wraps_run_on_every_call() -> None:
    wrapped: list[str] = []
    ran: list[str] = []

    def counting(tag: str) -> HandlerWrap:
        def wrap(method: str, handler: Any) -> Any:
            wrapped.append(f"{tag} {method}")

            def around(behavior: Any) -> Any:
                async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    ran.append(tag)
                    return await behavior(request, context)

                return unary

            return wrap_handler(handler, around)

        return wrap

    server = grpc.aio.server(interceptors=[WrappedHandlers([counting("outer"), counting("inner")])])
    common_pb2_grpc.add_StatusServiceServicer_to_server(Answering(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = common_pb2_grpc.StatusServiceStub(channel)
            for _ in range(3):
                assert (await stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5)).service == "ok"
            # A method no service has is not kept: it stays unimplemented, and wraps nothing.
            unknown = channel.unary_unary("/palisade.v1.Nothing/Here")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unknown(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)
    method = "/palisade.v1.StatusService/GetStatus"
    assert wrapped == [f"inner {method}", f"outer {method}"]
    assert ran == ["outer", "inner"] * 3
