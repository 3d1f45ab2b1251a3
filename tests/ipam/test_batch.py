"""Transactions sent together: the coalescer's rules (pure) and batches on a real etcd.

Concurrent transactions with disjoint keys go as the nested transactions of one; the
guarantees of the allocators (no identity or address twice, references, the
collector) hold whether a transaction went alone or in a batch.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence

import pytest

from services.common.labels import LabelSet
from services.ipam import keys
from services.ipam.batch import Coalescer, Footprint, Interval, merged, point
from services.ipam.config import IPAMMode
from services.ipam.gc import GcTracker
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import Get, LeaseNotFound, Put, Store, absent, footprint, none_under
from services.ipam.leases import NodeLeases

# -- footprints (pure) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ([], []),
        ([(b"b", b"c"), (b"a", b"b")], [(b"a", b"c")]),
        ([(b"a", b"c"), (b"b", b"d"), (b"x", b"y")], [(b"a", b"d"), (b"x", b"y")]),
        ([(b"a", b"z"), (b"c", b"d")], [(b"a", b"z")]),
        ([(b"b", b"b")], []),
    ],
)
def test_merged_is_the_sorted_disjoint_union(given: list[Interval], expected: list[Interval]) -> None:
    assert merged(given) == expected


@pytest.mark.parametrize(
    ("taken", "probe", "overlaps"),
    [
        ([point(b"/k/1")], [point(b"/k/1")], True),
        ([point(b"/k/1")], [point(b"/k/10")], False),
        ([point(b"/k/1")], [point(b"/k/0"), point(b"/k/2")], False),
        ([(b"/refs/5/", b"/refs/50")], [point(b"/refs/5/n/pod")], True),
        ([point(b"/refs/5/n/pod")], [(b"/refs/5/", b"/refs/50")], True),
        ([(b"/refs/5/", b"/refs/50")], [point(b"/refs/6/n/pod")], False),
        ([point(b"a"), point(b"c"), point(b"e")], [(b"b", b"c")], False),
        ([point(b"a"), point(b"c"), point(b"e")], [(b"b", b"c\0")], True),
    ],
)
def test_footprint_overlap(taken: list[Interval], probe: list[Interval], overlaps: bool) -> None:
    fp = Footprint()
    fp.add(merged(taken))
    assert fp.overlaps(merged(probe)) is overlaps


def test_adding_overlapping_intervals_merges_them() -> None:
    fp = Footprint()
    fp.add([(b"c", b"e"), (b"g", b"i")])
    fp.add([(b"d", b"h")])  # bridges both
    assert not fp.overlaps([(b"a", b"c"), (b"i", b"z")])
    assert fp.overlaps([point(b"f")])
    fp.add([(b"a", b"b")])
    assert fp.overlaps([point(b"a")]) and not fp.overlaps([point(b"b")])


def test_a_transaction_touches_its_compares_reads_writes_and_nested_ones() -> None:
    prefix = keys.identity_refs_of(300)
    got = merged(
        footprint([absent(b"/a"), none_under(prefix)], [Put(b"/b", b""), Get(b"/c", prefix=True, count_only=True)])
    )
    assert got == merged([point(b"/a"), point(b"/b"), (b"/c", b"/d"), (prefix, prefix[:-1] + b"0")])


# -- the coalescer with a send of its own (pure) -------------------------------


class Recorder:
    """A send that records each batch and answers when the test lets it."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.fail = fail or set()

    async def send(self, items: Sequence[str]) -> list[str | BaseException]:
        self.batches.append(list(items))
        await self.gate.wait()
        return [ValueError(i) if i in self.fail else i.upper() for i in items]


async def _queued(coalescer: Coalescer[str, str], item: str, keys_: list[bytes]) -> asyncio.Task[str]:
    task = asyncio.get_running_loop().create_task(coalescer.submit(item, [point(k) for k in keys_]))
    await asyncio.sleep(0)  # submitted: queued or sent
    return task


async def test_the_first_goes_alone_and_those_arriving_meanwhile_go_together_in_order() -> None:
    rec = Recorder()
    co: Coalescer[str, str] = Coalescer(rec.send, max_batch=3)
    first = await _queued(co, "a", [b"1"])
    rest = [await _queued(co, item, [key]) for item, key in (("b", b"2"), ("c", b"1"), ("d", b"3"), ("e", b"4"))]
    assert rec.batches == [["a"]]
    rec.gate.set()
    assert [await t for t in (first, *rest)] == ["A", "B", "C", "D", "E"]
    # At most three per batch, and none beside another that touches one of its keys.
    assert rec.batches == [["a"], ["b", "c", "d"], ["e"]]
    assert (co.batches, co.requests) == (3, 5)


