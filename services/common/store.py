"""The etcd client factory (aetcd). Palisade's keys all start with ``/palisade/``."""

from __future__ import annotations

import aetcd

from services.common.log import get_logger
from services.common.retry import with_retries

log = get_logger("store")

PREFIX = b"/palisade/"


async def connect_etcd(
    endpoints: list[tuple[str, int]],
    *,
    retries: int = 10,
    backoff: float = 0.2,
    timeout: int = 5,
) -> aetcd.Client:
    """A connected client to the first endpoint that answers a status call."""
    address = ",".join(f"{h}:{p}" for h, p in endpoints)
    state = {"i": 0}

    async def attempt() -> aetcd.Client:
        host, port = endpoints[state["i"] % len(endpoints)]
        state["i"] += 1
        client = aetcd.Client(host=host, port=port, timeout=timeout)
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
