"""Keep this ipam's in-memory view equal to etcd, whoever writes it: the watch on ``/palisade/``.

Several ipam replicas share one etcd. Each allocates through transactions (so none
ever hands out an id or an address twice), but each also answers ListAllocations,
status figures and allocation hints from memory: without this watch a replica would
only know its own writes. Every change under ``/palisade/`` is applied to the
identity allocator, the address allocator and the ipcache, in revision order; an
identity that appears or goes is announced on the bus at once (an allocator that
died between its etcd write and its publish leaves the announcement to the others).

The watch starts right after the revision the view was loaded at; if etcd compacted
that revision away, the view is reloaded and the watch starts again after it.
"""

from __future__ import annotations

import asyncio
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

#: (identity, deleted, etcd revision)
Announcement = tuple[Identity, bool, int]


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
    ) -> None:
        self._store = store
        self._allocator = allocator
        self._ipalloc = ipalloc
        self._ipcache = ipcache
        self._publisher = publisher
        self._reload = reload
        self._announcements: asyncio.Queue[Announcement] = asyncio.Queue()
        #: The last etcd revision applied (from the watch or a reload).
        self.revision = 0

    def apply(self, change: Change) -> None:
        """Fold one change into the view; identities that appeared or went are queued for the bus."""
        key = change.kv.key
        if key.startswith(keys.IDENTITY_IDS.encode()) or key.startswith(keys.IDENTITY_OWNERS.encode()):
            found = self._allocator.observe(change)
            if found is not None:
                self._announcements.put_nowait((found[0], found[1], change.revision))
        elif key.startswith(keys.IPCACHE.encode()):
            self._ipcache.observe(change)
        elif key.startswith(b"/palisade/ipam/"):
            self._ipalloc.observe(change)
        self.revision = max(self.revision, change.revision)

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

        What queued up meanwhile goes at once: a run of announcements of one kind (appeared,
        or went) is published together and its acks awaited together, runs in their order.
        """
        while True:
            pending = [await self._announcements.get()]
            while len(pending) < ANNOUNCE_BATCH and not self._announcements.empty():
                pending.append(self._announcements.get_nowait())
            for deleted, run in itertools.groupby(pending, key=lambda a: a[1]):
                if deleted:
                    await asyncio.gather(*(self._publisher.gone(identity) for identity, _, _ in run))
                else:
                    await asyncio.gather(*(self._publisher.seen(identity, rev) for identity, _, rev in run))
