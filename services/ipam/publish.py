"""Announcing identities and the ipcache on NATS (and keeping the ipcache in etcd).

``palisade.identity.<id>`` carries an IdentityUpdate per allocated identity and a
tombstone once it is collected; ``palisade.ipcache.<prefix>`` an IpcacheEntry per
pod address and a tombstone when the address goes. Both streams are compacted,
so republishing is harmless and is how a restarted ipam makes sure consumers
have everything. Reference counts are not published (they change with every
pod and would churn the stream); IdentityService answers them.

Each new identity is announced once, by the replica that created it (see
:mod:`services.ipam.replica`); the others take note of it from the watch without
publishing, and announce it themselves only when its creator's record goes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Collection, Mapping

from palisade.v1 import identity_pb2
from services.common.bus import Bus
from services.common.labels import LabelSet
from services.common.log import get_logger
from services.common.subjects import identity_subject, ipcache_subject
from services.ipam import keys
from services.ipam.kv import Change, Delete, Put, Store
from services.ipam.model import Identity

log = get_logger("publish")

#: Publishes in flight at once when republishing everything (acks are awaited per batch).
REPUBLISH_BATCH = 256


@dataclasses.dataclass(frozen=True, slots=True)
class _Published:
    labels: LabelSet
    revision: int
    #: Sent by this process; False: announced by the replica that created it.
    sent: bool = True


class IdentityPublisher:
    """Publishes each identity once per label set and tombstones collected ones."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        #: What the bus holds as far as this process knows: sent here, or left to the creator.
        self._published: dict[int, _Published] = {}
        #: Identities created here whose announcement failed, to send again (:meth:`retry_owed`).
        self._owed: dict[int, Identity] = {}

    def count(self) -> int:
        return len(self._published)

    def owed(self) -> int:
        return len(self._owed)

    async def _send(self, identity: Identity, deleted: bool = False) -> None:
        update = identity_pb2.IdentityUpdate(identity=identity.to_proto(), deleted=deleted)
        await self._bus.publish(identity_subject(identity.id), update)

    async def _announce(self, identity: Identity, revision: int) -> None:
        self._published[identity.id] = _Published(identity.labels, revision)
        try:
            await self._send(identity)
        except BaseException:
            # Not on the bus: whoever meets the identity next (or the retry) sends it again.
            if self._published.get(identity.id) == _Published(identity.labels, revision):
                del self._published[identity.id]
            raise

    async def seen(self, identity: Identity, revision: int) -> None:
        """An identity is in use (``revision``: when etcd said so); publish it if it is news."""
        known = self._published.get(identity.id)
        if known is not None and known.labels == identity.labels:
            if revision > known.revision:
                self._published[identity.id] = dataclasses.replace(known, revision=revision)
            return
        await self._announce(identity, revision)

    async def created(self, identity: Identity, revision: int) -> None:
        """This process created the identity: announcing it is its job alone (the others only note it).

        A failed announcement is kept and sent again by :meth:`retry_owed`.
        """
        known = self._published.get(identity.id)
        if known is not None and known.sent and known.labels == identity.labels:
            return
        try:
            await self._announce(identity, revision)
        except Exception:
            self._owed[identity.id] = identity
            raise
        self._owed.pop(identity.id, None)

    def heard(self, identity: Identity, revision: int) -> None:
        """Another replica created the identity and announces it: take note, publish nothing."""
        known = self._published.get(identity.id)
        if known is None or known.labels != identity.labels:
            self._published[identity.id] = _Published(identity.labels, revision, sent=False)

    async def orphaned(self, identity: Identity, revision: int) -> None:
        """The identity's creator is gone (perhaps before announcing it): announce it unless sent here."""
        known = self._published.get(identity.id)
        if known is not None and known.sent and known.labels == identity.labels:
            return
        await self._announce(identity, revision)

    async def retry_owed(self, labels_of: Callable[[int], LabelSet | None]) -> None:
        """Send again the failed announcements of identities created here that still exist (``labels_of``)."""
        for ident, identity in sorted(self._owed.items()):
            if labels_of(ident) != identity.labels:
                del self._owed[ident]
                continue
            known = self._published.get(ident)
            await self._announce(identity, known.revision if known is not None else 0)
            del self._owed[ident]

    async def gone(self, identity: Identity) -> None:
        """An identity was deleted (by any allocator): tombstone it if it was announced here."""
        if identity.id in self._published:
            await self.collected(identity)

    async def collected(self, identity: Identity) -> None:
        self._published.pop(identity.id, None)
        await self._send(identity, deleted=True)
        log.info("identity tombstoned", id=identity.id)

    async def resync(
        self,
        current: Mapping[int, LabelSet],
        revision: int,
        *,
        republish: bool = False,
        unwatched: Collection[int] = (),
    ) -> None:
        """Match the bus to etcd's identities as listed at ``revision``.

        Identities published after that revision are left alone: the listing
        predates them, so their absence from it means nothing. Identities in
        ``unwatched`` (written after the last change the etcd watch applied here)
        are left to the watch too, unless known here already: it tells whether
        their creator announces them, and a listing that overtook it does not.
        """
        send = []
        for ident, labels in sorted(current.items()):
            known = self._published.get(ident)
            if known is None and ident in unwatched and not republish:
                continue
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
        # As a transaction, so that entries written together (a wave of pods) share etcd batches.
        await self._store.txn([], [Put(entry_key(entry), entry.SerializeToString(deterministic=True))])
        self.entries[entry.prefix] = entry
        await self._bus.publish(ipcache_subject(entry.prefix), entry)

    async def delete(self, prefix: str) -> None:
        known = self.entries.pop(prefix, None)
        await self._store.txn([], [Delete(keys.ipcache(prefix))])
        tombstone = identity_pb2.IpcacheEntry(prefix=prefix, deleted=True)
        if known is not None:
            tombstone.identity = known.identity
            tombstone.node = known.node
            tombstone.namespace = known.namespace
            tombstone.pod = known.pod
        await self._bus.publish(ipcache_subject(prefix), tombstone)
