"""Keep this ipam's in-memory view equal to etcd, whoever writes it: the watch on ``/palisade/``.

Several ipam replicas share one etcd. Each allocates through transactions (so none
ever hands out an id or an address twice), but each also answers ListAllocations,
status figures and allocation hints from memory: without this watch a replica would
only know its own writes. Every change under ``/palisade/`` is applied to the
identity allocator, the address allocator and the ipcache, in revision order.

Announcing identities on the bus: an identity whose creating transaction names a
creator replica (``/palisade/identities/creators/<id>``) is announced by that replica
alone; the others only take note. When a creators key goes while its identity stays
(its creator died, perhaps between its etcd write and its publish), every replica that
sees it announces the identity. An identity that appears with no creator (written by
another allocator) and every tombstone are announced at once, as etcd ordered them.

The watch starts right after the revision the view was loaded at; if etcd compacted
that revision away, the view is reloaded and the watch starts again after it.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Awaitable, Callable

from services.common.backoff import Backoff
from services.common.log import get_logger
from services.ipam import keys
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Change, Compacted, Store
from services.ipam.model import Identity
from services.ipam.publish import IdentityPublisher, IpcacheWriter

log = get_logger("mirror")

#: Announcements published together at most.
ANNOUNCE_BATCH = 256
#: Seconds between attempts to send again announcements of this replica that failed.
RETRY_OWED = 1.0


class Seen(enum.Enum):
    """What the watch saw happen to an identity."""

    #: Appeared with no creator: announced here (unless already on the bus).
    APPEARED = "appeared"
    #: Created by another replica, which announces it: noted only.
    HEARD = "heard"
    #: Its creator's record went while it stays: announced here unless sent here already.
    ORPHANED = "orphaned"
    #: Deleted: tombstoned.
    WENT = "went"


#: (identity, what happened, etcd revision)
Announcement = tuple[Identity, Seen, int]


class Mirror:
    def __init__(
        self,
        store: Store,
        allocator: IdentityAllocator,
        ipalloc: IPAllocator,
        ipcache: IpcacheWriter,
        publisher: IdentityPublisher,
        *,
        reload: Callable[[], Awaitable[None]],
        replica: str = "",
    ) -> None:
        self._store = store
        self._allocator = allocator
        self._ipalloc = ipalloc
        self._ipcache = ipcache
        self._publisher = publisher
        self._reload = reload
        self._announcements: asyncio.Queue[Announcement] = asyncio.Queue()
        #: This replica's name in creators keys ("" when it records none).
        self._replica = replica
        #: The creator of each identity and the revision that recorded it, as the watch saw them.
        self._creators: dict[int, tuple[str, int]] = {}
        #: The last etcd revision applied (from the watch or a reload).
        self.revision = 0

    def apply(self, change: Change) -> None:
        """Fold one change into the view; identities that appeared or went are queued for the bus."""
        key = change.kv.key
        if key.startswith(keys.IDENTITY_IDS.encode()) or key.startswith(keys.IDENTITY_OWNERS.encode()):
            found = self._allocator.observe(change)
            if found is not None:
                self._identity_changed(found[0], found[1], change.revision)
        elif key.startswith(keys.IDENTITY_CREATORS.encode()):
            self._creator_changed(change)
        elif key.startswith(keys.IPCACHE.encode()):
            self._ipcache.observe(change)
        elif key.startswith(b"/palisade/ipam/"):
            self._ipalloc.observe(change)
        self.revision = max(self.revision, change.revision)

    def _identity_changed(self, identity: Identity, deleted: bool, revision: int) -> None:
        if deleted:
            self._announcements.put_nowait((identity, Seen.WENT, revision))
            return
        creator = self._creators.get(identity.id)
        if creator is None or creator[1] != revision:
            # No creator in this transaction: a reference taken (already announced) or another writer.
            self._announcements.put_nowait((identity, Seen.APPEARED, revision))
        elif creator[0] != self._replica:
            self._announcements.put_nowait((identity, Seen.HEARD, revision))
        # Created here: the allocation announces it (and sends it again if that fails).

    def _creator_changed(self, change: Change) -> None:
        try:
            ident = keys.parse_identity_creator(change.kv.key)
        except ValueError as exc:
            log.warning("malformed creator key ignored", key=change.kv.key.decode(errors="replace"), error=str(exc))
            return
        if not change.deleted:
            self._creators[ident] = (change.kv.value.decode(errors="replace"), change.revision)
            return
        self._creators.pop(ident, None)
        labels = self._allocator.labels_of(ident)
        if labels is not None:  # collected identities lose their creator in the same transaction
            self._announcements.put_nowait((Identity(ident, labels), Seen.ORPHANED, change.revision))

    async def run(self, loaded_at: int) -> None:
        """Follow etcd from the revision after ``loaded_at`` (the revision the view was loaded at) forever."""
        self.revision = loaded_at
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                async for change in self._store.watch(keys.ROOT.encode(), self.revision + 1):
                    self.apply(change)
                    backoff.reset()
                log.warning("etcd watch ended, watching again", after=self.revision)
            except Compacted as exc:
                log.warning("etcd history compacted under the watch, reloading", error=str(exc))
                revision = await self._store.revision()
                await self._reload()
                self.revision = revision
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("etcd watch failed, watching again", after=self.revision, error=str(exc))
            await backoff.sleep()

    async def announce(self) -> None:
        """Publish identities the watch saw appear or go (dropped by the publisher when already announced).

        What queued up meanwhile goes at once: a run of announcements of one kind is published
        together and its acks awaited together, runs in their order. Announcements of this
        replica's own identities that failed are sent again every :data:`RETRY_OWED` seconds.
        """
        while True:
            try:
                patience = RETRY_OWED if self._publisher.owed() else None
                first = await asyncio.wait_for(self._announcements.get(), patience)
            except TimeoutError:
                try:
                    await self._publisher.retry_owed(self._allocator.labels_of)
                except Exception as exc:
                    log.warning("identity announcement failed again", owed=self._publisher.owed(), error=str(exc))
                continue
            pending = [first]
            while len(pending) < ANNOUNCE_BATCH and not self._announcements.empty():
                pending.append(self._announcements.get_nowait())
            for seen, run in itertools.groupby(pending, key=lambda a: a[1]):
                if seen is Seen.WENT:
                    await asyncio.gather(*(self._publisher.gone(identity) for identity, _, _ in run))
                elif seen is Seen.HEARD:
                    for identity, _, rev in run:
                        self._publisher.heard(identity, rev)
                elif seen is Seen.ORPHANED:
                    await asyncio.gather(*(self._publisher.orphaned(identity, rev) for identity, _, rev in run))
                else:
                    await asyncio.gather(*(self._publisher.seen(identity, rev) for identity, _, rev in run))
