"""The dev node: its pods are network namespaces made from the Pod objects assigned to it.

It follows pod deltas on the bus (so editing a Pod manifest adds, changes or removes
a pod within a moment), makes each pod's endpoint, and runs the pod's servers on its
container ports inside the endpoint's namespace. Endpoints are made directly with
CreateEndpoint (fast), or, with a :class:`CniRuntime`, as a container runtime makes them:
a sandbox namespace joined by exec'ing palisade-cni (the path kubelet's pods take).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc, k8s_pb2
from services.cni.spec import CniError
from services.common.backoff import Backoff
from services.common.bus import Bus
from services.common.grpcserver import open_channel
from services.common.largeobjects import follow_deltas
from services.common.log import get_logger, setup_logging
from services.common.subjects import k8s_filter
from services.common.trust import Credentials
from services.devstack.cniexec import CniRuntime

log = get_logger("devnode")

PROTOCOLS = {"TCP": common_pb2.PROTOCOL_TCP, "UDP": common_pb2.PROTOCOL_UDP, "SCTP": common_pb2.PROTOCOL_SCTP}
#: Failures that pass by themselves: the pod (or its identity) is not known to ipam yet, or ipam is away.
_PASSING = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True)
class PodSpec:
    """What the dev node needs of a Pod object."""

    namespace: str
    name: str
    ports: tuple[tuple[str, int, str], ...]  # (name, port, protocol)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def placement(node_name: str, nodes: Sequence[str]) -> str | None:
    """The dev node a pod runs on: the one its ``spec.nodeName`` names (in a dev cluster the watcher
    binds every pod to one); on a single dev node also the unassigned ones. A pod naming another
    node is not ours, as a kubelet would ignore it."""
    if node_name in nodes:
        return node_name
    if not node_name and len(nodes) == 1:
        return nodes[0]
    return None


def pod_spec(obj: dict[str, object], node: str, nodes: Sequence[str] = ()) -> PodSpec | None:
    """The pod's spec if it runs on ``node`` (of the dev nodes ``nodes``, default just it), else None."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    assert isinstance(meta, dict) and isinstance(spec, dict)
    if placement(str(spec.get("nodeName") or ""), nodes or (node,)) != node:
        return None
    ports = []
    for container in spec.get("containers") or []:
        for p in container.get("ports") or []:
            ports.append((str(p.get("name", "")), int(p["containerPort"]), str(p.get("protocol", "TCP")).upper()))
    return PodSpec(str(meta.get("namespace") or "default"), str(meta["name"]), tuple(sorted(ports)))


