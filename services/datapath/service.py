"""The datapath service: endpoints, orders, ipcache and flows of one node, over pinned BPF maps.

Startup, in order (SERVING only at the end, "ready means synced"; DatapathService
answers from step 3 on, health says NOT_SERVING until step 4's resync is applied):

1. open the BPF facade: pinned maps and programs are reused, so the endpoints of the
   previous run kept enforcing while the process was down;
2. restore endpoints from the state directory (stale ones, whose namespace is gone,
   are cleaned up) and re-attach them;
3. subscribe to this node's orders (queued), replay the ipcache into the LPM map;
   replay Services and EndpointSlices and reconcile the service maps (whose ids the
   facade restored in step 1, so connections through ClusterIPs kept working);
4. start the order consumer, whose first step is a full Resync that reconciles every
   restored endpoint's map with the current policy; re-reserve restored addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc
from services.common.bus import IPCACHE_STREAM, K8S_STREAM, REGEN_STREAM, Bus
from services.common.grpcserver import grpc_target, open_channel, parse_addresses
from services.common.log import get_logger
from services.common.runner import ServiceContext, run_service
from services.datapath import deletequeue, requirements
from services.datapath.config import DatapathConfig
from services.datapath.datapath import Datapath, DatapathAPI
from services.datapath.dnsnames import NamePublisher
from services.datapath.flows import FlowHub
from services.datapath.ipamclient import GrpcIpam, IpamPort
from services.datapath.ipcachesync import IpcacheSync
from services.datapath.loader import ProgramConfig, default_attach
from services.datapath.manager import EndpointManager, PodNetwork
from services.datapath.masquerade import NftMasquerade
from services.datapath.metrics import AgentParts, DatapathMetrics
from services.datapath.namesapi import read_names, socket_path
from services.datapath.netns import NetnsPodNetwork
from services.datapath.nodes import MasqueradePort, NodeCidrs, NodeRoutes, RoutingPort
from services.datapath.orders import GrpcPolicyClient, OrderConsumer, PolicyPort, Reporter
from services.datapath.pluginapi import PluginApi, plugin_socket
from services.datapath.routing import KernelRouting
from services.datapath.servicer import DatapathServicer
from services.datapath.servicesync import ServiceSync
from services.datapath.state import EndpointStore
from services.datapath.types import EndpointState

log = get_logger("datapath")

#: Seconds a stop waits for the veths of deleted endpoints to go.
TEARDOWN_WAIT = 5.0


async def _repair_loop(manager: EndpointManager, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            repaired = await manager.repair()
        except Exception as exc:
            log.error("policy map repair failed", error=str(exc))
            continue
        if repaired:
            log.info("policy maps repaired", endpoints=repaired)


async def _sweep_loop(manager: EndpointManager, queue: Path, interval: float) -> None:
    while True:
        try:
            await manager.sweep(queue)
        except Exception as exc:
            log.error("endpoint sweep failed", error=str(exc))
        await asyncio.sleep(interval)


@dataclasses.dataclass
class Agent:
    """The datapath's components, wired; :func:`start_agent` builds and starts one."""

    node: str
    manager: EndpointManager
    consumer: OrderConsumer
    ipcache: IpcacheSync
    services: ServiceSync
    reporter: Reporter
    flows: FlowHub
    servicer: DatapathServicer
    #: Routes to the other nodes' pod CIDRs (None: this agent routes nothing).
    nodes: NodeRoutes | None = None

    def status(self, out: common_pb2.ServiceStatus) -> None:
        """The status provider: endpoints, realized revision (min over endpoints), synced."""
        out.synced = self.ipcache.loaded.is_set() and self.services.loaded.is_set() and self.consumer.synced.is_set()
        out.revision = self.manager.realized_revision()
        out.details["endpoints"] = str(len(self.manager.endpoints))
        out.details["sequence"] = str(self.consumer.sequence)
        out.details["resyncs"] = str(self.consumer.resyncs)
        out.details["replaces"] = str(self.consumer.replaces)
        out.details["gaps"] = str(self.consumer.sequencer.gaps)
        out.details["ipcache_prefixes"] = str(len(self.ipcache.entries))
        out.details["service_frontends"] = str(self.services.frontend_count())
        out.details["reports_delivered"] = str(self.reporter.delivered)
        out.details["flow_events"] = str(self.flows.events)
        out.details["observers"] = str(self.flows.subscribers)
        if self.nodes is not None:
            out.details["routing"] = self.nodes.mode
            out.details["node_routes"] = str(self.nodes.result.installed)
            if self.nodes.masqueraded is not None:
                out.details["masquerade"] = "on" if self.nodes.masqueraded.enabled else "off"
            if self.nodes.masquerade_error:
                out.details["masquerade_error"] = self.nodes.masquerade_error
            if self.nodes.result.failed or self.nodes.skipped:
                out.details["routes_not_installed"] = "; ".join([*self.nodes.result.failed, *self.nodes.skipped])
        failed = [ep.id for ep in self.manager.endpoints.values() if ep.state is EndpointState.FAILED]
        if failed:
            out.details["failed_endpoints"] = ",".join(str(i) for i in sorted(failed))


