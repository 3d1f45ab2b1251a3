"""Real-bus helpers: what the watcher and ipam publish, an order log, and a datapath played over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from nats.aio.msg import Msg
from nats.js import api as jsapi

from palisade.v1 import k8s_pb2, policy_pb2, policy_pb2_grpc
from services.common.bus import ALL_STREAMS, HEARTBEAT, Bus
from services.common.grpcserver import wait_for_channel
from services.common.subjects import REGEN_ALL, SYNCED_SUBJECT, identity_subject, ipcache_subject, regen_subject
from testkit import builders
from testkit.harness import ROOT, NatsServer, ServiceProcess, creds
from testkit.nodestate import GapError, NodeState, from_policies, names_from_policies

# A guard against hanging, never an assertion about speed.
PATIENCE = 20.0


async def eventually(check: Callable[[], Any], what: str, timeout: float = PATIENCE) -> Any:
    """Poll ``check`` (plain or async) until it returns something truthy; fail naming ``what``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Feed:
    """Publishes what the watcher and ipam would, on the real bus."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    @classmethod
    async def open(cls, nats: NatsServer) -> Feed:
        bus = await Bus.connect([nats.url], name="test-feed", retries=5, backoff=0.05, tls=creds())
        await bus.ensure_streams(*ALL_STREAMS)
        return cls(bus)

    async def close(self) -> None:
        await self.bus.close()

    async def identity(self, number: int, namespace: str = "default", **labels: str) -> None:
        await self.bus.publish(identity_subject(number), builders.identity_update(number, labels, namespace))

    async def pod(self, ip: str, identity: int, node: str, name: str, **kw: Any) -> None:
        await self.bus.publish(ipcache_subject(f"{ip}/32"), builders.ipcache_entry(ip, identity, node, name, **kw))

    async def policy(self, doc: Mapping[str, Any], *, delete: bool = False) -> None:
        await self.bus.publish(builders.delta_subject(doc), builders.delta(doc, delete=delete))

    async def synced(self) -> None:
        await self.bus.publish(SYNCED_SUBJECT, k8s_pb2.SyncedMarker(kinds=["networkpolicy"], source="test"))


class OrderLog:
    """Every order message published on ``palisade.regen.>``, by node, in arrival order."""

    def __init__(self) -> None:
        self.by_node: dict[str, list[policy_pb2.RegenerationOrder]] = {}
        self._sub: Any = None

    async def start(self, bus: Bus) -> None:
        async def on_msg(msg: Msg) -> None:
            order = policy_pb2.RegenerationOrder()
            order.ParseFromString(msg.data)
            self.by_node.setdefault(order.node, []).append(order)

        self._sub = await bus.nc.subscribe(REGEN_ALL, cb=on_msg)
        await bus.nc.flush()

    def all(self) -> list[policy_pb2.RegenerationOrder]:
        return [o for orders in self.by_node.values() for o in orders]

    def at_revision(self, revision: int) -> dict[str, policy_pb2.RegenerationOrder]:
        return {o.node: o for o in self.all() if o.revision == revision}

    def last_sequence(self, node: str) -> int:
        return max((o.sequence for o in self.by_node.get(node, ())), default=0)


class Datapath:
    """A stand-in datapath for one node over the real APIs: follows its orders, resyncs, reports.

    ``endpoints`` maps pod "namespace/name" to (endpoint id, identity); after every order
    (or resync) each endpoint reports the revision, unless ``reporting`` is off.
    """

    def __init__(self, bus: Bus, address: str, node: str, endpoints: Mapping[str, tuple[int, int]]) -> None:
        self.bus = bus
        self.address = address
        self.node = node
        self.endpoints = dict(endpoints)
        self.state = NodeState()
        self.reporting = True
        self.resyncs = 0
        self.applied: list[policy_pb2.RegenerationOrder] = []
        self._queue: asyncio.Queue[policy_pb2.RegenerationOrder] = asyncio.Queue()
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._old_channels: list[grpc.aio.Channel] = []

    async def start(self) -> None:
        """Subscribe for new orders first, then load the current state: nothing falls in between."""
        self._channel = await wait_for_channel(self.address, "policy", creds("datapath"), PATIENCE)
        await self._subscribe()
        await self.resync()
        self._task = asyncio.create_task(self._run())

    async def _subscribe(self) -> None:
        async def on_msg(msg: Msg) -> None:
            order = policy_pb2.RegenerationOrder()
            order.ParseFromString(msg.data)
            self._queue.put_nowait(order)

        # Idle heartbeats, as the datapath's own follower has them (services.common.bus): the client
        # re-creates the ordered consumer from its last message once the server holding it is lost
        # (an R1 consumer dies with its server; without heartbeats it is never noticed, and a
        # test that kills that server waited in vain for the orders after it).
        self._sub = await self.bus.js.subscribe(
            regen_subject(self.node),
            cb=on_msg,
            ordered_consumer=True,
            config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.NEW, idle_heartbeat=HEARTBEAT),
        )

    async def pause(self) -> None:
        """Stop receiving orders (a datapath that is away); what is published meanwhile is missed."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def resume(self) -> None:
        await self._subscribe()

    async def reconnect(self, address: str) -> None:
        # The old channel is closed at stop(): closing it now would cancel a call in flight on it.
        if self._channel is not None:
            self._old_channels.append(self._channel)
        self.address = address
        self._channel = await wait_for_channel(address, "policy", creds("datapath"), PATIENCE)

    async def stop(self) -> None:
        await self.pause()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for channel in [*self._old_channels, self._channel]:
            if channel is not None:
                await channel.close()

    @property
    def stub(self) -> policy_pb2_grpc.PolicyServiceStub:
        assert self._channel is not None
        return policy_pb2_grpc.PolicyServiceStub(self._channel)

    async def resync(self) -> None:
        while True:
            try:
                response = await self.stub.Resync(policy_pb2.ResyncRequest(node=self.node), timeout=PATIENCE)
                break
            except grpc.aio.AioRpcError as err:
                # The policy service is restarting: a real datapath retries too.
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                await asyncio.sleep(0.1)
        self.resyncs += 1
        self.state.reset(response)
        await self._report()

    async def _run(self) -> None:
        while True:
            order = await self._queue.get()
            try:
                if self.state.offer(order):
                    self.applied.append(order)
                    await self._report()
            except GapError:
                await self.resync()

    async def _report(self) -> None:
        if not self.reporting or not self.endpoints or not self.state.revision:
            return
        request = policy_pb2.ReportRealizedRequest(
            reports=[
                policy_pb2.RealizedReport(
                    node=self.node, endpoint_id=eid, identity=ident, revision=self.state.revision, pod=pod
                )
                for pod, (eid, ident) in sorted(self.endpoints.items())
            ]
        )
        with contextlib.suppress(grpc.aio.AioRpcError):  # the service may be restarting
            await self.stub.ReportRealized(request, timeout=PATIENCE)

    async def matches_resync(self) -> bool:
        """Whether this node's applied state is exactly what Resync returns now."""
        response = await self.stub.Resync(policy_pb2.ResyncRequest(node=self.node), timeout=PATIENCE)
        return (
            self.state.sequence == response.sequence
            and self.state.policies == from_policies(response.policies)
            and self.state.names == names_from_policies(response.policies)
        )


async def start_policy(
    service: Callable[..., ServiceProcess], nats: NatsServer, *args: str, wait: bool = True
) -> ServiceProcess:
    proc = service("policy", "--nats-url", nats.url, "--log-format", "text", *args, wait=False)
    if wait:
        await asyncio.to_thread(proc.wait_serving)
    return proc


async def restart(proc: ServiceProcess) -> None:
    proc.start(wait=False)
    await asyncio.to_thread(proc.wait_serving)


async def palisade(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (in a thread: the test's doubles keep running on the event loop)."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
