"""The dev node retries a pod whose creation failed for a passing reason, as a kubelet does."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import grpc
import pytest

from palisade.v1 import datapath_pb2
from services.devstack.node import DevNode, PodSpec

KEY = "x/a"
SPEC = PodSpec("x", "a", ())


class LateIpam:
    """A datapath whose first CreateEndpoint fails as it does when ipam has not seen the pod yet."""

    def __init__(self) -> None:
        self.calls = 0

    async def CreateEndpoint(self, req: datapath_pb2.CreateEndpointRequest, timeout: float) -> datapath_pb2.Endpoint:
        self.calls += 1
        if self.calls == 1:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), details="pod x/a is unknown"
            )
        return datapath_pb2.Endpoint(id=1, namespace=req.namespace, pod=req.pod, netns="/run/netns/x", ips=["10.0.0.9"])


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> DevNode:
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: None)  # no pod servers here
    dev = DevNode(bus=None, datapath="127.0.0.1:1", node="n1")  # type: ignore[arg-type]
    dev._latest[KEY] = SPEC
    return dev


async def test_a_pod_ipam_does_not_know_yet_is_created_on_a_retry(node: DevNode) -> None:
    stub: Any = LateIpam()
    await node._reconcile(stub, KEY, SPEC)
    assert KEY not in node.endpoints
    key, spec = await asyncio.wait_for(node._queue.get(), 5)  # the retry, after a short backoff
    await node._reconcile(stub, key, spec)
    assert node.endpoints[KEY].ips == ["10.0.0.9"] and stub.calls == 2
    assert not node._retrying


async def test_a_retry_gives_way_to_a_newer_change(node: DevNode) -> None:
    stub: Any = LateIpam()
    await node._reconcile(stub, KEY, SPEC)
    node._latest[KEY] = None  # the pod was deleted meanwhile
    await asyncio.sleep(0.5)
    assert node._queue.empty() and not node._retrying
