"""Fixtures of the ipam tests: an ipam Store on the test etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.store import connect_etcd
from services.ipam.kv import Store
from testkit.harness import EtcdServer, creds


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[Store]:
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    yield Store(client, patience=20.0)
    await client.close()


@pytest.fixture
async def second_store(etcd_server: EtcdServer) -> AsyncIterator[Store]:
    """Another process's view of the same etcd: a Store on a client of its own (a second replica)."""
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    yield Store(client, patience=20.0)
    await client.close()
