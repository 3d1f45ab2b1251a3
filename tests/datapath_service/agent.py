"""The datapath agent run in the test process over the in-memory BPF fake, for tests without root.

Everything else is real: NATS, gRPC to the control plane, gRPC to the agent's own
DatapathService, the state directory. The ``cp`` and ``agent`` fixtures, shared by the
agent's tests and the CNI plugin's, start both on node :data:`NODE`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from palisade.v1 import datapath_pb2_grpc
from services.common.bus import Bus
from services.common.grpcserver import ErrorInterceptor
from services.datapath.config import DatapathConfig
from services.datapath.fake import FakeDatapath
from services.datapath.ipamclient import GrpcIpam
from services.datapath.loader import ProgramConfig
from services.datapath.netns import PodLink, PodPlug
from services.datapath.orders import GrpcPolicyClient
from services.datapath.pluginapi import PluginApi, plugin_socket
from services.datapath.service import Agent, start_agent
from services.datapath.types import Address
from testkit.controlplane import ControlPlane, control_plane
from testkit.harness import NatsServer, channel, creds

#: The node the fixtures' control plane and agent are on.
NODE = "node-a"


@pytest.fixture
async def cp(nats_server: NatsServer) -> AsyncIterator[ControlPlane]:
    async with control_plane(nats_server.url, NODE) as plane:
        yield plane


@pytest.fixture
async def agent(nats_server: NatsServer, cp: ControlPlane, tmp_path: Path) -> AsyncIterator[InProcessAgent]:
    """An agent synced with ``cp``; torn down with its BPF fake unless the test stopped it."""
    runner = InProcessAgent(nats_server.url, cp, tmp_path, NODE)
    await runner.start()
    await runner.wait_synced()
    yield runner
    if runner.agent is not None:
        await runner.stop()
    FakeDatapath.open(runner.config.bpffs).teardown()


class FakeNetwork:
    """Namespaces and veths as names in sets; works like the real one as far as the agent can tell."""

    def __init__(self) -> None:
        self.namespaces: set[str] = set()
        self.links: dict[str, int] = {}
        #: Host interface -> the namespace its pod end is in.
        self.pod_side: dict[str, str] = {}
        self._ifindex = itertools.count(100)
        #: While set, :meth:`plug` waits for it (a veth the kernel is slow to make, in its thread).
        self.gate: threading.Event | None = None

    def plug(self, *, netns: str, create: bool, host_ifname: str, pod_ifname: str = "eth0") -> PodPlug:
        if self.gate is not None:
            self.gate.wait(30)
        if create:
            if netns in self.namespaces:
                raise FileExistsError(errno.EEXIST, f"network namespace {netns} already exists")
            self.namespaces.add(netns)
        elif netns not in self.namespaces:
            raise FileNotFoundError(errno.ENOENT, f"network namespace {netns} does not exist")
        elif netns in self.pod_side.values():  # as netns.create_pod finds eth0 there
            raise FileExistsError(errno.EEXIST, f"network namespace {netns} already has an interface {pod_ifname}")
        self.links[host_ifname] = next(self._ifindex)
        self.pod_side[host_ifname] = netns
        return PodPlug(PodLink(netns, create, host_ifname, self.links[host_ifname], pod_ifname=pod_ifname), 2)

    def address(self, plug: PodPlug, addresses: Sequence[Address]) -> PodLink:
        return dataclasses.replace(plug.link, ips=tuple(a.ip for a in addresses))

    def adopt(self, *, netns: str, host_ifname: str, ips: Sequence[str]) -> PodLink:
        if netns not in self.namespaces:
            raise FileNotFoundError(errno.ENOENT, f"network namespace {netns} does not exist")
        if host_ifname not in self.links:
            raise FileNotFoundError(errno.ENOENT, f"host interface {host_ifname} does not exist")
        ips = tuple(ips)
        return PodLink(netns, False, host_ifname, self.links[host_ifname], ips=ips, link_owned=False)

    def plug_other(self, netns: str, host_ifname: str) -> None:
        """What another CNI plugin does before Palisade's, chained: a namespace and a veth into it."""
        self.namespaces.add(netns)
        self.links[host_ifname] = next(self._ifindex)
        self.pod_side[host_ifname] = netns

    def teardown(self, link: PodLink) -> None:
        if link.link_owned:
            self.links.pop(link.host_ifname, None)
            self.pod_side.pop(link.host_ifname, None)
        if link.netns_owned:
            self.namespaces.discard(link.netns)

    def alive(self, link: PodLink) -> bool:
        return link.netns in self.namespaces and link.host_ifname in self.links

    def exists(self, netns: str) -> bool:
        return netns in self.namespaces