async def test_an_overlapping_request_waits_for_the_next_batch_keeping_its_place() -> None:
    rec = Recorder()
    co: Coalescer[str, str] = Coalescer(rec.send, max_batch=10)
    tasks = [await _queued(co, "a", [b"x"])]
    for item, key in (("b", b"k"), ("c", b"k"), ("d", b"y"), ("e", b"k")):
        tasks.append(await _queued(co, item, [key]))
    rec.gate.set()
    await asyncio.gather(*tasks)
    assert rec.batches == [["a"], ["b", "d"], ["c"], ["e"]]


async def test_requests_on_common_keys_keep_their_order_across_batches() -> None:
    rec = Recorder()
    co: Coalescer[str, str] = Coalescer(rec.send, max_batch=10)
    tasks = [await _queued(co, "a", [b"x"])]
    # c waits behind b (key k); d shares key m with c only, so it may not overtake c.
    for item, keys_ in (("b", [b"k"]), ("c", [b"k", b"m"]), ("d", [b"m"]), ("e", [b"z"])):
        tasks.append(await _queued(co, item, keys_))
    rec.gate.set()
    await asyncio.gather(*tasks)
    assert rec.batches == [["a"], ["b", "e"], ["c"], ["d"]]


async def test_each_caller_gets_its_own_error_and_a_failed_send_reaches_all() -> None:
    rec = Recorder(fail={"b"})
    co: Coalescer[str, str] = Coalescer(rec.send, max_batch=10)
    tasks = [await _queued(co, i, [i.encode()]) for i in "abc"]
    rec.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] == "A" and results[2] == "C"
    assert isinstance(results[1], ValueError)

    async def broken(items: Sequence[str]) -> list[str | BaseException]:
        raise ConnectionError("down")

    co = Coalescer(broken, max_batch=10)
    got = await asyncio.gather(co.submit("x", []), co.submit("y", []), return_exceptions=True)
    assert all(isinstance(g, ConnectionError) for g in got)


async def test_a_caller_that_gave_up_before_its_batch_is_not_sent() -> None:
    rec = Recorder()
    co: Coalescer[str, str] = Coalescer(rec.send, max_batch=10)
    first = await _queued(co, "a", [b"1"])
    gone = await _queued(co, "b", [b"2"])
    kept = await _queued(co, "c", [b"3"])
    gone.cancel()
    rec.gate.set()
    assert await first == "A" and await kept == "C"
    assert rec.batches == [["a"], ["c"]]


def test_a_coalescer_needs_room() -> None:
    async def send(items: Sequence[str]) -> list[str | BaseException]:
        return list(items)

    with pytest.raises(ValueError, match="max_batch >= 1"):
        Coalescer(send, max_batch=0)


# -- batches on a real etcd -----------------------------------------------------------


async def test_concurrent_transactions_go_as_one_and_each_gets_its_own_answer(store: Store) -> None:
    sent_before = store.batching
    # Ten create-if-absent of distinct keys, and ten that all want one key: in one go, the first
    # alone, the others as batches of disjoint keys.
    distinct = [store.txn([absent(b"/palisade/t/d%d" % i)], [Put(b"/palisade/t/d%d" % i, b"v")]) for i in range(10)]
    shared = [
        store.txn(
            [absent(b"/palisade/t/shared")], [Put(b"/palisade/t/shared", b"%d" % i)], [Get(b"/palisade/t/shared")]
        )
        for i in range(10)
    ]
    results = await asyncio.gather(*distinct, *shared)
    assert all(r.succeeded for r in results[:10])
    winners = [i for i, r in enumerate(results[10:]) if r.succeeded]
    assert len(winners) == 1
    held = await store.get(b"/palisade/t/shared")
    assert held is not None and held.value == b"%d" % winners[0]
    # The losers read what the winner wrote, in their own failure branch.
    assert all(r.first(0) == held for r in results[10:] if not r.succeeded)
    batches, requests = store.batching[0] - sent_before[0], store.batching[1] - sent_before[1]
    assert requests == 20 and batches < requests
    # The shared key never shares a batch, so the ten writers of it need ten batches at least.
    assert batches >= 10