Spawn = Callable[[Coroutine[Any, Any, Any], str], object]


async def start_agent(
    cfg: DatapathConfig,
    *,
    bus: Bus,
    datapath: DatapathAPI,
    network: PodNetwork,
    policy: PolicyPort,
    ipam: IpamPort,
    spawn: Spawn,
    stack: contextlib.AsyncExitStack,
    routing: RoutingPort | None = None,
    node_cidrs: NodeCidrs | None = None,
    masquerade: MasqueradePort | None = None,
) -> Agent:
    """Restore endpoints, load the ipcache and start following orders; returns once ready to serve."""
    node = cfg.node_name
    await bus.ensure_streams(K8S_STREAM, REGEN_STREAM, IPCACHE_STREAM)
    reporter = Reporter(node, policy, cfg.retry_backoff_max)
    # The DNS proxy's file: written once both the endpoints and the ipcache's CIDR prefixes are known.
    names = NamePublisher(cfg.state_dir, datapath, cfg.dns_proxy_port, await_prefixes=True)
    manager = EndpointManager(
        node=node,
        datapath=datapath,
        network=network,
        store=EndpointStore(cfg.state_dir),
        ipam=ipam,
        policy=policy,
        reporter=reporter,
        backoff_max=cfg.retry_backoff_max,
        names=names.publish,
        # Addresses the ipcache has are not picked for a new pod (the stream is defined below).
        published=lambda ip: ipcache.holds(ip),
    )
    consumer = OrderConsumer(node, policy, manager, backoff_max=cfg.retry_backoff_max)
    ipcache = IpcacheSync(datapath, manager, cfg.node_name, on_cidrs=names.publish_prefixes)
    services = ServiceSync(datapath, node)

    def pod_of(endpoint_id: int) -> str:
        ep = manager.endpoints.get(endpoint_id)
        return ep.record.key if ep is not None else ""

    flows = FlowHub.configured(datapath, cfg, node=node, pod_of=pod_of, pod_at=lambda ip: ipcache.pods.get(ip, ""))

    spawn(manager.run(), "endpoints")
    spawn(manager.run_releases(), "releases")

    async def finish_teardowns() -> None:
        # Veths of deleted endpoints still going: a stop waits for them a little; a restart
        # finishes any left (their state is kept aside until then).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(manager.settled(), TEARDOWN_WAIT)

    stack.push_async_callback(finish_teardowns)
    spawn(reporter.run(), "reporter")
    spawn(flows.run(), "flows")

    restored = await manager.restore()
    await consumer.subscribe(bus)
    stack.push_async_callback(consumer.stop)
    await ipcache.start(bus)
    stack.push_async_callback(ipcache.stop)
    await services.start(bus)
    stack.push_async_callback(services.stop)
    spawn(services.run(), "services")
    spawn(consumer.run(), "orders")
    spawn(manager.reclaim(restored), "reclaim")
    if cfg.repair_interval > 0:
        spawn(_repair_loop(manager, cfg.repair_interval), "repair")
    if cfg.cni_sweep_interval > 0:
        queue = deletequeue.queue_dir(cfg.cni_socket_path)
        spawn(_sweep_loop(manager, queue, cfg.cni_sweep_interval), "sweep")
    nodes = None
    if routing is not None and node_cidrs is not None:
        nodes = NodeRoutes(
            node,
            cfg.routing,
            routing,
            node_cidrs,
            interval=cfg.node_resync_interval,
            tunnel_port=cfg.tunnel_port,
            masquerade=masquerade,
            masquerade_enabled=cfg.masquerade,
            non_masquerade=cfg.non_masquerade,
        )
        await nodes.start(bus)
        stack.push_async_callback(nodes.stop)
        spawn(nodes.run(), "node-routes")
    names_socket = socket_path(cfg.state_dir)
    servicer = DatapathServicer(manager, flows, datapath, services, names=lambda: read_names(names_socket))
    return Agent(node, manager, consumer, ipcache, services, reporter, flows, servicer, nodes)