def server_command(netns: str, pod: PodSpec, extra_ports: tuple[tuple[int, str], ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "services.devstack.podserver", "--netns", netns, "--name", pod.key]
    for _, port, proto in pod.ports:
        cmd += [f"--{proto.lower()}", str(port)]
    for port, proto in extra_ports:
        cmd += [f"--{proto.lower()}", str(port)]
    return cmd


class DevNode:
    """Keeps the node's endpoints and pod servers in line with the pods on the bus."""

    def __init__(
        self,
        bus: Bus,
        datapath: str,
        node: str,
        cni: CniRuntime | None = None,
        credentials: Credentials | None = None,
        nodes: Sequence[str] = (),
    ) -> None:
        self._bus = bus
        self._cni = cni
        self._datapath = datapath
        self._credentials = credentials
        self._node = node
        #: Every dev node (pods are placed among them); just this one by default.
        self._nodes = tuple(nodes) or (node,)
        self._queue: asyncio.Queue[tuple[str, PodSpec | None]] = asyncio.Queue()
        #: The newest spec queued per pod: a retry of an older one is dropped.
        self._latest: dict[str, PodSpec | None] = {}
        #: Pods whose creation failed for a reason that passes (ipam has not seen the pod yet).
        self._retrying: dict[str, Backoff] = {}
        #: Set once the pods present at startup have been created.
        self.settled = asyncio.Event()
        self.pods: dict[str, PodSpec] = {}
        self.endpoints: dict[str, datapath_pb2.Endpoint] = {}
        self._servers: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def name(self) -> str:
        return self._node

    async def run(self) -> None:
        async def on_delta(subject: str, delta: k8s_pb2.K8sDelta) -> None:
            key = f"{delta.namespace}/{delta.name}"
            if delta.op == k8s_pb2.DELTA_OP_DELETE:
                self._latest[key] = None
                await self._queue.put((key, None))
                return
            spec = pod_spec(json.loads(delta.object_json), self._node, self._nodes)
            self._latest[key] = spec
            await self._queue.put((key, spec))

        follower = await follow_deltas(self._bus, k8s_filter("pod"), on_delta)
        try:
            async with open_channel(self._datapath, "datapath", self._credentials) as channel:
                stub = datapath_pb2_grpc.DatapathServiceStub(channel)
                while True:
                    idle = self._queue.empty() and not self._retrying
                    if not self.settled.is_set() and follower.caught_up.is_set() and idle:
                        self.settled.set()
                    try:
                        key, spec = await asyncio.wait_for(self._queue.get(), 0.2)
                    except TimeoutError:
                        continue
                    await self._reconcile(stub, key, spec)
        finally:
            await follower.stop()

    async def _reconcile(self, stub: datapath_pb2_grpc.DatapathServiceStub, key: str, spec: PodSpec | None) -> None:
        old = self.pods.get(key)
        if spec == old:
            return
        if old is not None and (spec is None or spec.ports != old.ports):
            await self._remove(stub, old)
        if spec is None:
            return
        if key in self.endpoints:  # same ports, other labels: ipam moves the identity, nothing to do here
            self.pods[key] = spec
            return
        ports = [
            datapath_pb2.ContainerPort(name=n, port=p, protocol=PROTOCOLS.get(proto, common_pb2.PROTOCOL_TCP))
            for n, p, proto in spec.ports
        ]
        try:
            if self._cni is not None:
                await self._cni.add(spec.namespace, spec.name)
                ref = datapath_pb2.GetEndpointRequest(namespace=spec.namespace, pod=spec.name)
                ep = await stub.GetEndpoint(ref, timeout=30)
            else:
                req = datapath_pb2.CreateEndpointRequest(namespace=spec.namespace, pod=spec.name, ports=ports)
                ep = await stub.CreateEndpoint(req, timeout=60)
        except grpc.aio.AioRpcError as err:
            if err.code() in _PASSING:
                # As a kubelet retries a pod sync: ipam learns of a new pod from the same bus, maybe later.
                self._retry(key, spec)
                log.info("endpoint not created yet, retrying", pod=key, code=err.code().name, error=err.details())
                return
            log.error("endpoint not created", pod=key, code=err.code().name, error=err.details())
            return
        except CniError as err:
            log.error("endpoint not created", pod=key, error=str(err))
            return
        self._retrying.pop(key, None)
        self.pods[key] = spec
        self.endpoints[key] = ep
        self._servers[key] = await asyncio.to_thread(
            subprocess.Popen, server_command(ep.netns, spec), stdout=subprocess.DEVNULL
        )
        log.info("pod started", pod=key, ips=",".join(ep.ips), identity=ep.identity, endpoint=ep.id)

    def _retry(self, key: str, spec: PodSpec) -> None:
        backoff = self._retrying.setdefault(key, Backoff(0.2, 5.0))

        def again() -> None:
            if self._latest.get(key) is spec:
                self._queue.put_nowait((key, spec))
            else:
                self._retrying.pop(key, None)

        asyncio.get_running_loop().call_later(backoff.next(), again)

    async def _remove(self, stub: datapath_pb2_grpc.DatapathServiceStub, pod: PodSpec) -> None:
        server = self._servers.pop(pod.key, None)
        if server is not None:
            server.terminate()
            await asyncio.to_thread(server.wait, 5)
        ep = self.endpoints.pop(pod.key, None)
        self.pods.pop(pod.key, None)
        if ep is not None and self._cni is not None:
            await self._cni.remove(pod.namespace, pod.name)
        elif ep is not None:
            try:
                await stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=ep.id), timeout=30)
            except grpc.aio.AioRpcError as err:
                log.warning("endpoint not deleted", pod=pod.key, error=err.details())
        log.info("pod stopped", pod=pod.key)

    async def shutdown(self) -> None:
        async with open_channel(self._datapath, "datapath", self._credentials) as channel:
            stub = datapath_pb2_grpc.DatapathServiceStub(channel)
            for pod in list(self.pods.values()):
                await self._remove(stub, pod)


async def _serve(args: argparse.Namespace) -> int:
    credentials = None if args.insecure else Credentials.load(args.tls_dir, "devnode")
    bus = await Bus.connect(args.nats_url.split(","), name="palisade-devnode", tls=credentials)
    node = DevNode(bus, args.datapath_address, args.node, None, credentials)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(node.run(), name=f"devnode-{args.node}")
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # a failure of the node is the process's
            return 1
        log.info("dev node stopping: removing its pods", node=args.node, pods=len(node.pods))
    finally:
        stopped.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await node.shutdown()
        await bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.devstack.node``: one dev node against a running stack (deploy/compose's devnode).

    Makes the pods the bus assigns to the node (the manifests' Pods) through the node's datapath,
    runs their servers, and removes them again when stopped. `make run` runs its nodes itself.
    """
    parser = argparse.ArgumentParser(prog="python -m services.devstack.node", description=main.__doc__)
    env = os.environ.get
    parser.add_argument("--node", default=env("PALISADE_NODE_NAME", "dev-node"), help="the node's name")
    parser.add_argument("--nats-url", default=env("PALISADE_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL(s)")
    parser.add_argument(
        "--datapath-address", default=env("PALISADE_DATAPATH_ADDRESS", "127.0.0.1:9404"), help="the node's datapath"
    )
    parser.add_argument(
        "--tls-dir", default=env("PALISADE_TLS_DIR", "/etc/palisade/tls"), help="holds ca.crt, devnode.crt/.key"
    )
    parser.add_argument("--insecure", action="store_true", help="a stack started with --insecure")
    args = parser.parse_args(argv)
    setup_logging(env("PALISADE_LOG_LEVEL", "info"), env("PALISADE_LOG_FORMAT", "json"))
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