async def test_a_batch_with_an_expired_lease_answers_each_alone(store: Store) -> None:
    lease = await store.grant(60)
    await store.revoke(lease)
    before = store.batching
    calls = [
        store.txn([], [Put(b"/palisade/t/first", b"")]),
        store.txn([], [Put(b"/palisade/t/ok-1", b"")]),
        store.txn([], [Put(b"/palisade/t/leased", b"", lease)]),
        store.txn([], [Put(b"/palisade/t/ok-2", b"")]),
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[2], LeaseNotFound)
    assert all(not isinstance(r, BaseException) and r.succeeded for i, r in enumerate(results) if i != 2)
    assert store.batching[0] - before[0] == 2  # the first alone, the other three together (then alone)
    assert await store.get(b"/palisade/t/ok-1") is not None and await store.get(b"/palisade/t/leased") is None


LABELS = [LabelSet.of([f"k8s:app=batch-{i}", "k8s:io.kubernetes.pod.namespace=b"]) for i in range(40)]


async def test_two_replicas_allocating_in_batches_never_duplicate_and_gc_stays_right(
    store: Store, second_store: Store
) -> None:
    """Two allocators with their own etcd clients, 16 requests in flight each, over shared label sets."""
    a = IdentityAllocator(store, NodeLeases(store, 60))
    b = IdentityAllocator(second_store, NodeLeases(second_store, 60))
    before = store.batching[0] + second_store.batching[0]
    sem = asyncio.Semaphore(32)

    async def one(alloc: IdentityAllocator, node: str, i: int) -> tuple[int, int]:
        async with sem:
            got = await alloc.allocate(LABELS[i % 40], node, f"pod/b/{node}-{i}")
            return i % 40, got.identity.id

    jobs = [one(a, "node-a", i) for i in range(120)] + [one(b, "node-b", i) for i in range(120)]
    results = await asyncio.gather(*jobs)
    by_labels: dict[int, int] = {}
    for labels, ident in results:
        assert by_labels.setdefault(labels, ident) == ident, f"label set {labels} got two identities"
    assert len(set(by_labels.values())) == 40, "one identity was given to two label sets"
    sent = store.batching[0] + second_store.batching[0] - before
    assert sent < 240, "no transaction was sent together with another"
    # etcd holds one reference per allocation, each identity its three per node.
    assert await store.count(keys.IDENTITY_REFS.encode()) == 240
    assert [await a.references(ident) for ident in by_labels.values()] == [6] * 40

    # Released concurrently through both; the collector takes exactly the unreferenced ones.
    keep = by_labels[0]
    releases = [
        (a if node == "node-a" else b).release(by_labels[i % 40], node, f"pod/b/{node}-{i}")
        for node in ("node-a", "node-b")
        for i in range(120)
        if i % 40 != 0
    ]
    await asyncio.gather(*releases)
    tracker = GcTracker(grace=10)
    assert (await a.collect(tracker, now=0)).collected == []
    swept = await a.collect(tracker, now=20)
    assert {i.id for i in swept.collected} == set(by_labels.values()) - {keep}
    assert set(swept.current) == {keep}
    assert await a.references(keep) == 6


async def test_two_replicas_allocating_addresses_in_batches_never_duplicate(store: Store, second_store: Store) -> None:
    pools = [ipaddress.ip_network("10.50.0.0/16")]
    a = IPAllocator(store, pools, mask_v4=24, mask_v6=120, mode=IPAMMode.CLUSTER_POOL)
    b = IPAllocator(second_store, pools, mask_v4=24, mask_v6=120, mode=IPAMMode.CLUSTER_POOL)
    await a.load()
    await a.node_cidrs("shared")
    await b.load()
    before = store.batching[0] + second_store.batching[0]
    sem = asyncio.Semaphore(32)

    async def one(alloc: IPAllocator, who: str, i: int) -> str:
        async with sem:
            return (await alloc.allocate("shared", f"pod/b/{who}-{i}")).ip

    got = await asyncio.gather(*(one(a, "a", i) for i in range(100)), *(one(b, "b", i) for i in range(100)))
    assert len(set(got)) == 200, "an address was handed out twice"
    assert store.batching[0] + second_store.batching[0] - before < 200
    kvs, _ = await store.get_prefix(keys.ipam_ips_of("shared"))
    assert sorted(kv.key for kv in kvs) == sorted(keys.ipam_ip("shared", ip) for ip in got)
    await asyncio.gather(*(a.release("shared", ip) for ip in got[:100]), *(b.release("shared", ip) for ip in got[100:]))
    assert await store.count(keys.ipam_ips_of("shared")) == 0
    assert await store.count(keys.IPAM_OWNERS.encode()) == 0
