"""The policy service: bus inputs -> one state-owning task -> per-node orders, plus PolicyService.

A thin shell. Startup: load the persisted revision and sequences and the policies
imported over the API, follow the inputs (replayed into one engine batch), and
only once Kubernetes is synced and the identity and ipcache streams are replayed
send every node its whole state and report SERVING.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from palisade.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.common.bus import ALL_STREAMS, Bus
from services.common.grpcserver import GrpcServer, StatusProvider
from services.common.runner import ServiceContext, run_service
from services.common.subjects import regen_subject
from services.policy.apistore import ApiPolicyStore
from services.policy.config import PolicyConfig
from services.policy.controller import Controller, Encoding, JobKind
from services.policy.documents import dump_document
from services.policy.engine.core import PolicyCore
from services.policy.engine.orders import PersistedState
from services.policy.engine.registry import ApiChange
from services.policy.inputs import Inputs
from services.policy.revision import RevisionStore
from services.policy.servicer import PolicyServicer

# Room left under the server's max payload for NATS/JetStream headers.
_PAYLOAD_HEADROOM = 4096


class BusSink:
    """Persists imported policies and counters, and publishes orders on ``palisade.regen.<node>``."""

    def __init__(self, bus: Bus, store: RevisionStore, imported: ApiPolicyStore) -> None:
        self._bus = bus
        self._store = store
        self._imported = imported

    async def save_policies(self, changes: Sequence[ApiChange]) -> None:
        await self._imported.save(changes)

    async def save_state(self, state: PersistedState) -> None:
        await self._store.save(state)

    async def publish_orders(self, node: str, messages: Sequence[policy_pb2.RegenerationOrder]) -> None:
        subject = regen_subject(node)
        for message in messages:
            await self._bus.publish(subject, message)


def status_provider(controller: Controller) -> StatusProvider:
    def fill(status: common_pb2.ServiceStatus) -> None:
        snap = controller.core.status()
        status.synced = snap.synced
        status.revision = snap.revision
        status.details.update(
            {
                "policies": str(snap.policies),
                "rejected": str(snap.rejected),
                "identities": str(snap.identities),
                "ipcache": str(snap.ipcache),
                "nodes": str(snap.nodes),
                "endpoints": str(snap.endpoints),
                "endpoints_behind": str(snap.endpoints_behind),
                "endpoints_failed": str(snap.endpoints_failed),
            }
        )

    return fill


async def _go_live(ctx: ServiceContext[PolicyConfig], inputs: Inputs, controller: Controller) -> None:
    await inputs.wait_synced()
    await controller.call(lambda core, now: core.mark_synced(now), JobKind.CHANGE, durable=True)
    ctx.log.info("policy synced", revision=controller.core.revision)
    await ctx.server.set_serving(True)


def register(server: GrpcServer, servicer: PolicyServicer) -> None:
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, server.server)
    server.add_service(policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name)


async def setup(ctx: ServiceContext[PolicyConfig]) -> None:
    cfg = ctx.config
    bus = await ctx.bus()
    await bus.ensure_streams(*ALL_STREAMS)
    store = await RevisionStore.open(bus.js, cfg.state_bucket, pause=bus.pause, replicas=bus.replicas)
    persisted = await store.load()
    core = PolicyCore(persisted=persisted, cluster=cfg.cluster_name)
    imported = await ApiPolicyStore.open(bus, f"{cfg.state_bucket}_API")
    now = time.time()
    restored = await imported.load()
    for stored in restored:
        outcome = core.restore_imported(stored, dump_document(stored.object), now)
        if not outcome.accepted:
            ctx.log.error("imported policy no longer valid", policy=str(stored.key), error=outcome.error)
    max_bytes = min(cfg.max_order_bytes, max(1024, bus.max_payload - _PAYLOAD_HEADROOM))
    controller = Controller(
        core,
        BusSink(bus, store, imported),
        encoding=Encoding(max_order_bytes=max_bytes, max_order_chunks=cfg.max_order_chunks),
        max_batch=cfg.max_batch,
    )
    register(
        ctx.server,
        PolicyServicer(controller, wait_timeout=cfg.wait_timeout, max_wait_timeout=cfg.max_wait_timeout),
    )
    ctx.server.status.provider = status_provider(controller)
    ctx.spawn(controller.run(), name="policy-state")
    ctx.spawn(controller.run_publisher(), name="policy-publisher")
    inputs = Inputs(bus, controller)
    await inputs.start()
    ctx.stack.push_async_callback(inputs.stop)
    ctx.spawn(_go_live(ctx, inputs, controller), name="policy-sync")
    ctx.log.info(
        "policy state loaded",
        revision=persisted.revision,
        nodes=len(persisted.sequences),
        imported=len(restored),
        max_order_bytes=max_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    return run_service("policy", PolicyConfig, setup, argv)
