"""The ipam service: identities, pod IPs and the ipcache, from etcd and the k8s deltas.

Startup: load identities, node CIDRs, addresses and the ipcache from etcd and
republish identities and ipcache (compacted streams, so this is idempotent and
restores consumers even if NATS lost its data); then replay nodes, namespaces
and pods from the k8s stream (in that order, so pods see their namespace's
labels); once the watcher's ``palisade.k8s.synced`` marker is in and the replay
applied, sweep what belongs to pods that went while ipam was away and report
SERVING. Background tasks keep node leases alive and collect unused identities.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc, k8s_pb2
from services.common.bus import IDENTITY_STREAM, IPCACHE_STREAM, K8S_STREAM, Bus
from services.common.labels import CIDR_HOLDER_NODE
from services.common.largeobjects import follow_deltas
from services.common.log import get_logger
from services.common.members import MemberView, etcd_members
from services.common.runner import ServiceContext, run_service
from services.common.subjects import SYNCED_SUBJECT, k8s_filter
from services.ipam import metrics
from services.ipam.config import IPAMConfig
from services.ipam.gc import GcTracker
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Store, StoreError
from services.ipam.leases import NodeLeases
from services.ipam.mirror import Mirror
from services.ipam.pods import K8sChanged, NodeResync, PodManager
from services.ipam.podwatch import BadObject, decode
from services.ipam.publish import IdentityPublisher, IpcacheWriter
from services.ipam.replica import ReplicaLease
from services.ipam.servicer import IdentityServicer, IPAMServicer, store_status

log = get_logger("ipam")

#: Kinds followed, in replay order: nodes and namespaces before the pods that use them.
K8S_SUBJECTS = (k8s_filter("node"), k8s_filter("namespace"), k8s_filter("pod"))


@dataclasses.dataclass
class Ipam:
    """The service's components, wired together."""

    config: IPAMConfig
    bus: Bus
    store: Store
    leases: NodeLeases
    replica: ReplicaLease
    allocator: IdentityAllocator
    ipalloc: IPAllocator
    identities: IdentityPublisher
    ipcache: IpcacheWriter
    pods: PodManager
    synced: bool = False
    marker: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def fill_status(self, status: common_pb2.ServiceStatus) -> None:
        status.synced = self.synced
        status.details["identities"] = str(self.allocator.count())
        status.details["allocations"] = str(self.ipalloc.allocation_count())
        status.details["nodes"] = str(len(self.ipalloc.node_records()))
        status.details["pods"] = str(self.pods.pod_count())
        status.details["ipcache"] = str(len(self.ipcache.entries))
        status.details["api_endpoints"] = str(self.pods.api_endpoint_count())
        status.details["mode"] = self.config.mode.value
        # Replicas are peers: each serves every call against etcd's transactions; none leads.
        status.details["role"] = "replica"


def build(cfg: IPAMConfig, bus: Bus, store: Store) -> Ipam:
    leases = NodeLeases(store, cfg.identity_lease_ttl)
    replica = ReplicaLease(store, cfg.identity_lease_ttl)
    allocator = IdentityAllocator(store, leases, replica=replica)
    ipalloc = IPAllocator(
        store, cfg.cluster_networks(), mask_v4=cfg.node_mask_v4, mask_v6=cfg.node_mask_v6, mode=cfg.mode
    )
    identities = IdentityPublisher(bus)
    ipcache = IpcacheWriter(store, bus)
    pods = PodManager(allocator, ipalloc, identities, ipcache, cluster=cfg.cluster_name)
    return Ipam(cfg, bus, store, leases, replica, allocator, ipalloc, identities, ipcache, pods)


async def load_view(ipam: Ipam) -> int:
    """Rebuild the in-memory view from etcd; returns a revision the view is at least as new as."""
    revision = await ipam.store.revision()
    await ipam.allocator.load()
    await ipam.ipalloc.load()
    await ipam.ipcache.load()
    return revision


async def load_and_republish(ipam: Ipam) -> int:
    """Rebuild the in-memory view from etcd and make sure consumers have it; returns the view's revision."""
    revision = await load_view(ipam)
    current = {identity.id: identity.labels for identity in ipam.allocator.cached()}
    await ipam.identities.resync(current, 0, republish=True)
    await ipam.ipcache.republish()
    log.info(
        "state loaded from etcd",
        identities=len(current),
        allocations=ipam.ipalloc.allocation_count(),
        ipcache=len(ipam.ipcache.entries),
    )
    return revision


async def _reload(ipam: Ipam) -> None:
    await load_view(ipam)


async def follow_k8s(ipam: Ipam, serve: asyncio.Event) -> None:
    """Replay and follow the k8s stream; set ``serve`` once ready (synced, or the sync timeout passed)."""

    async def on_delta(subject: str, delta: k8s_pb2.K8sDelta) -> None:
        try:
            change = decode(delta)
        except BadObject as exc:
            log.warning("k8s object ignored", subject=subject, error=str(exc))
            return
        if change is not None:
            ipam.pods.submit(K8sChanged(change))

    async def on_synced(subject: str, marker: k8s_pb2.SyncedMarker) -> None:
        ipam.marker.set()

    for subject in K8S_SUBJECTS:
        # Follower.caught_up never fires for a filter with nothing to replay when the stream
        # holds other subjects, so ask the stream first whether there is anything to wait for.
        replay = await ipam.bus.holds(K8S_STREAM, subject)
        follower = await follow_deltas(ipam.bus, subject, on_delta)
        if replay:
            await follower.caught_up.wait()
    await ipam.bus.follow(SYNCED_SUBJECT, k8s_pb2.SyncedMarker, on_synced)

    timeout = ipam.config.k8s_sync_timeout
    if timeout > 0:
        try:
            await asyncio.wait_for(ipam.marker.wait(), timeout)
        except TimeoutError:
            log.warning(
                "no k8s synced marker yet, serving IPAM anyway",
                waited=timeout,
                hint="start the watcher; pod identities follow once it has listed the cluster",
            )
            serve.set()
    await ipam.marker.wait()
    await ipam.pods.sweep()
    ipam.synced = True
    log.info("k8s state synced", pods=ipam.pods.pod_count(), identities=ipam.allocator.count())
    serve.set()


