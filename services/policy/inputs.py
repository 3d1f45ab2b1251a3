"""Bus consumers: policy deltas and the synced marker, identities, ipcache.

Each message becomes a job for the controller, in stream order. ``wait_synced``
returns once the world is fully known: the watcher's ``palisade.k8s.synced``
marker has been seen (every policy delta before it in the stream is queued
ahead of it) and the identity and ipcache streams have been replayed.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from palisade.v1 import identity_pb2, k8s_pb2
from services.common.bus import SYNCED_SUBJECT, Bus, Follower
from services.common.log import get_logger
from services.policy import metrics
from services.policy.controller import Controller
from services.policy.engine.core import PolicyCore
from services.policy.engine.sources import KIND_TOKENS

log = get_logger("inputs")

POLICY_SUBJECTS = tuple(f"palisade.k8s.{token}.>" for token in KIND_TOKENS)
IDENTITY_SUBJECTS = "palisade.identity.>"
IPCACHE_SUBJECTS = "palisade.ipcache.>"


class Inputs:
    """The service's three followers, feeding one controller."""

    def __init__(self, bus: Bus, controller: Controller) -> None:
        self._bus = bus
        self._controller = controller
        self.k8s_synced = asyncio.Event()
        self._k8s: Follower | None = None
        self._identity: Follower | None = None
        self._ipcache: Follower | None = None

    async def start(self) -> None:
        # One ordered consumer over the policy kinds and the marker keeps their stream order,
        # so when the marker arrives every delta of the initial list is already queued.
        self._k8s = await self._bus.follow_raw([*POLICY_SUBJECTS, SYNCED_SUBJECT], self._on_k8s)
        self._identity = await self._bus.follow(IDENTITY_SUBJECTS, identity_pb2.IdentityUpdate, self._on_identity)
        self._ipcache = await self._bus.follow(IPCACHE_SUBJECTS, identity_pb2.IpcacheEntry, self._on_ipcache)

    async def wait_synced(self) -> None:
        assert self._identity is not None and self._ipcache is not None, "start() first"
        await self.k8s_synced.wait()
        await self._identity.caught_up.wait()
        await self._ipcache.caught_up.wait()
        log.info("inputs synced")

    async def stop(self) -> None:
        for follower in (self._k8s, self._identity, self._ipcache):
            if follower is not None:
                await follower.stop()

    async def _on_k8s(self, msg: Msg) -> None:
        try:
            if msg.subject == SYNCED_SUBJECT:
                marker = k8s_pb2.SyncedMarker()
                marker.ParseFromString(msg.data)
                if not self.k8s_synced.is_set():
                    log.info(
                        "kubernetes synced",
                        source=marker.source,
                        kinds=",".join(marker.kinds),
                        missing=",".join(marker.missing_kinds),
                    )
                self.k8s_synced.set()
                return
            delta = k8s_pb2.K8sDelta()
            delta.ParseFromString(msg.data)
        except Exception as exc:
            log.error("undecodable message skipped", subject=msg.subject, error=str(exc))
            return

        def apply(core: PolicyCore, now: float) -> None:
            outcome = core.apply_policy_delta(delta, now)
            if outcome is not None and not outcome.accepted:
                metrics.REJECTED.labels(outcome.source.value).inc()

        self._controller.post(apply)

    async def _on_identity(self, subject: str, update: identity_pb2.IdentityUpdate) -> None:
        def apply(core: PolicyCore, now: float) -> None:
            core.apply_identity(subject, update, now)

        self._controller.post(apply)

    async def _on_ipcache(self, subject: str, entry: identity_pb2.IpcacheEntry) -> None:
        def apply(core: PolicyCore, now: float) -> None:
            core.apply_ipcache(subject, entry, now)

        self._controller.post(apply)
