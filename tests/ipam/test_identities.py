"""The identity allocator against a real etcd: numbering, references, races between processes, leases, GC."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import pytest

from services.common.errors import Code
from services.common.labels import LabelSet
from services.ipam import keys
from services.ipam.errors import IpamError
from services.ipam.gc import GcTracker
from services.ipam.identities import IdentityAllocator
from services.ipam.kv import Store
from services.ipam.leases import NodeLeases
from services.ipam.model import CIDR_RANGE, CLUSTER_RANGE, IdRange
from testkit.harness import EtcdServer
from testkit.ipam import eventually, run_worker, worker_result

WEB = LabelSet.of(["k8s:app=web", "k8s:io.kubernetes.pod.namespace=prod"])
DB = LabelSet.of(["k8s:app=db", "k8s:io.kubernetes.pod.namespace=prod"])


def allocator(store: Store, ttl: int = 30, **kw) -> IdentityAllocator:
    return IdentityAllocator(store, NodeLeases(store, ttl), **kw)


async def test_same_labels_same_id_different_labels_different_ids(store: Store) -> None:
    alloc = allocator(store)
    web = await alloc.allocate(WEB, "n1", "pod/prod/web-1")
    again = await alloc.allocate(WEB, "n2", "pod/prod/web-2")
    db = await alloc.allocate(DB, "n1", "pod/prod/db-1")
    assert web.new and not again.new and db.new
    assert web.identity.id == again.identity.id != db.identity.id
    assert web.identity.id in CLUSTER_RANGE and db.identity.id in CLUSTER_RANGE
    assert await alloc.references(web.identity.id) == 2
    # Each allocation counts the references right after its own, in its transaction.
    assert (web.references, again.references, db.references) == (1, 2, 1)
    # The labels and id keys point at each other.
    by_labels = await store.get(keys.identity_labels(str(WEB)))
    by_id = await store.get(keys.identity_id(web.identity.id))
    assert by_labels is not None and int(by_labels.value) == web.identity.id
    assert by_id is not None and LabelSet.parse(by_id.value.decode()) == WEB


async def test_reserved_and_cidr_identities(store: Store) -> None:
    alloc = allocator(store)
    host = await alloc.allocate(LabelSet.of(["reserved:host"]), "n1", "x")
    assert (host.identity.id, host.new) == (1, False)
    assert await store.count(keys.IDENTITY_REFS.encode()) == 0  # reserved identities take no references
    cidr = await alloc.allocate(LabelSet.of(["cidr:10.0.0.0/8"]), "n1", "policy/cidr-10")
    assert cidr.identity.id in CIDR_RANGE and cidr.identity.cidr == "10.0.0.0/8"
    assert (await alloc.get(cidr.identity.id)) == cidr.identity
    world = await alloc.get(2)
    assert world is not None and world.labels.to_strings() == ["reserved:world"]


async def test_owner_holds_one_identity_and_moves_atomically(store: Store) -> None:
    alloc = allocator(store)
    web = await alloc.allocate(WEB, "n1", "pod/prod/p")
    moved = await alloc.allocate(DB, "n1", "pod/prod/p")
    assert moved.previous == web.identity.id
    assert moved.references == 1
    assert await alloc.references(web.identity.id) == 0
    assert await alloc.references(moved.identity.id) == 1
    holders = await alloc.holders("pod/")
    assert [(h.node, h.owner, h.identity) for h in holders] == [("n1", "pod/prod/p", moved.identity.id)]


async def test_known_references_follow_own_writes_and_those_of_other_processes_the_watch_brings(
    store: Store,
) -> None:
    a, b = allocator(store), allocator(store)
    await a.load()
    start = (await store.get_prefix(keys.ROOT.encode()))[1]
    web = (await a.allocate(WEB, "n1", "pod/prod/web-1")).identity.id
    await a.allocate(WEB, "n1", "pod/prod/web-2")
    db = (await a.allocate(DB, "n1", "pod/prod/web-2")).identity.id  # moved
    await b.allocate(WEB, "n2", "pod/prod/web-3")
    await b.allocate(DB, "n2", "pod/prod/db-1")
    await b.release(db, "n2", "pod/prod/db-1")
    assert (a.known_references(web), a.known_references(db)) == (1, 1)  # its own writes alone so far
    last = keys.identity_owner("n2", "pod/prod/db-1")
    async for change in store.watch(keys.ROOT.encode(), start + 1):
        a.observe(change)  # as the mirror applies every change under the root
        if change.deleted and change.kv.key == last:
            break
    assert (a.known_references(web), a.known_references(db)) == (2, 1)
    assert (await a.references(web), await a.references(db)) == (2, 1)


async def test_release_answers_clear_errors_and_reports_last_reference(store: Store) -> None:
    alloc = allocator(store)
    web = await alloc.allocate(WEB, "n1", "a")
    await alloc.allocate(WEB, "n1", "b")
    with pytest.raises(IpamError) as err:
        await alloc.release(999, "n1", "a")
    assert err.value.code == Code.NOT_FOUND and "999 does not exist" in err.value.message
    with pytest.raises(IpamError) as err:
        await alloc.release(web.identity.id, "n1", "nobody")
    assert err.value.code == Code.NOT_FOUND and "holds no reference" in err.value.message
    assert await alloc.release(web.identity.id, "n1", "a") is False
    assert await alloc.release(web.identity.id, "n1", "b") is True
    with pytest.raises(IpamError) as err:
        await alloc.release(web.identity.id, "n1", "b")
    assert err.value.code == Code.NOT_FOUND
    with pytest.raises(IpamError) as err:
        await alloc.allocate(WEB, "", "a")
    assert err.value.code == Code.INVALID_ARGUMENT


async def test_identity_exhaustion_is_clear_and_damages_nothing(store: Store) -> None:
    alloc = allocator(store, cluster_range=IdRange(256, 258))
    got = [await alloc.allocate(LabelSet.of([f"k8s:app=a{i}"]), "n1", f"o{i}") for i in range(3)]
    assert sorted(a.identity.id for a in got) == [256, 257, 258]
    with pytest.raises(IpamError) as err:
        await alloc.allocate(LabelSet.of(["k8s:app=a3"]), "n1", "o3")
    assert err.value.code == Code.RESOURCE_EXHAUSTED and "256-258" in err.value.message
    # Existing label sets still resolve, and nothing half-written was left behind.
    again = await alloc.allocate(LabelSet.of(["k8s:app=a1"]), "n1", "o9")
    assert again.identity.id == got[1].identity.id
    assert len(await alloc.list_all()) == 3
    assert await store.get(keys.identity_labels(str(LabelSet.of(["k8s:app=a3"])))) is None


async def test_restart_never_renumbers(store: Store) -> None:
    first = allocator(store)
    ids = {str(lbl): (await first.allocate(lbl, "n1", f"o{i}")).identity.id for i, lbl in enumerate([WEB, DB])}
    second = allocator(store, rng=random.Random(ids[str(WEB)]))  # a fresh process with an empty cache
    assert (await second.allocate(WEB, "n2", "x")).identity.id == ids[str(WEB)]
    await second.load()
    assert {str(i.labels): i.id for i in second.cached()} == ids


async def test_gc_collects_only_after_grace_and_never_a_referenced_identity(store: Store) -> None:
    alloc = allocator(store)
    web = await alloc.allocate(WEB, "n1", "a")
    db = await alloc.allocate(DB, "n1", "b")
    await alloc.release(web.identity.id, "n1", "a")
    tracker = GcTracker(grace=100)
    assert (await alloc.collect(tracker, now=0)).collected == []
    assert (await alloc.collect(tracker, now=50)).collected == []
    # Used again within the grace period: the wait starts over.
    await alloc.allocate(WEB, "n1", "a")
    await alloc.release(web.identity.id, "n1", "a")
    assert (await alloc.collect(tracker, now=120)).collected == []
    result = await alloc.collect(tracker, now=220)
    assert [i.id for i in result.collected] == [web.identity.id]
    assert set(result.current) == {db.identity.id}
    assert await store.get(keys.identity_labels(str(WEB))) is None
    # The label set gets a (possibly different) identity again on its next use.
    assert (await alloc.allocate(WEB, "n1", "a")).new


async def test_concurrent_allocators_in_several_processes_never_duplicate(
    etcd_server: EtcdServer, store: Store
) -> None:
    """Four processes race over 100 shared and 4x40 own label sets in a tight id range (560 allocations)."""
    workers = [
        run_worker(
            "identities",
            "--etcd",
            etcd_server.endpoint,
            "--name",
            f"w{i}",
            "--node",
            f"node-{i}",
            "--seed",
            str(i),
            "--shared",
            "100",
            "--own",
            "40",
            "--range-size",
            "300",
            "--concurrency",
            "8",
        )
        for i in range(4)
    ]
    outputs = [worker_result(w) for w in workers]
    results = [out["identities"] for out in outputs]
    # Each process sent concurrent transactions together.
    assert all(out["batches"] < out["transactions"] for out in outputs)
    # One label set -> one id, whoever asked.
    merged: dict[str, int] = {}
    for result in results:
        assert len(result) == 140
        for labels, ident in result.items():
            assert merged.setdefault(labels, ident) == ident, f"{labels} got two ids"
    # One id -> one label set.
    assert len(merged) == 260 and len(set(merged.values())) == 260
    assert all(256 <= i <= 555 for i in merged.values())
    # etcd agrees with what every process was told.
    kvs, _ = await store.get_prefix(keys.IDENTITY_IDS.encode())
    assert {LabelSet.parse(kv.value.decode()).__str__(): keys.parse_identity_id(kv.key) for kv in kvs} == merged
    assert await store.count(keys.IDENTITY_LABELS.encode()) == 260
    assert await store.count(keys.IDENTITY_REFS.encode()) == 560


async def test_dead_process_references_expire_with_its_lease_then_gc_after_grace(
    etcd_server: EtcdServer, store: Store
) -> None:
    holder = run_worker(
        "identities",
        "--etcd",
        etcd_server.endpoint,
        "--name",
        "dying",
        "--node",
        "node-x",
        "--own",
        "3",
        "--ttl",
        "3",
        "--hold",
    )
    try:
        assert holder.stdout is not None
        held = json.loads(holder.stdout.readline())["identities"]
        ids = sorted(held.values())
        alloc = allocator(store)
        assert {i: await alloc.references(i) for i in ids} == {i: 1 for i in ids}
        tracker = GcTracker(grace=1.0)
        # Alive, the process keeps its lease (well past the TTL): nothing expires, nothing is collected.
        start = time.monotonic()
        while time.monotonic() - start < 4.0:
            assert (await alloc.collect(tracker, time.monotonic())).collected == []
            await asyncio.sleep(0.3)
        assert await store.count(keys.IDENTITY_REFS.encode()) == 3
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup, no lease revoke: as if the node died
        holder.wait(10)

    # Its lease expires: the references go, the identities stay (for the grace period).
    async def refs_gone() -> bool:
        return (
            await store.count(keys.IDENTITY_REFS.encode()) == 0
            and await store.count(keys.IDENTITY_OWNERS.encode()) == 0
        )

    await eventually(refs_gone, timeout=20)
    assert len(await alloc.list_all()) == 3
    collected: list[int] = []

    async def all_collected() -> bool:
        collected.extend(i.id for i in (await alloc.collect(tracker, time.monotonic())).collected)
        return sorted(collected) == ids

    await eventually(all_collected, timeout=20)
    assert await alloc.list_all() == []
    assert await store.count(keys.IDENTITY_LABELS.encode()) == 0


async def test_references_of_one_node_share_the_node_lease(store: Store) -> None:
    a = allocator(store, ttl=5)
    b = allocator(store, ttl=5)
    await a.allocate(WEB, "n1", "x")
    await b.allocate(DB, "n1", "y")
    lease_key = await store.get(keys.lease("n1"))
    refs, _ = await store.get_prefix(keys.IDENTITY_REFS.encode())
    assert lease_key is not None and {kv.lease for kv in refs} == {int(lease_key.value)}


async def test_lost_lease_is_noticed_and_references_taken_again(store: Store) -> None:
    leases = NodeLeases(store, 30)
    alloc = IdentityAllocator(store, leases)
    web = (await alloc.allocate(WEB, "n1", "pod/prod/web")).identity.id
    db = (await alloc.allocate(DB, "n1", "pod/prod/db")).identity.id
    first = await store.get(keys.lease("n1"))
    assert first is not None
    await store.revoke(int(first.value))  # what etcd does to a lease nobody refreshed in time
    assert await store.count(keys.IDENTITY_REFS.encode()) == 0
    # Meanwhile the db identity is collected (its grace period was shorter than the outage).
    collected = (await alloc.collect(GcTracker(grace=0), now=0)).collected
    assert sorted(i.id for i in collected) == sorted([web, db])
    assert await leases.refresh_all() == ["n1"]
    # Taking the references again recreates what was collected; the moves are reported.
    moved = await alloc.retake("n1")
    assert {owner for owner, _, _ in moved} == {"pod/prod/web", "pod/prod/db"}
    assert all(old in (web, db) and new.new and new.identity.id not in (web, db) for _, old, new in moved)
    assert await store.count(keys.IDENTITY_REFS.encode()) == 2
    second = await store.get(keys.lease("n1"))
    assert second is not None and second.value != first.value
    # A put on a lease that vanished without a refresh noticing it: a fresh lease is taken.
    await store.revoke(int(second.value))
    again = await alloc.allocate(LabelSet.of(["k8s:app=cache"]), "n1", "pod/prod/cache")
    assert await alloc.references(again.identity.id) == 1


async def test_collector_transaction_refuses_an_identity_that_has_a_reference(store: Store) -> None:
    """Even when the tracker says "due", etcd deletes nothing while a key sits under refs/<id>/."""
    alloc = allocator(store)
    web = (await alloc.allocate(WEB, "n1", "a")).identity.id
    await alloc.release(web, "n1", "a")
    tracker = GcTracker(grace=0)
    # A reference appears between the listing and the delete (written without touching the id key).
    real_get_prefix = alloc._store.get_prefix

    async def listing_then_reference(prefix: bytes, *, keys_only: bool = False):
        result = await real_get_prefix(prefix, keys_only=keys_only)
        if prefix == keys.IDENTITY_REFS.encode():
            await store.put(keys.identity_ref(web, "n2", "late"), b"")
        return result

    alloc._store.get_prefix = listing_then_reference  # type: ignore[method-assign]
    result = await alloc.collect(tracker, now=0)
    alloc._store.get_prefix = real_get_prefix  # type: ignore[method-assign]
    assert result.collected == []
    assert (await alloc.get(web)) is not None and await store.get(keys.identity_labels(str(WEB))) is not None