class InProcessAgent:
    """Start, stop (as a crash would leave things: pinned maps and state stay) and restart the agent."""

    def __init__(
        self,
        nats_url: str,
        control_plane: ControlPlane,
        tmp: Path,
        node: str = "node-a",
        program: ProgramConfig | None = None,
    ) -> None:
        #: What the BPF fake is opened with (its map sizes bound the endpoint ids).
        self.program = program or ProgramConfig()
        self.config = DatapathConfig(
            nats_url=nats_url,
            node_name=node,
            policy_address=control_plane.policy_address,
            ipam_address=control_plane.ipam_address,
            state_dir=str(tmp / "state"),
            bpffs=str(tmp / "bpf"),
            repair_interval=0,
            flow_poll_ms=50,
            retry_backoff_max=0.5,
        )
        self.network = FakeNetwork()
        self.datapath: FakeDatapath | None = None
        self.agent: Agent | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stack: contextlib.AsyncExitStack | None = None
        self.server: grpc.aio.Server | None = None
        self.plugin: PluginApi | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: datapath_pb2_grpc.DatapathServiceStub | None = None

    async def start(self) -> Agent:
        stack = contextlib.AsyncExitStack()
        self._stack = stack
        bus = await Bus.connect([self.config.nats_url], name="datapath-test", tls=creds("datapath"))
        stack.push_async_callback(bus.close)
        policy = channel(self.config.policy_address, "policy", "datapath")
        stack.push_async_callback(policy.close)
        ipam = channel(self.config.ipam_address, "ipam", "datapath")
        stack.push_async_callback(ipam.close)
        self.datapath = FakeDatapath.open(self.config.bpffs, config=self.program)

        def spawn(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
            task = asyncio.create_task(coro, name=name)
            self._tasks.append(task)
            return task

        self.agent = await start_agent(
            self.config,
            bus=bus,
            datapath=self.datapath,
            network=self.network,
            policy=GrpcPolicyClient(policy, 5.0),
            ipam=GrpcIpam(ipam, 5.0),
            spawn=spawn,
            stack=stack,
        )
        errors = ErrorInterceptor()  # the service's error mapping
        self.server = grpc.aio.server(interceptors=[errors])
        datapath_pb2_grpc.add_DatapathServiceServicer_to_server(self.agent.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        # The node socket and the CNI plugin's door beside it, as the service opens them.
        self.server.add_insecure_port(f"unix:{self.config.cni_socket_path}")
        await self.server.start()
        self.plugin = PluginApi(self.agent.servicer, errors, plugin_socket(self.config.cni_socket_path))
        await self.plugin.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = datapath_pb2_grpc.DatapathServiceStub(self.channel)
        return self.agent

    async def stop(self) -> None:
        if self.plugin is not None:
            await self.plugin.stop()
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(0)
        failed = [t for t in self._tasks if t.done() and not t.cancelled() and t.exception() is not None]
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._stack is not None:
            await self._stack.aclose()
        if self.datapath is not None:
            self.datapath.close()
        self.agent = None
        if failed:
            raise RuntimeError(f"agent task {failed[0].get_name()} failed") from failed[0].exception()

    async def wait_synced(self, timeout: float = 10.0) -> None:
        assert self.agent is not None
        await asyncio.wait_for(self.agent.consumer.synced.wait(), timeout)
