"""Bus consumers: policy, Service and EndpointSlice deltas and the synced marker, identities, ipcache.

Each message becomes a job for the controller, in stream order. ``wait_synced``
returns once the world is fully known: the watcher's ``palisade.k8s.synced``
marker has been seen (every policy delta before it in the stream is queued
ahead of it) and the identity and ipcache streams have been replayed.
"""

from __future__ import annotations

import asyncio

from palisade.v1 import identity_pb2, k8s_pb2
from services.common.bus import Bus, Follower
from services.common.largeobjects import LargeObjects
from services.common.log import get_logger
from services.common.subjects import IDENTITY_ALL, IPCACHE_ALL, SYNCED_SUBJECT, k8s_filter
from services.policy import metrics
from services.policy.controller import Controller, JobKind
from services.policy.engine.core import PolicyCore
from services.policy.engine.ipcache import IpcacheRecord
from services.policy.engine.sources import KIND_TOKENS
from services.policy.wire import IpcacheError, delta_from_proto, identity_from_proto, record_from_proto

log = get_logger("inputs")

POLICY_SUBJECTS = tuple(k8s_filter(token) for token in KIND_TOKENS)
#: Node objects: a deleted one takes its node out of the realized counts.
NODE_SUBJECT = k8s_filter("node")
#: Services and EndpointSlices: what ``toServices`` rules name.
SERVICE_SUBJECTS = (k8s_filter("service"), k8s_filter("endpointslice"))
#: Namespaces: their policy.palisade.io/mode annotation puts their policies in audit.
NAMESPACE_SUBJECT = k8s_filter("namespace")


class Inputs:
    """The service's three followers, feeding one controller."""

    def __init__(self, bus: Bus, controller: Controller) -> None:
        self._bus = bus
        self._controller = controller
        self.k8s_synced = asyncio.Event()
        self._k8s: Follower | None = None
        self._identity: Follower | None = None
        self._ipcache: Follower | None = None
        self._large = LargeObjects(bus)

    async def start(self) -> None:
        # One ordered consumer over the policy kinds and the marker keeps their stream order,
        # so when the marker arrives every delta of the initial list is already queued.
        subjects = [*POLICY_SUBJECTS, *SERVICE_SUBJECTS, NODE_SUBJECT, NAMESPACE_SUBJECT, SYNCED_SUBJECT]
        self._k8s = await self._bus.follow_raw(subjects, self._on_k8s)
        self._identity = await self._bus.follow(IDENTITY_ALL, identity_pb2.IdentityUpdate, self._on_identity)
        self._ipcache = await self._bus.follow(IPCACHE_ALL, identity_pb2.IpcacheEntry, self._on_ipcache)

    async def wait_synced(self) -> None:
        assert self._identity is not None and self._ipcache is not None, "start() first"
        await self.k8s_synced.wait()
        await self._identity.caught_up.wait()
        await self._ipcache.caught_up.wait()
        log.info("inputs synced")

    async def stop(self) -> None:
        for follower in (self._identity, self._ipcache, self._k8s):
            if follower is not None:
                await follower.stop()

    async def _on_k8s(self, subject: str, data: bytes) -> None:
        try:
            if subject == SYNCED_SUBJECT:
                marker = k8s_pb2.SyncedMarker()
                marker.ParseFromString(data)
                if not self.k8s_synced.is_set():
                    log.info(
                        "kubernetes synced",
                        source=marker.source,
                        kinds=",".join(marker.kinds),
                        missing=",".join(marker.missing_kinds),
                    )
                self.k8s_synced.set()
                return
            parsed = k8s_pb2.K8sDelta()
            parsed.ParseFromString(data)
        except Exception as exc:
            log.error("undecodable message skipped", subject=subject, error=str(exc))
            return
        if parsed.kind == k8s_pb2.K8S_KIND_NODE:
            name, deleted = parsed.name, parsed.op == k8s_pb2.DELTA_OP_DELETE
            self._controller.post(lambda core, now: core.apply_node_delta(name, deleted=deleted), JobKind.REALIZED)
            return
        resolved = await self._large.resolved(parsed)
        if resolved is None:
            return
        delta = delta_from_proto(resolved)

        def apply(core: PolicyCore, now: float) -> None:
            outcome = core.apply_policy_delta(delta, now)
            if outcome is not None and not outcome.accepted:
                metrics.REJECTED.labels(outcome.source.value).inc()

        self._controller.post(apply)

    async def _on_identity(self, subject: str, update: identity_pb2.IdentityUpdate) -> None:
        change = identity_from_proto(subject, update)
        if change is None:
            log.warning("identity update without id", subject=subject)
            return

        def apply(core: PolicyCore, now: float) -> None:
            core.apply_identity(change, now)

        self._controller.post(apply)

    async def _on_ipcache(self, subject: str, entry: identity_pb2.IpcacheEntry) -> None:
        record: IpcacheRecord | None = None
        if not entry.deleted:
            try:
                record = record_from_proto(entry)
            except IpcacheError as exc:
                log.warning("ipcache entry ignored", subject=subject, error=str(exc))
                return

        def apply(core: PolicyCore, now: float) -> None:
            core.apply_ipcache(subject, record, now)

        self._controller.post(apply)
