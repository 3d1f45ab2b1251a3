"""The etcd client factory (aetcd). Palisade's keys all start with ``/palisade/``."""

from __future__ import annotations

from typing import Any

import aetcd
from aetcd import rpc
from aetcd.watcher import Watcher

from services.common.grpcserver import grpc_target, open_channel
from services.common.log import get_logger
from services.common.retry import reach
from services.common.trust import Credentials

log = get_logger("store")

PREFIX = b"/palisade/"


class StoreClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client on a channel of ours: every member of the cluster, and mutual TLS.

    With credentials it proves it is ipam and checks that the server is etcd; with several
    members the channel moves to another when the one it uses goes away.
    """

    def __init__(self, *, target: str, credentials: Credentials | None, **kw: Any) -> None:
        super().__init__(**kw)
        self._target = target
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        # The project's one channel factory: mutual TLS checking the server is etcd, or plaintext.
        self.channel = open_channel(self._target, "etcd", self._credentials)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


async def connect_etcd(
    endpoints: list[tuple[str, int]],
    *,
    retries: int = 10,
    backoff: float = 0.2,
    timeout: int = 5,
    tls: Credentials | None = None,
) -> aetcd.Client:
    """A connected client of the cluster at ``endpoints`` (checked with a status call)."""
    address = ",".join(f"{h}:{p}" for h, p in endpoints)
    target = grpc_target(endpoints)

    async def attempt() -> aetcd.Client:
        client = StoreClient(target=target, credentials=tls, timeout=timeout)
        try:
            await client.connect()
            await client.status()
        except BaseException:
            await client.close()
            raise
        return client

    client = await reach(
        "etcd",
        address,
        attempt,
        retries=retries,
        backoff=backoff,
        hint="start etcd or set --etcd-endpoints / PALISADE_ETCD_ENDPOINTS",
    )
    log.info("etcd connected", endpoints=address)
    return client