async def keep_leases(ipam: Ipam) -> None:
    """Refresh node leases; a lease found expired means its references went, so take them again."""
    interval = max(0.5, ipam.leases.ttl / 3)
    while True:
        await asyncio.sleep(interval)
        try:
            await ipam.replica.refresh()
            lost = await ipam.leases.refresh_all()
            for node in lost:
                moved = await ipam.allocator.retake(node)
                for owner, old, new in moved:
                    if new.new:  # created here: announcing it is this replica's job
                        await ipam.identities.created(new.identity, new.revision)
                    if old is not None and old != new.identity.id:
                        log.warning(
                            "reference moved after lease loss", node=node, owner=owner, previous=old, id=new.identity.id
                        )
                ipam.pods.submit(NodeResync(node))
        except StoreError as exc:
            log.warning("lease keepalive failed", error=str(exc))


async def collect_identities(ipam: Ipam, watched: Callable[[], int]) -> None:
    """Collect identities unreferenced for the grace period; keep the bus in step with etcd.

    ``watched``: the last etcd revision the watch applied here. Identities written after it are
    left to the watch, which knows whether their creator announces them.
    """
    await ipam.pods.swept.wait()
    tracker = GcTracker(ipam.config.identity_gc_grace)
    while True:
        try:
            result = await ipam.allocator.collect(tracker, time.monotonic())
            for identity in result.collected:
                metrics.IDENTITIES_COLLECTED.labels(identity.kind.value).inc()
                await ipam.identities.collected(identity)
            seen = watched()
            unwatched = {i for i, mod in result.modified.items() if mod > seen}
            await ipam.identities.resync(result.current, result.revision, unwatched=unwatched)
        except StoreError as exc:
            log.warning("identity collection skipped", error=str(exc))
        await asyncio.sleep(ipam.config.identity_gc_interval)


async def serve_when_ready(ctx: ServiceContext[IPAMConfig], serve: asyncio.Event) -> None:
    await serve.wait()
    await ctx.server.set_serving(True)
    log.info("serving")


async def setup(ctx: ServiceContext[IPAMConfig]) -> None:
    cfg = ctx.config
    bus = await ctx.bus()
    await bus.ensure_streams(K8S_STREAM, IDENTITY_STREAM, IPCACHE_STREAM)
    etcd = await ctx.etcd()
    store = Store(etcd, patience=cfg.etcd_patience)
    members = MemberView(etcd_members(etcd, ctx.credentials))
    ctx.server.status.add_members(members)
    ctx.spawn(members.run(), "etcd-members")
    ipam = build(cfg, bus, store)
    ctx.stack.push_async_callback(ipam.leases.close)
    ctx.stack.push_async_callback(ipam.replica.close)
    loaded_at = await load_and_republish(ipam)
    # The policy service's CIDR references live under this pseudo-node: no datapath keeps its lease
    # alive, ipam does (adopting the recorded lease, so a restart within the TTL loses nothing).
    await ipam.leases.lease_for(CIDR_HOLDER_NODE)
    mirror = Mirror(
        store,
        ipam.allocator,
        ipam.ipalloc,
        ipam.ipcache,
        ipam.identities,
        reload=lambda: _reload(ipam),
        replica=ipam.replica.name,
    )

    ctx.server.errors.add_mapping(store_status)
    ctx.server.errors.add_observer(metrics.served)
    identity_pb2_grpc.add_IdentityServiceServicer_to_server(
        IdentityServicer(ipam.allocator, ipam.identities, ipam.pods), ctx.server.server
    )
    ipam_pb2_grpc.add_IPAMServiceServicer_to_server(IPAMServicer(ipam.ipalloc, ipam.pods), ctx.server.server)
    ctx.server.add_service(identity_pb2.DESCRIPTOR.services_by_name["IdentityService"].full_name)
    ctx.server.add_service(ipam_pb2.DESCRIPTOR.services_by_name["IPAMService"].full_name)
    ctx.server.status.provider = ipam.fill_status
    metrics.register_state(ipam.allocator, ipam.ipalloc)

    serve = asyncio.Event()
    ctx.spawn(ipam.pods.run(), "pods")
    ctx.spawn(follow_k8s(ipam, serve), "k8s")
    ctx.spawn(serve_when_ready(ctx, serve), "ready")
    ctx.spawn(keep_leases(ipam), "leases")
    ctx.spawn(collect_identities(ipam, lambda: mirror.revision), "identity-gc")
    ctx.spawn(mirror.run(loaded_at), "etcd-watch")
    ctx.spawn(mirror.announce(), "identity-announce")


def main(argv: list[str] | None = None) -> int:
    return run_service("ipam", IPAMConfig, setup, argv)