async def setup(ctx: ServiceContext[DatapathConfig]) -> None:
    cfg = ctx.config
    # What the node must give (BPF file system, kernel, headers): one line naming what is missing.
    await asyncio.to_thread(requirements.check_node, cfg.bpffs, Path(cfg.state_dir))
    bus = await ctx.bus()
    try:
        program = ProgramConfig(local_delivery=cfg.local_delivery, allow_host=cfg.allow_localhost == "always")
        datapath = await asyncio.to_thread(
            functools.partial(Datapath.open, cfg.bpffs, config=program, attach=cfg.attach)
        )
    except (OSError, RuntimeError) as exc:
        raise OSError(
            f"cannot open the BPF datapath at {cfg.bpffs}: {exc}; run as root with bcc and kernel headers "
            "installed (`make setup`), or fix --bpffs"
        ) from exc
    ctx.log.info(
        "datapath open",
        bpffs=cfg.bpffs,
        attach=cfg.attach or default_attach(program),
        local_delivery=cfg.local_delivery,
    )

    async def close_datapath() -> None:
        # Let a flow read in flight return first; close() keeps programs and maps pinned.
        await asyncio.sleep(cfg.flow_poll_ms / 1000 + 0.05)
        await asyncio.to_thread(datapath.close)

    ctx.stack.push_async_callback(close_datapath)
    policy_channel = open_channel(grpc_target(parse_addresses(cfg.policy_address)), "policy", ctx.credentials)
    ctx.stack.push_async_callback(policy_channel.close)
    ipam_channel = open_channel(grpc_target(parse_addresses(cfg.ipam_address)), "ipam", ctx.credentials)
    ctx.stack.push_async_callback(ipam_channel.close)

    ipam = GrpcIpam(ipam_channel, cfg.rpc_timeout)
    agent = await start_agent(
        cfg,
        bus=bus,
        datapath=datapath,
        network=NetnsPodNetwork(),
        policy=GrpcPolicyClient(policy_channel, cfg.rpc_timeout),
        ipam=ipam,
        spawn=ctx.spawn,
        stack=ctx.stack,
        routing=KernelRouting(),
        node_cidrs=ipam,
        masquerade=NftMasquerade(),
    )
    DatapathMetrics(AgentParts(agent.manager, agent.consumer, agent.reporter, agent.flows, datapath))
    datapath_pb2_grpc.add_DatapathServiceServicer_to_server(agent.servicer, ctx.server.server)
    ctx.server.add_unix_socket(cfg.cni_socket_path)
    plugin = PluginApi(agent.servicer, ctx.server.errors, plugin_socket(cfg.cni_socket_path))
    await plugin.start()
    ctx.stack.push_async_callback(plugin.stop)
    ctx.server.add_service(datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"].full_name)
    ctx.server.status.provider = agent.status

    async def ready_when_synced() -> None:
        # Ready means synced: the endpoints hold the current policy (and the ipcache is loaded).
        await agent.consumer.synced.wait()
        await ctx.server.set_serving(True)
        log.info(
            "datapath ready",
            node=agent.node,
            endpoints=len(agent.manager.endpoints),
            ipcache=len(agent.ipcache.entries),
            revision=agent.manager.revision,
        )

    ctx.spawn(ready_when_synced(), "ready")


def main(argv: list[str] | None = None) -> int:
    return run_service("datapath", DatapathConfig, setup, argv)
