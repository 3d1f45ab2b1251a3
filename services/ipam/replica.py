"""This ipam process as one replica among several: its name and its etcd lease.

An identity's creating transaction records its creator (``/palisade/identities/creators/<id>``,
see :mod:`services.ipam.keys`) on the creator's lease, and only the creator announces the
identity on the bus. While the creator lives, the other replicas leave the announcement to it;
when it dies (its lease expires, or is lost), etcd deletes the creators keys it held and every
replica that sees one go announces that identity itself.
"""

from __future__ import annotations

import asyncio
import uuid

from services.common.log import get_logger
from services.ipam.kv import Store

log = get_logger("replica")


class ReplicaLease:
    """The lease the creators keys of this replica live on; granted on first use, kept alive by the owner."""

    def __init__(self, store: Store, ttl: int, name: str | None = None) -> None:
        self._store = store
        self.ttl = ttl
        #: Unique per process: a restarted replica is a new creator (its predecessor's keys expire).
        self.name = name or f"ipam-{uuid.uuid4().hex[:16]}"
        self._lease: int | None = None
        self._pending: asyncio.Task[int] | None = None

    async def lease(self) -> int:
        """The replica's lease id, granted once (concurrent callers share one grant)."""
        if self._lease is not None:
            return self._lease
        if self._pending is None:
            self._pending = asyncio.create_task(self._grant(), name="replica-lease")
        task = self._pending
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._pending is task:
                self._pending = None

    async def _grant(self) -> int:
        lease_id = await self._store.grant(self.ttl)
        self._lease = lease_id
        log.info("replica lease granted", replica=self.name, lease=lease_id, ttl=self.ttl)
        return lease_id

    def invalidate(self, lease_id: int) -> None:
        """Forget a lease found gone: the next creation grants a new one."""
        if self._lease == lease_id:
            self._lease = None

    async def refresh(self) -> bool:
        """Keep the lease alive; False when it had expired (its creators keys are gone)."""
        lease_id = self._lease
        if lease_id is None:
            return True
        if await self._store.keepalive(lease_id) > 0:
            return True
        self.invalidate(lease_id)
        log.warning(
            "replica lease expired; the other replicas announce the identities it created",
            replica=self.name,
            lease=lease_id,
        )
        return False

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
