"""Kubernetes objects larger than the bus's maximum payload: stored aside, referenced from the stream.

A ``K8sDelta`` whose encoding does not fit the server's max payload (a 5 MB policy
with 20,000 rules) cannot be published on the compacted k8s stream. The watcher
puts its ``object_json`` into the JetStream object store :data:`BUCKET` (which
chunks what it stores) under the SHA-256 of the bytes (and of the subject, so two
objects with equal bytes never share one stored copy), and publishes the delta with
``object_json`` empty and ``object_ref`` naming the stored object (a tombstone that
large is published without its last state instead). Every consumer
of the stream passes each delta through :meth:`LargeObjects.resolve`, which puts
the bytes back (checking the digest), so consumers never see a reference.

Stored objects are immutable (named by content). The watcher deletes the one a
subject referenced once a newer delta of that subject is acked; a consumer that
still held the older delta finds it gone and skips it, because the newer delta is
already behind it in the stream. At start, the watcher removes what no current
delta references (:meth:`LargeObjects.collect`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable

from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from palisade.v1 import k8s_pb2
from services.common.bus import Bus, Follower
from services.common.log import get_logger

log = get_logger("largeobjects")

BUCKET = "PALISADE_K8S_OBJECTS"
#: Room left under the max payload for headers and the protocol's framing.
HEADROOM = 4096


class LargeObjectMissing(Exception):
    """The object a delta references is gone (a newer delta of its subject replaced it)."""


class LargeObjects:
    """The object store of oversized objects, bound lazily on first use."""

    def __init__(self, bus: Bus, bucket: str = BUCKET) -> None:
        self._bus = bus
        self._bucket = bucket
        self._store: ObjectStore | None = None

    @property
    def limit(self) -> int:
        """The largest encoded delta published inline, bytes."""
        return max(1024, self._bus.max_payload - HEADROOM)

    async def _open(self) -> ObjectStore:
        if self._store is None:
            self._store = await self._bus.object_store(self._bucket, "Palisade Kubernetes objects too large to publish")
        return self._store

    async def externalize(self, delta: k8s_pb2.K8sDelta) -> k8s_pb2.K8sDelta:
        """``delta`` itself when it fits a message; else a copy referencing its stored ``object_json``."""
        if delta.ByteSize() <= self.limit:
            return delta
        if delta.op == k8s_pb2.DELTA_OP_DELETE:
            # A tombstone names its object; its last state is a courtesy that does not fit.
            bare = k8s_pb2.K8sDelta()
            bare.CopyFrom(delta)
            bare.object_json = b""
            return bare
        data = delta.object_json
        owner = f"{delta.kind}/{delta.namespace}/{delta.name}".encode()
        name = f"{hashlib.sha256(data).hexdigest()}-{hashlib.sha256(owner).hexdigest()[:16]}"
        store = await self._open()
        await self._bus.retry("store large object", lambda: store.put(name, data), object=name, bytes=len(data))
        slim = k8s_pb2.K8sDelta()
        slim.CopyFrom(delta)
        slim.object_json = b""
        slim.object_ref = name
        log.info("object stored aside", kind=int(delta.kind), name=delta.name, bytes=len(data), object=name)
        return slim

    async def resolve(self, delta: k8s_pb2.K8sDelta) -> k8s_pb2.K8sDelta:
        """``delta`` with its ``object_json`` in place; :class:`LargeObjectMissing` if it was replaced since."""
        if not delta.object_ref:
            return delta
        name = delta.object_ref
        store = await self._open()
        try:
            result = await self._bus.retry(
                "fetch large object", lambda: _get(store, name), final=(ObjectNotFoundError,), object=name
            )
        except ObjectNotFoundError:
            raise LargeObjectMissing(f"large object {name} of {delta.name} is gone; a newer version follows") from None
        data = result
        if hashlib.sha256(data).hexdigest() != name.partition("-")[0]:
            raise LargeObjectMissing(f"large object {name} of {delta.name} is incomplete or corrupt")
        full = k8s_pb2.K8sDelta()
        full.CopyFrom(delta)
        full.object_ref = ""
        full.object_json = data
        return full

    async def resolved(self, delta: k8s_pb2.K8sDelta) -> k8s_pb2.K8sDelta | None:
        """Like :meth:`resolve`, but None (logged) when the object is gone: a newer delta follows."""
        try:
            return await self.resolve(delta)
        except LargeObjectMissing as exc:
            log.info("superseded large object skipped", reason=str(exc))
            return None

    async def forget(self, name: str) -> None:
        """Delete a stored object no delta references any more."""
        store = await self._open()
        try:
            await self._bus.retry(
                "delete large object", lambda: store.delete(name), attempts=5, final=(ObjectNotFoundError,), object=name
            )
        except (ObjectNotFoundError, NotFoundError):
            pass
        except Exception as exc:  # left for the next start's collection
            log.warning("large object not deleted", object=name, error=str(exc))

    async def collect(self, referenced: Iterable[str]) -> int:
        """Delete every stored object not in ``referenced``; how many were deleted."""
        keep = set(referenced)
        store = await self._open()
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return 0
        stale = [info.name for info in infos if info.name and not info.deleted and info.name not in keep]
        for name in stale:
            await self.forget(name)
        if stale:
            log.info("unreferenced large objects deleted", objects=len(stale))
        return len(stale)


async def _get(store: ObjectStore, name: str) -> bytes:
    result = await store.get(name)
    return result.data or b""


async def follow_deltas(
    bus: Bus, subject: str, handler: Callable[[str, k8s_pb2.K8sDelta], Awaitable[None]]
) -> Follower:
    """:meth:`Bus.follow` for K8sDelta subjects, with large objects put back in place."""
    large = LargeObjects(bus)

    async def resolved(msg_subject: str, delta: k8s_pb2.K8sDelta) -> None:
        full = await large.resolved(delta)
        if full is not None:
            await handler(msg_subject, full)

    return await bus.follow(subject, k8s_pb2.K8sDelta, resolved)
