"""The etcd client factory (aetcd). Palisade's keys all start with ``/palisade/``."""

from __future__ import annotations

from typing import Any

import aetcd
import grpc
from aetcd import rpc
from aetcd.watcher import Watcher

from services.common.log import get_logger
from services.common.retry import with_retries
from services.common.trust import Credentials

log = get_logger("store")

PREFIX = b"/palisade/"


class TlsClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client over mutual TLS: it proves it is ipam and checks that the server is etcd."""

    def __init__(self, *, credentials: Credentials, **kw: Any) -> None:
        super().__init__(**kw)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = grpc.aio.secure_channel(
            target,
            self._credentials.channel_credentials(),
            options=[*self._options.items(), ("grpc.ssl_target_name_override", "etcd")],
        )
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
    """A connected client to the first endpoint that answers a status call."""
    address = ",".join(f"{h}:{p}" for h, p in endpoints)
    state = {"i": 0}

    async def attempt() -> aetcd.Client:
        host, port = endpoints[state["i"] % len(endpoints)]
        state["i"] += 1
        client = (
            aetcd.Client(host=host, port=port, timeout=timeout)
            if tls is None
            else TlsClient(host=host, port=port, timeout=timeout, credentials=tls)
        )
        try:
            await client.connect()
            await client.status()
        except BaseException:
            await client.close()
            raise
        return client

    client = await with_retries(
        "etcd",
        address,
        attempt,
        retries=retries,
        backoff=backoff,
        hint="start etcd or set --etcd-endpoints / PALISADE_ETCD_ENDPOINTS",
    )
    log.info("etcd connected", endpoints=address)
    return client
