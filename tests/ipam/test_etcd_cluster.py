"""ipam's store on a 3-member etcd cluster: it keeps working when any one member dies."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.grpcserver import grpc_target
from services.common.labels import LabelSet
from services.common.store import connect_etcd
from services.ipam.identities import IdentityAllocator
from services.ipam.kv import Store
from services.ipam.leases import NodeLeases
from testkit.harness import EtcdCluster, creds


def test_several_addresses_make_one_failover_target() -> None:
    assert grpc_target([("127.0.0.1", 1), ("127.0.0.2", 2)]) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert grpc_target([("etcd.svc", 2379)]) == "etcd.svc:2379"


@pytest.mark.parametrize("victim", [0, 1])
async def test_allocation_goes_on_when_a_member_dies(etcd_cluster: EtcdCluster, victim: int) -> None:
    endpoints = [("127.0.0.1", int(m.endpoint.rpartition(":")[2])) for m in etcd_cluster.members]
    client = await connect_etcd(endpoints, tls=creds("ipam"))
    store = Store(client, patience=30)
    try:
        allocator = IdentityAllocator(store, NodeLeases(store, 60))
        await allocator.load()
        before = {}
        for i in range(20):
            labels = LabelSet.of([f"k8s:app=ha-{i}", "k8s:io.kubernetes.pod.namespace=ha"])
            before[i] = (await allocator.allocate(labels, "node-a", f"pod/ha/p{i}")).identity.id
        # Member 0 is the one the client talks to (pick-first); member 1 one it does not.
        etcd_cluster.members[victim].stop(kill=True)
        started = time.monotonic()
        after = {}
        for i in range(20, 40):
            labels = LabelSet.of([f"k8s:app=ha-{i}", "k8s:io.kubernetes.pod.namespace=ha"])
            after[i] = (await allocator.allocate(labels, "node-a", f"pod/ha/p{i}")).identity.id
        assert time.monotonic() - started < 15, "the store took too long to fail over"
        ids = [*before.values(), *after.values()]
        assert len(set(ids)) == 40, "an identity was handed out twice"
        # What was written before the loss is still there, read through a survivor.
        fresh = IdentityAllocator(store, NodeLeases(store, 60))
        await fresh.load()
        for i, identity in before.items():
            labels = LabelSet.of([f"k8s:app=ha-{i}", "k8s:io.kubernetes.pod.namespace=ha"])
            assert (await fresh.allocate(labels, "node-b", f"pod/ha/q{i}")).identity.id == identity
    finally:
        await client.close()
        await asyncio.sleep(0)
