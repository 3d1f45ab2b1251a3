"""One etcd lease per node: identity references of a node live and die with it.

A node's lease id is recorded at ``/palisade/leases/<node>`` (attached to the
lease itself, so the record goes when the lease does). Every allocator process
that takes references for a node adopts the recorded lease instead of granting
its own, so a restarted ipam keeps the references taken before it died alive,
as long as it is back within the TTL. When nobody refreshes a node's lease, etcd
deletes the node's references with it and the collector frees what is left
unreferenced.
"""

from __future__ import annotations

import asyncio

from services.common.log import get_logger
from services.ipam import keys
from services.ipam.kv import Get, Put, Store, absent

log = get_logger("leases")


class NodeLeases:
    """The lease of every node this process holds references for, and their keepalive."""

    def __init__(self, store: Store, ttl: int) -> None:
        self._store = store
        self.ttl = ttl
        self._leases: dict[str, int] = {}
        self._pending: dict[str, asyncio.Task[int]] = {}

    async def lease_for(self, node: str) -> int:
        """The node's lease id, adopting the recorded one or creating it."""
        known = self._leases.get(node)
        if known is not None:
            return known
        # Single flight: concurrent callers for one node share one acquisition.
        task = self._pending.get(node)
        if task is None:
            task = asyncio.create_task(self._acquire(node), name=f"lease-{node}")
            self._pending[node] = task
            task.add_done_callback(lambda _t: self._pending.pop(node, None))
        return await asyncio.shield(task)

    async def _acquire(self, node: str) -> int:
        key = keys.lease(node)
        while True:
            recorded = await self._store.get(key)
            if recorded is not None:
                lease_id = int(recorded.value)
                if await self._store.keepalive(lease_id) > 0:
                    self._leases[node] = lease_id
                    log.info("node lease adopted", node=node, lease=lease_id)
                    return lease_id
            lease_id = await self._store.grant(self.ttl)
            res = await self._store.txn([absent(key)], [Put(key, str(lease_id).encode(), lease_id)], [Get(key)])
            if res.succeeded:
                self._leases[node] = lease_id
                log.info("node lease granted", node=node, lease=lease_id, ttl=self.ttl)
                return lease_id
            # Another process recorded one first: use theirs, drop ours.
            await self._store.revoke(lease_id)

    def invalidate(self, node: str, lease_id: int) -> None:
        """Forget a lease a put found gone, so the next caller acquires a fresh one."""
        if self._leases.get(node) == lease_id:
            del self._leases[node]

    async def refresh_all(self) -> list[str]:
        """Keep every held lease alive; returns the nodes whose lease had expired."""
        lost = []
        for node, lease_id in list(self._leases.items()):
            ttl = await self._store.keepalive(lease_id)
            if ttl <= 0:
                self.invalidate(node, lease_id)
                lost.append(node)
                log.warning("node lease expired, references dropped", node=node, lease=lease_id)
        return lost

    async def revoke(self, node: str) -> bool:
        """Drop a node's lease (and with it every reference of the node)."""
        lease_id = self._leases.pop(node, None)
        if lease_id is None:
            recorded = await self._store.get(keys.lease(node))
            if recorded is None:
                return False
            lease_id = int(recorded.value)
        await self._store.revoke(lease_id)
        log.info("node lease revoked", node=node, lease=lease_id)
        return True

    async def close(self) -> None:
        for task in list(self._pending.values()):
            task.cancel()
