"""Announcing identities and the ipcache on NATS (and keeping the ipcache in etcd).

``palisade.identity.<id>`` carries an IdentityUpdate per allocated identity and a
tombstone once it is collected; ``palisade.ipcache.<prefix>`` an IpcacheEntry per
pod address and a tombstone when the address goes. Both streams are compacted,
so republishing is harmless and is how a restarted ipam makes sure consumers
have everything. Reference counts are not published (they change with every
pod and would churn the stream); IdentityService answers them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

from palisade.v1 import identity_pb2
from services.common.bus import Bus
from services.common.labels import LabelSet
from services.common.log import get_logger
from services.common.subjects import identity_subject, ipcache_subject
from services.ipam import keys
from services.ipam.kv import Change, Store
from services.ipam.model import Identity

log = get_logger("publish")

#: Publishes in flight at once when republishing everything (acks are awaited per batch).
REPUBLISH_BATCH = 256


@dataclasses.dataclass(frozen=True, slots=True)
class _Published:
    labels: LabelSet
    revision: int


class IdentityPublisher:
    """Publishes each identity once per label set and tombstones collected ones."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._published: dict[int, _Published] = {}

    def count(self) -> int:
        return len(self._published)

    async def _send(self, identity: Identity, deleted: bool = False) -> None:
        update = identity_pb2.IdentityUpdate(identity=identity.to_proto(), deleted=deleted)
        await self._bus.publish(identity_subject(identity.id), update)

    async def seen(self, identity: Identity, revision: int) -> None:
        """An identity is in use (``revision``: when etcd said so); publish it if it is news."""
        known = self._published.get(identity.id)
        if known is not None and known.labels == identity.labels:
            if revision > known.revision:
                self._published[identity.id] = _Published(identity.labels, revision)
            return
        self._published[identity.id] = _Published(identity.labels, revision)
        await self._send(identity)

    async def gone(self, identity: Identity) -> None:
        """An identity was deleted (by any allocator): tombstone it if it was announced here."""
        if identity.id in self._published:
            await self.collected(identity)

    async def collected(self, identity: Identity) -> None:
        self._published.pop(identity.id, None)
        await self._send(identity, deleted=True)
        log.info("identity tombstoned", id=identity.id)

    async def resync(self, current: Mapping[int, LabelSet], revision: int, *, republish: bool = False) -> None:
        """Match the bus to etcd's identities as listed at ``revision``.

        Identities published after that revision are left alone: the listing
        predates them, so their absence from it means nothing.
        """
        send = []
        for ident, labels in sorted(current.items()):
            known = self._published.get(ident)
            if republish or known is None or known.labels != labels:
                self._published[ident] = _Published(labels, revision)
                send.append(Identity(ident, labels))
        for i in range(0, len(send), REPUBLISH_BATCH):
            await asyncio.gather(*(self._send(identity) for identity in send[i : i + REPUBLISH_BATCH]))
        for ident, known in sorted(self._published.items()):
            if ident not in current and known.revision <= revision:
                await self.collected(Identity(ident, known.labels))


def entry_key(entry: identity_pb2.IpcacheEntry) -> bytes:
    return keys.ipcache(entry.prefix)


def same_entry(a: identity_pb2.IpcacheEntry, b: identity_pb2.IpcacheEntry) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


class IpcacheWriter:
    """The ipcache as stored in etcd and announced on the bus; skips writes that change nothing."""

    def __init__(self, store: Store, bus: Bus) -> None:
        self._store = store
        self._bus = bus
        self.entries: dict[str, identity_pb2.IpcacheEntry] = {}

    async def load(self) -> None:
        kvs, _ = await self._store.get_prefix(keys.IPCACHE.encode())
        self.entries = {}
        for kv in kvs:
            entry = identity_pb2.IpcacheEntry()
            try:
                entry.ParseFromString(kv.value)
            except Exception as exc:
                log.warning("skipping malformed ipcache entry", key=kv.key.decode(errors="replace"), error=str(exc))
                continue
            self.entries[entry.prefix] = entry

    def observe(self, change: Change) -> None:
        """Apply a change to an ipcache key, written by any ipam, as the watch saw it."""
        prefix = change.kv.key.decode(errors="replace").removeprefix(keys.IPCACHE)
        if change.deleted:
            self.entries.pop(prefix, None)
            return
        entry = identity_pb2.IpcacheEntry()
        try:
            entry.ParseFromString(change.kv.value)
        except Exception as exc:
            log.warning("malformed ipcache entry ignored", prefix=prefix, error=str(exc))
            return
        self.entries[entry.prefix or prefix] = entry

    async def republish(self) -> None:
        prefixes = sorted(self.entries)
        for i in range(0, len(prefixes), REPUBLISH_BATCH):
            batch = prefixes[i : i + REPUBLISH_BATCH]
            await asyncio.gather(*(self._bus.publish(ipcache_subject(p), self.entries[p]) for p in batch))

    async def upsert(self, entry: identity_pb2.IpcacheEntry) -> None:
        known = self.entries.get(entry.prefix)
        if known is not None and same_entry(known, entry):
            return
        await self._store.put(entry_key(entry), entry.SerializeToString(deterministic=True))
        self.entries[entry.prefix] = entry
        await self._bus.publish(ipcache_subject(entry.prefix), entry)

    async def delete(self, prefix: str) -> None:
        known = self.entries.pop(prefix, None)
        await self._store.delete(keys.ipcache(prefix))
        tombstone = identity_pb2.IpcacheEntry(prefix=prefix, deleted=True)
        if known is not None:
            tombstone.identity = known.identity
            tombstone.node = known.node
            tombstone.namespace = known.namespace
            tombstone.pod = known.pod
        await self._bus.publish(ipcache_subject(prefix), tombstone)
