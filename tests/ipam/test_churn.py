"""Pod churn: what one pod deletion costs ipam's pod state, counted, not timed.

A bus pod's deletion joins its owner's API holdings again (an endpoint of the same owner on
another node gets its ipcache entries once the bus pod is gone). That used to build every
(node, owner) pair of the cluster on each deletion; the allocators now index holdings by
owner, and these tests count the pairs a deletion looks at.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.bus import Bus
from services.common.labels import LabelSet
from services.ipam.kv import Store
from services.ipam.owners import OwnerIndexed
from services.ipam.pods import K8sChanged, OwnerChanged, ReferenceChanged
from services.ipam.podwatch import Change, ObjectKind
from testkit.harness import NatsServer, creds
from testkit.ipam import namespace, pod, pod_task

#: API endpoints on another node: what a scan over every (node, owner) would look at.
API_OWNERS = 40


def test_owner_index_follows_adds_and_removals() -> None:
    held: OwnerIndexed[tuple[str, int, str], str] = OwnerIndexed(lambda k: (k[0], k[2]))
    held[("n1", 4, "pod/a/x")] = "10.0.0.1"
    held[("n1", 6, "pod/a/x")] = "fd00::1"
    held[("n2", 4, "pod/a/x")] = "10.0.1.1"
    held[("n2", 4, "pod/a/y")] = "10.0.1.2"
    held[("n2", 4, "pod/a/y")] = "10.0.1.3"  # replaced, still one holding
    assert held.nodes_of("pod/a/x") == {"n1", "n2"}
    assert held.pairs() == {("n1", "pod/a/x"), ("n2", "pod/a/x"), ("n2", "pod/a/y")}
    del held[("n1", 4, "pod/a/x")]
    assert held.nodes_of("pod/a/x") == {"n1", "n2"}  # its IPv6 address is still there
    assert held.pop(("n1", 6, "pod/a/x")) == "fd00::1"
    assert held.pop(("n1", 6, "pod/a/x"), None) is None
    assert held.nodes_of("pod/a/x") == {"n2"}
    del held[("n2", 4, "pod/a/y")]
    assert held.nodes_of("pod/a/y") == set()
    assert held.get(("n2", 4, "pod/a/x")) == "10.0.1.1"
    assert held.get(("n9", 4, "pod/a/x"), "none") == "none"
    assert len(held) == 1 and ("n2", 4, "pod/a/x") in held
    held.clear()
    assert held.pairs() == set() and not held


def test_owner_index_counts_values_by_their_tally() -> None:
    # (node, owner) -> (identity, revision), counted by identity: the references each identity has.
    held: OwnerIndexed[tuple[str, str], tuple[int, int]] = OwnerIndexed(
        lambda k: k, [(("n1", "pod/a/x"), (300, 1))], tally=lambda v: v[0]
    )
    held[("n1", "pod/a/y")] = (300, 2)
    held[("n2", "pod/a/z")] = (301, 3)
    assert (held.count(300), held.count(301), held.count(302)) == (2, 1, 0)
    held[("n1", "pod/a/y")] = (301, 4)  # moved to another identity
    assert (held.count(300), held.count(301)) == (1, 2)
    held[("n1", "pod/a/y")] = (301, 5)  # written again: still one
    assert held.count(301) == 2
    del held[("n2", "pod/a/z")]
    assert held.pop(("n1", "pod/a/x")) == (300, 1)
    assert (held.count(300), held.count(301)) == (0, 1)
    held.clear()
    assert held.count(301) == 0
    untallied: OwnerIndexed[tuple[str, str], int] = OwnerIndexed(lambda k: k, [(("n1", "o"), 7)])
    assert untallied.count(7) == 0


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_streams()
        yield b


def _pod_change(ns: str, name: str, *, ip: str = "", gone: bool = False) -> K8sChanged:
    obj = None if gone else pod(ns, name, {"app": name}, node="node-a", ip=ip)
    return K8sChanged(Change(ObjectKind.POD, ns, name, obj))


async def test_a_pod_deletion_looks_only_at_its_own_owner(store: Store, bus: Bus) -> None:
    pods, allocator, ipalloc, ipcache = await pod_task(store, bus)
    runner = asyncio.create_task(pods.run())
    try:
        pods.submit(K8sChanged(Change(ObjectKind.NAMESPACE, "", "web", namespace("web"))))
        for i in range(10):
            pods.submit(_pod_change("web", f"p{i}", ip=f"10.200.0.{i + 1}"))
        pods.submit(_pod_change("web", "shared", ip="10.200.0.100"))

        async def endpoint(node: str, owner: str, app: str) -> tuple[int, str]:
            """What the datapath does for an endpoint it creates: a reference and an address."""
            got = await allocator.allocate(
                LabelSet.of([f"k8s:app={app}", "k8s:io.kubernetes.pod.namespace=api"]), node, owner
            )
            address = await ipalloc.allocate(node, owner)
            pods.submit(ReferenceChanged(node, owner, held=True))
            pods.submit(OwnerChanged(node, owner))
            return got.identity.id, address.ip

        for i in range(API_OWNERS):
            await endpoint("node-b", f"pod/api/e{i}", f"e{i}")
        # The same owner as the bus pod web/shared, as an API endpoint on another node: the bus
        # pod wins while it exists, the endpoint's entry appears once it is gone.
        shared_id, shared_ip = await endpoint("node-c", "pod/web/shared", "shared-api")
        await pods.sweep()
        assert f"{shared_ip}/32" not in ipcache.entries
        assert ipcache.entries["10.200.0.100/32"].node == "node-a"

        before = pods.rejoin_visits
        pods.submit(_pod_change("web", "p3", gone=True))
        await pods.sweep()
        # p3 holds nothing anywhere once its own reference is dropped: nothing to look at.
        assert pods.rejoin_visits - before == 0
        assert "10.200.0.4/32" not in ipcache.entries

        before = pods.rejoin_visits
        pods.submit(_pod_change("web", "shared", gone=True))
        await pods.sweep()
        # Only the owner's one other node, however many endpoints the cluster has.
        assert pods.rejoin_visits - before == 1
        entry = ipcache.entries[f"{shared_ip}/32"]
        assert (entry.identity, entry.node, entry.namespace, entry.pod) == (shared_id, "node-c", "web", "shared")
        assert "10.200.0.100/32" not in ipcache.entries
        # Every other endpoint kept its entry.
        assert sum(1 for e in ipcache.entries.values() if e.node == "node-b") == API_OWNERS
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_a_burst_of_pod_changes_shares_transactions_and_keeps_each_address_in_order(
    store: Store, bus: Bus
) -> None:
    """Changes of distinct pods go in flight together (their transactions share etcd batches);
    a pod that takes the address of one deleted before it still comes after it."""
    pods, allocator, _, ipcache = await pod_task(store, bus)
    pods.submit(K8sChanged(Change(ObjectKind.NAMESPACE, "", "web", namespace("web"))))
    # Nothing runs yet: the burst is queued whole, as a backlog of bus deltas is.
    for i in range(100):
        pods.submit(_pod_change("web", f"p{i}", ip=f"10.201.0.{i + 1}"))
    # p5 goes and q5 takes its address, queued in the middle of the burst.
    pods.submit(_pod_change("web", "p5", gone=True))
    pods.submit(_pod_change("web", "q5", ip="10.201.0.6"))
    for i in range(100, 150):
        pods.submit(_pod_change("web", f"p{i}", ip=f"10.201.{i // 100}.{i % 100 + 1}"))
    batches, requests = store.batching
    runner = asyncio.create_task(pods.run())
    try:
        await pods.sweep()
        sent_batches, sent = store.batching[0] - batches, store.batching[1] - requests
        # Every pod holds an identity and has its entry; q5 has p5's address, p5 holds nothing.
        assert ipcache.entries["10.201.0.6/32"].pod == "q5"
        assert allocator.held("node-a", "pod/web/p5") is None
        assert allocator.held("node-a", "pod/web/q5") is not None
        for i in (*range(5), *range(6, 100)):
            assert ipcache.entries[f"10.201.0.{i + 1}/32"].pod == f"p{i}"
        for i in range(100, 150):
            assert ipcache.entries[f"10.201.{i // 100}.{i % 100 + 1}/32"].pod == f"p{i}"
        # 151 identities and 151 entries written, p5's reference dropped and its entry deleted: far
        # fewer round trips than transactions.
        assert sent >= 151 + 151 + 2
        assert sent_batches * 4 <= sent, (sent_batches, sent)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
