"""Shared pieces of the datapath service tests: endpoints created over gRPC, polling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc
from testkit.harness import ServiceProcess
from testkit.harness import channel as tls_channel
from tests.datapath_service.agent import InProcessAgent


def labels(**kv: str) -> list[common_pb2.Label]:
    return [common_pb2.Label(source="k8s", key=k, value=v) for k, v in kv.items()]


async def create(agent: InProcessAgent, pod: str, **kv: str) -> datapath_pb2.Endpoint:
    assert agent.stub is not None
    request = datapath_pb2.CreateEndpointRequest(namespace="x", pod=pod, labels=labels(**kv))
    ep: datapath_pb2.Endpoint = await agent.stub.CreateEndpoint(request)
    return ep


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 - the conditions are plain state, no event to wait on
            await asyncio.sleep(0.02)


async def started(start: Callable[[], ServiceProcess]) -> tuple[ServiceProcess, datapath_pb2_grpc.DatapathServiceStub]:
    proc = await asyncio.to_thread(start)
    channel = tls_channel(proc.address, "datapath")
    return proc, datapath_pb2_grpc.DatapathServiceStub(channel)


async def create_endpoint(
    stub: datapath_pb2_grpc.DatapathServiceStub, ns: str, pod: str, app: str
) -> datapath_pb2.Endpoint:
    request = datapath_pb2.CreateEndpointRequest(
        namespace=ns, pod=pod, labels=[common_pb2.Label(source="k8s", key="app", value=app)]
    )
    ep: datapath_pb2.Endpoint = await stub.CreateEndpoint(request, timeout=60)
    return ep


async def in_thread(fn: Callable[..., bool], *args: object) -> bool:
    return await asyncio.to_thread(fn, *args)
