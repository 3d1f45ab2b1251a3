"""The policy service: bus inputs -> one state-owning task -> per-node orders, plus PolicyService.

A thin shell. Startup: load the policies imported over the API, follow the inputs
(replayed into one engine batch, then resolved batch by batch: a warm engine), and
run for leader (:mod:`services.policy.election`). The leader loads the persisted
revision and sequences, sends every node its whole state and reports SERVING; a
follower reports SERVING once a leader is known and forwards every call to it
(:mod:`services.policy.forward`) until it leads itself. A leader that loses the lease steps
down in place: its state goes back to a follower's and it forwards again.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import Sequence
from typing import Any

from palisade.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.common.bus import ALL_STREAMS, TRANSIENT, Bus
from services.common.gctuning import freeze_loaded, tune_gc
from services.common.grpcserver import GrpcServer, StatusProvider, grpc_target, open_channel, parse_addresses
from services.common.members import MemberView, nats_members
from services.common.runner import ServiceContext, run_service
from services.common.subjects import regen_subject
from services.policy.apistore import ApiPolicyStore
from services.policy.cidrs import CidrIdentities, GrpcCidrIdentities
from services.policy.config import PolicyConfig
from services.policy.controller import Controller, Encoding, JobKind, NotLeading
from services.policy.documents import dump_document
from services.policy.election import Election
from services.policy.engine.core import PolicyCore
from services.policy.engine.orders import PolicyEpoch
from services.policy.engine.registry import ApiChange
from services.policy.forward import Forwarder, relayed_status, routed
from services.policy.inputs import Inputs
from services.policy.revision import EpochConflictError, RevisionStore
from services.policy.servicer import PolicyServicer

# Room left under the server's max payload for NATS/JetStream headers.
_PAYLOAD_HEADROOM = 4096


class BusSink:
    """Persists imported policies and counters, and publishes orders on ``palisade.regen.<node>``."""

    def __init__(self, bus: Bus, store: RevisionStore, imported: ApiPolicyStore, election: Election) -> None:
        self._bus = bus
        self._store = store
        self._imported = imported
        self._election = election

    async def save_policies(self, changes: Sequence[ApiChange]) -> None:
        await self._imported.save(changes)

    async def save_epoch(self, epoch: PolicyEpoch) -> None:
        try:
            await self._store.save(epoch)
        except EpochConflictError as exc:
            # A new leader wrote it first (the fence): step down. With the lease still this
            # replica's, somebody else writes the bucket: that is a real conflict, and fatal.
            if await self._election.confirm():
                raise
            raise NotLeading(f"policy replica stepped down: another one leads now ({exc})") from None

    async def publish_orders(self, node: str, messages: Sequence[policy_pb2.RegenerationOrder]) -> None:
        subject = regen_subject(node)
        for message in messages:
            await self._bus.publish(subject, message)


def status_provider(controller: Controller, election: Election, cidrs: CidrIdentities) -> StatusProvider:
    def fill(status: common_pb2.ServiceStatus) -> None:
        snap = controller.core.queries.status()
        leading = election.leading.is_set()
        status.synced = snap.synced or (not leading and controller.core.warm)
        # A follower's own revision counter means nothing outside it; the leader's is the revision,
        # once it has taken over (synced: the stored revision seeded and stepped past). Before
        # that, just elected, it would show its follower counter, which can be below the last
        # revision the previous leader sent.
        status.revision = snap.revision if leading and snap.synced else 0
        leader = election.leader.name if election.leader is not None else ""
        status.details.update(
            {
                "role": election.role,
                "leader": leader or "(none: election under way)",
                "policies": str(snap.policies),
                "rejected": str(snap.rejected),
                "identities": str(snap.identities),
                "ipcache": str(snap.ipcache),
            }
        )
        if leading:
            status.details.update(
                {
                    "nodes": str(snap.nodes),
                    "endpoints": str(snap.endpoints),
                    "endpoints_behind": str(snap.endpoints_behind),
                    "endpoints_failed": str(snap.endpoints_failed),
                    "nodes_gone": str(snap.nodes_gone),
                    **cidrs.status(),
                }
            )
        status.members.extend(members_to_proto(election))

    return fill


def members_to_proto(election: Election) -> list[common_pb2.Member]:
    """The replicas with a heartbeat in the bucket; one silent for over a lease is shown as such."""
    now = time.time()
    out = []
    for member in sorted(election.members.values(), key=lambda m: m.name):
        silent = now - member.seen
        health = "ok" if silent <= election.lease else f"no heartbeat for {silent:.0f}s"
        leading = election.leader is not None and election.leader.name == member.name
        out.append(
            common_pb2.Member(
                group="policy",
                name=member.name,
                address=member.address,
                role="leader" if leading else "follower",
                health=health,
            )
        )
    return out


async def _go_live(
    ctx: ServiceContext[PolicyConfig],
    bus: Bus,
    inputs: Inputs,
    controller: Controller,
    election: Election,
    store: RevisionStore,
    imported: ApiPolicyStore,
    cidrs: CidrIdentities,
) -> None:
    """Warm (inputs replayed) -> SERVING and a candidate for leader -> on election, take over."""
    await inputs.wait_synced()
    await controller.call(lambda core, now: core.mark_warm(), JobKind.CHANGE)
    freeze_loaded()
    election.run_for_leader()
    ctx.log.info("policy inputs synced; candidate for leader", member=election.member)
    # SERVING once calls can be answered: as leader after taking over, as follower once a leader is known.
    await election.leader_known.wait()
    if not election.leading.is_set():
        await ctx.server.set_serving(True)
    while True:
        await election.leading.wait()
        try:
            await _take_over(ctx, bus, controller, election, store, imported)
            cidrs.lead()
        except NotLeading as exc:
            ctx.log.warning("policy takeover abandoned: no longer the leader", member=election.member, reason=str(exc))
        await election.stepped_down.wait()
        # Back to a follower's state, as a replica that never led (warm inputs kept), then campaign again.
        await controller.call(lambda core, now: core.follow(), JobKind.CHANGE)
        cidrs.follow()
        election.resume()
        ctx.log.info("policy replica following again", member=election.member)


async def _take_over(
    ctx: ServiceContext[PolicyConfig],
    bus: Bus,
    controller: Controller,
    election: Election,
    store: RevisionStore,
    imported: ApiPolicyStore,
) -> None:
    started = time.perf_counter()
    persisted = await claim_state(bus, election, store)
    stored = await bus.retry("load imported policies", imported.load, only=TRANSIENT)
    documents = await asyncio.to_thread(lambda: [(p, dump_document(p.object)) for p in stored])
    await controller.call(lambda core, now: core.lead(persisted, documents, now), JobKind.CHANGE, durable=True)
    await ctx.server.set_serving(True)
    ctx.log.info(
        "policy leader in place",
        member=election.member,
        revision=controller.core.revision,
        imported=len(stored),
        seconds=round(time.perf_counter() - started, 3),
    )


async def claim_state(bus: Bus, election: Election, store: RevisionStore) -> PolicyEpoch:
    """Read the stored state, confirm the lease is still ours, and write the state back (the claim).

    A takeover slowed down (a NATS server lost) may read the state only after another replica
    won the lease and published: it must not continue those sequences, so the lease is read
    after the state. Once claimed, a deposed leader's next write fails against ours; a deposed
    leader's write landing between our read and our claim is read again. Every call waits out a
    stream that lost its leader with a NATS server.
    """
    while True:
        persisted = await bus.retry("load policy state", store.load, only=TRANSIENT)
        if not await bus.retry("read leader lease", election.confirm, only=TRANSIENT):
            raise NotLeading("the lease was lost while the policy state was read")
        try:
            await store.claim(election.member)
        except EpochConflictError:
            if not election.leading.is_set():
                raise NotLeading("stepped down while claiming the policy state") from None
            continue
        return persisted


async def expire_nodes(controller: Controller, grace: float) -> None:
    """Every quarter grace, nodes whose datapath has been silent for a whole grace stop counting."""
    while True:
        await asyncio.sleep(grace / 4)
        controller.post(lambda core, now: core.expire_nodes(now, grace), JobKind.REALIZED)


async def send_owed_bumps(controller: Controller, interval: float) -> None:
    """Every interval, a commit with nothing else to do sends the revision bumps held back meanwhile."""
    while True:
        await asyncio.sleep(interval)
        controller.post(lambda core, now: None, JobKind.REALIZED)


def register(server: GrpcServer, servicer: Any) -> None:
    server.errors.add_mapping(relayed_status)
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, server.server)
    server.add_service(policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name)


def advertised(cfg: PolicyConfig, server: GrpcServer) -> str:
    """The address other replicas reach this one at (``--advertise-address``, else the listen address)."""
    if cfg.advertise_address:
        return cfg.advertise_address
    host = server.listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{host}:{server.port}"


async def setup(ctx: ServiceContext[PolicyConfig]) -> None:
    tune_gc()
    cfg = ctx.config
    bus = await ctx.bus()
    await bus.ensure_streams(*ALL_STREAMS)
    # Every JetStream call below waits out a cluster that is forming or lost a server (a stream
    # electing its leader answers nothing for seconds), within the bus's patience, rather than exiting.
    store = await bus.manage(
        "open policy state",
        lambda: RevisionStore.open(bus.js, cfg.state_bucket, pause=bus.pause, replicas=bus.replicas),
    )
    core = PolicyCore(persisted=PolicyEpoch(), cluster=cfg.cluster_name, bump_interval=cfg.bump_interval)
    imported = await ApiPolicyStore.open(bus, f"{cfg.state_bucket}_API")
    now = time.time()
    # Imported policies count like any input for a warm engine; the leader reloads them when it takes over.
    restored = await bus.manage("load imported policies", imported.load)
    for stored in restored:
        outcome = core.restore_imported(stored, dump_document(stored.object), now)
        if not outcome.accepted:
            ctx.log.error("imported policy no longer valid", policy=str(stored.key), error=outcome.error)
    member = cfg.member or re.sub(r"[^A-Za-z0-9_-]", "-", f"{socket.gethostname()}-{os.getpid()}")
    election = await bus.manage(
        "open leader lease",
        lambda: Election.open(
            bus,
            f"{cfg.state_bucket}_LEADER",
            member=member,
            address=lambda: advertised(cfg, ctx.server),
            lease=cfg.leader_lease,
        ),
    )
    max_bytes = min(cfg.max_order_bytes, max(1024, bus.max_payload - _PAYLOAD_HEADROOM))
    ipam_channel = open_channel(grpc_target(parse_addresses(cfg.ipam_address)), "ipam", ctx.credentials)
    ctx.stack.push_async_callback(ipam_channel.close)
    cidrs = CidrIdentities(
        GrpcCidrIdentities(ipam_channel, cfg.rpc_timeout),
        leading=election.leading.is_set,
        resync_interval=cfg.cidr_resync_interval,
    )
    controller = Controller(
        core,
        BusSink(bus, store, imported, election),
        encoding=Encoding(max_order_bytes=max_bytes, max_order_chunks=cfg.max_order_chunks),
        max_batch=cfg.max_batch,
        leading=election.leading.is_set,
        on_change=lambda core: cidrs.want(core.cidr_prefixes()),
    )
    ctx.stack.push_async_callback(election.resign)
    forwarder = Forwarder(election, ctx.credentials)
    ctx.stack.push_async_callback(forwarder.close)
    servicer = PolicyServicer(controller, wait_timeout=cfg.wait_timeout, max_wait_timeout=cfg.max_wait_timeout)
    register(ctx.server, routed(servicer, election, forwarder))
    ctx.server.status.provider = status_provider(controller, election, cidrs)
    servers = MemberView(nats_members(bus, f"KV_{cfg.state_bucket}"))
    ctx.server.status.add_members(servers)
    ctx.spawn(servers.run(), name="nats-members")
    ctx.spawn(controller.run(), name="policy-state")
    ctx.spawn(controller.run_publisher(), name="policy-publisher")
    ctx.spawn(election.run(), name="policy-election")
    inputs = Inputs(bus, controller)
    await inputs.start()
    ctx.stack.push_async_callback(inputs.stop)
    ctx.spawn(cidrs.run(), name="cidr-identities")
    ctx.spawn(_go_live(ctx, bus, inputs, controller, election, store, imported, cidrs), name="policy-sync")
    ctx.spawn(expire_nodes(controller, cfg.node_grace), name="node-grace")
    if cfg.bump_interval > 0:
        ctx.spawn(send_owed_bumps(controller, cfg.bump_interval), name="owed-bumps")
    ctx.log.info("policy replica started", member=member, imported=len(restored), max_order_bytes=max_bytes)


def main(argv: list[str] | None = None) -> int:
    return run_service("policy", PolicyConfig, setup, argv)
