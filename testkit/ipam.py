"""Shared pieces of the ipam tests: k8s deltas to publish, a view of what ipam announces, polling."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2

from palisade.v1 import common_pb2_grpc, identity_pb2, identity_pb2_grpc, ipam_pb2_grpc, k8s_pb2
from services.common.bus import IDENTITY_STREAM, IPCACHE_STREAM, K8S_STREAM, Bus
from services.common.subjects import IDENTITY_ALL, IPCACHE_ALL, SYNCED_SUBJECT
from services.ipam.config import IPAMMode
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Store
from services.ipam.leases import NodeLeases
from services.ipam.pods import PodManager
from services.ipam.publish import IdentityPublisher, IpcacheWriter
from testkit.builders import delta, delta_subject
from testkit.harness import ROOT, EtcdServer, NatsServer, channel


async def eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail with its last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        last = value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout}s; last value {last!r}")
        await asyncio.sleep(0.05)


class PodTask(NamedTuple):
    """ipam's pod task and the allocators and ipcache writer it works on."""

    pods: PodManager
    allocator: IdentityAllocator
    ipalloc: IPAllocator
    ipcache: IpcacheWriter


async def pod_task(store: Store, bus: Bus) -> PodTask:
    """ipam's pod task as the service builds it (cluster pool 10.0.0.0/8), its allocators loaded; not running."""
    allocator = IdentityAllocator(store, NodeLeases(store, 60))
    await allocator.load()
    ipalloc = IPAllocator(
        store, [ipaddress.ip_network("10.0.0.0/8")], mask_v4=24, mask_v6=112, mode=IPAMMode.CLUSTER_POOL
    )
    await ipalloc.load()
    ipcache = IpcacheWriter(store, bus)
    await ipcache.load()
    pods = PodManager(allocator, ipalloc, IdentityPublisher(bus), ipcache, cluster="default")
    return PodTask(pods, allocator, ipalloc, ipcache)


def pod(
    namespace: str,
    name: str,
    labels: dict[str, str],
    *,
    node: str = "node-a",
    ip: str | None = None,
    ports: dict[str, int] | None = None,
    service_account: str = "",
    phase: str = "Running",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "uid": f"uid-{namespace}-{name}"},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "c",
                    "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (ports or {}).items()],
                }
            ],
        },
        "status": {"phase": phase},
    }
    if service_account:
        obj["spec"]["serviceAccountName"] = service_account
    if ip:
        obj["status"]["podIP"] = ip
        obj["status"]["podIPs"] = [{"ip": ip}]
    return obj


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}


def node(name: str, *, pod_cidrs: list[str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}}
    if pod_cidrs:
        obj["spec"]["podCIDRs"] = pod_cidrs
        obj["spec"]["podCIDR"] = pod_cidrs[0]
    if annotations:
        obj["metadata"]["annotations"] = annotations
    return obj


class K8s:
    """Plays the watcher: publishes K8sDelta and the synced marker."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def apply(self, obj: dict[str, Any]) -> None:
        await self.bus.publish(delta_subject(obj), delta(obj))

    async def delete(self, obj: dict[str, Any]) -> None:
        await self.bus.publish(delta_subject(obj), delta(obj, delete=True))

    async def synced(self) -> None:
        await self.bus.publish(SYNCED_SUBJECT, k8s_pb2.SyncedMarker(kinds=["pod", "namespace", "node"], source="test"))


class BusView:
    """The latest IdentityUpdate and IpcacheEntry per subject, as a consumer sees them."""

    def __init__(self) -> None:
        self.identities: dict[int, identity_pb2.IdentityUpdate] = {}
        self.ipcache: dict[str, identity_pb2.IpcacheEntry] = {}

    @classmethod
    async def start(cls, bus: Bus) -> BusView:
        view = cls()
        await bus.ensure_streams(K8S_STREAM, IDENTITY_STREAM, IPCACHE_STREAM)

        async def on_identity(subject: str, msg: identity_pb2.IdentityUpdate) -> None:
            view.identities[msg.identity.id] = msg

        async def on_ipcache(subject: str, msg: identity_pb2.IpcacheEntry) -> None:
            view.ipcache[msg.prefix] = msg

        await bus.follow(IDENTITY_ALL, identity_pb2.IdentityUpdate, on_identity)
        await bus.follow(IPCACHE_ALL, identity_pb2.IpcacheEntry, on_ipcache)
        return view

    def live_identity(self, ident: int) -> identity_pb2.IdentityUpdate | None:
        msg = self.identities.get(ident)
        return msg if msg is not None and not msg.deleted else None

    def entry(self, prefix: str) -> identity_pb2.IpcacheEntry | None:
        msg = self.ipcache.get(prefix)
        return msg if msg is not None and not msg.deleted else None


def grpc_code(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status code a failing unary call answers with."""
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    raise AssertionError("call succeeded; an error status was expected")


def run_worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.ipam.worker", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def worker_result(proc: subprocess.Popen[str], timeout: float = 120.0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


SERVING = health_pb2.HealthCheckResponse.SERVING


def ipam_args(nats: NatsServer, etcd: EtcdServer, *extra: str) -> list[str]:
    return [
        "--nats-url",
        nats.url,
        "--etcd-endpoints",
        etcd.endpoint,
        "--k8s-sync-timeout",
        "0",
        "--identity-gc-interval",
        "0.3",
        "--identity-gc-grace",
        "1",
        "--identity-lease-ttl",
        "10",
        "--log-format",
        "text",
        *extra,
    ]


class Api:
    """Async stubs on one channel to the service."""

    def __init__(self, address: str) -> None:
        self.channel = channel(address, "ipam", "datapath")
        self.identity = identity_pb2_grpc.IdentityServiceStub(self.channel)
        self.ipam = ipam_pb2_grpc.IPAMServiceStub(self.channel)
        self.status = common_pb2_grpc.StatusServiceStub(self.channel)

    async def resolve(self, ns: str, name: str) -> identity_pb2.ResolvePodResponse | None:
        try:
            resp: identity_pb2.ResolvePodResponse = await self.identity.ResolvePod(
                identity_pb2.ResolvePodRequest(namespace=ns, name=name), timeout=5
            )
            return resp
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                return None
            raise

    async def code(self, call) -> grpc.StatusCode:
        try:
            await call
        except grpc.aio.AioRpcError as err:
            return err.code()
        raise AssertionError("call succeeded; an error status was expected")
