"""Two ipam processes on one etcd: each serves what etcd holds, not only its own writes."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from nats.aio.msg import Msg

from palisade.v1 import common_pb2, identity_pb2, ipam_pb2
from services.common.bus import Bus
from services.common.labels import LabelSet
from services.common.store import connect_etcd
from services.ipam import keys
from services.ipam.kv import Delete, Put, Store
from services.ipam.model import Identity
from services.ipam.publish import IdentityPublisher
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, creds
from testkit.ipam import Api, BusView, K8s, eventually, ipam_args

NODE = "node-a"


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_streams()
        yield b


async def _allocations(api: Api, node: str = NODE) -> list[tuple[str, str]]:
    answer = await api.ipam.ListAllocations(ipam_pb2.ListAllocationsRequest(node=node), timeout=5)
    return sorted((a.ip, a.owner) for a in answer.allocations)


async def _details(api: Api) -> dict[str, str]:
    status = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    return dict(status.details)


async def test_two_replicas_serve_what_etcd_holds(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    view = await BusView.start(bus)
    await K8s(bus).synced()
    # A long collector interval: only the watch can announce what another writer put in etcd.
    args = ipam_args(nats_server, etcd_server, "--identity-gc-interval", "3600")
    a_proc, b_proc = service("ipam", *args), service("ipam", *args)
    a, b = Api(a_proc.address), Api(b_proc.address)

    # Ten addresses through A: B lists them and counts them.
    made = []
    for i in range(10):
        got = await a.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node=NODE, owner=f"pod/shop/p{i}"), timeout=10)
        made.append((got.ip, got.owner))
    await eventually(lambda: _same(_allocations(b), sorted(made)))
    await eventually(lambda: _has(_details(b), "allocations", "10"))
    assert (await b.ipam.GetNodeCIDR(ipam_pb2.GetNodeCIDRRequest(node=NODE))).cidrs

    # Released through B: A no longer lists addresses that do not exist.
    for ip, owner in made:
        await b.ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node=NODE, ip=ip, owner=owner), timeout=10)
    await eventually(lambda: _same(_allocations(a), []))
    await eventually(lambda: _has(_details(a), "allocations", "0"))

    # An address B takes is never offered by A (A's view knows it is in use).
    taken = await b.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node=NODE, owner="pod/shop/b"), timeout=10)
    await eventually(lambda: _same(_allocations(a), [(taken.ip, "pod/shop/b")]))
    other = await a.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node=NODE, owner="pod/shop/a"), timeout=10)
    assert other.ip != taken.ip

    # An identity B allocates counts in A's status too.
    before = int((await _details(a))["identities"])
    labels = [common_pb2.Label(source="k8s", key="app", value="replicated")]
    new = await b.identity.AllocateIdentity(
        identity_pb2.AllocateIdentityRequest(labels=labels, node=NODE, owner="pod/shop/b"), timeout=10
    )
    await eventually(lambda: _has(_details(a), "identities", str(before + 1)))

    # An identity written to etcd by an allocator that died before announcing it is announced
    # by the replicas from the watch event, not at the next collector pass an hour later.
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    try:
        store = Store(client)
        orphan, canonical = 4321, "k8s:app=orphan"
        await store.put(keys.identity_labels(canonical), str(orphan).encode())
        await store.put(keys.identity_id(orphan), canonical.encode())
    finally:
        await client.close()
    announced = await eventually(lambda: view.live_identity(orphan))
    assert [(x.source, x.key, x.value) for x in announced.identity.labels] == [("k8s", "app", "orphan")]
    await eventually(lambda: _has(_details(a), "identities", str(before + 2)))
    await eventually(lambda: _has(_details(b), "identities", str(before + 2)))
    assert view.live_identity(new.identity.id) is not None


async def _same(pending: object, want: object) -> bool:
    return await pending == want  # type: ignore[misc,no-any-return]


async def _has(pending: object, key: str, value: str) -> bool:
    details = await pending  # type: ignore[misc]
    return bool(details.get(key) == value)


async def test_two_replicas_announce_a_burst_of_identities_in_order(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    """Identities that appear and go faster than they are published go out together, in etcd's order."""
    view = await BusView.start(bus)
    await K8s(bus).synced()
    args = ipam_args(nats_server, etcd_server, "--identity-gc-interval", "3600")
    a, b = Api(service("ipam", *args).address), Api(service("ipam", *args).address)
    await eventually(lambda: _has(_details(a), "identities", "0"))
    await eventually(lambda: _has(_details(b), "identities", "0"))

    # Written by allocators that died before announcing: 60 appear in one transaction, 30 of
    # them go in the next, 10 of those come back with other labels in the third. Every replica
    # finds them queued at once.
    ids = range(5000, 5060)
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    try:
        store = Store(client)

        def put(ident: int, canonical: str) -> list[Put]:
            return [
                Put(keys.identity_labels(canonical), str(ident).encode()),
                Put(keys.identity_id(ident), canonical.encode()),
            ]

        await store.txn([], [op for i in ids for op in put(i, f"k8s:app=burst-{i}")])
        await store.txn(
            [],
            [
                op
                for i in ids[:30]
                for op in (Delete(keys.identity_id(i)), Delete(keys.identity_labels(f"k8s:app=burst-{i}")))
            ],
        )
        await store.txn([], [op for i in ids[:10] for op in put(i, f"k8s:app=again-{i}")])
    finally:
        await client.close()

    def app(ident: int) -> str | None:
        live = view.live_identity(ident)
        return live.identity.labels[0].value if live is not None else None

    want = {i: f"again-{i}" if i < 5010 else None if i < 5030 else f"burst-{i}" for i in ids}
    await eventually(lambda: {i: app(i) for i in ids} == want)
    # Tombstones are on the bus for the ones that went (not merely never announced).
    assert all(view.identities[i].deleted for i in ids[10:30])
    await eventually(lambda: _has(_details(a), "identities", "40"))
    await eventually(lambda: _has(_details(b), "identities", "40"))


async def _count_identity_messages(bus: Bus) -> Counter[tuple[int, bool]]:
    """Every identity message published from now on, counted by (id, deleted) (a plain subscription:
    a stream consumer of the compacted stream may miss a message that a newer one replaced)."""
    seen: Counter[tuple[int, bool]] = Counter()

    async def on_msg(msg: Msg) -> None:
        update = identity_pb2.IdentityUpdate()
        update.ParseFromString(msg.data)
        seen[(update.identity.id, update.deleted)] += 1

    await bus.nc.subscribe("palisade.identity.>", cb=on_msg)
    await bus.nc.flush()
    return seen


async def _write_orphan(etcd_server: EtcdServer, ident: int, canonical: str, *, creator_lease: int = 0) -> None:
    """An identity as an allocator writes it; with ``creator_lease``, recorded as created by replica "gone"."""
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    try:
        store = Store(client)
        creator = [Put(keys.identity_creator(ident), b"gone", creator_lease)] if creator_lease else []
        await store.txn(
            [],
            [
                *creator,
                Put(keys.identity_id(ident), canonical.encode()),
                Put(keys.identity_labels(canonical), str(ident).encode()),
            ],
        )
    finally:
        await client.close()


async def test_each_new_identity_is_announced_once_by_the_replica_that_created_it(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    await K8s(bus).synced()
    args = ipam_args(nats_server, etcd_server, "--identity-gc-interval", "3600")
    replicas = [Api(service("ipam", *args).address), Api(service("ipam", *args).address)]
    counted = await _count_identity_messages(bus)

    made = []
    for i in range(40):
        labels = [common_pb2.Label(source="k8s", key="app", value=f"once-{i}")]
        got = await replicas[i % 2].identity.AllocateIdentity(
            identity_pb2.AllocateIdentityRequest(labels=labels, node=NODE, owner=f"pod/shop/once-{i}"), timeout=10
        )
        assert got.new
        made.append(got.identity.id)
    # A barrier: an identity written with no creator is announced by both replicas, each after
    # everything its watch saw before it (the allocations above included).
    await _write_orphan(etcd_server, 4321, "k8s:app=barrier")
    await eventually(lambda: counted[(4321, False)] == 2)
    assert {ident: counted[(ident, False)] for ident in made} == dict.fromkeys(made, 1)


async def test_identities_of_a_creator_that_died_are_announced_by_the_others(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    """A creator that wrote an identity to etcd and died before announcing it: its record goes with
    its lease, and the replicas that see it go announce the identity."""
    view = await BusView.start(bus)
    await K8s(bus).synced()
    args = ipam_args(nats_server, etcd_server, "--identity-gc-interval", "3600")
    a, b = Api(service("ipam", *args).address), Api(service("ipam", *args).address)
    counted = await _count_identity_messages(bus)
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    try:
        store = Store(client)
        lease = await store.grant(60)
        await _write_orphan(etcd_server, 4400, "k8s:app=unannounced", creator_lease=lease)
        await _write_orphan(etcd_server, 4321, "k8s:app=barrier")
        await eventually(lambda: counted[(4321, False)] == 2)
        # Both replicas saw it, and left it to its creator.
        await eventually(lambda: _has(_details(a), "identities", "2"))
        await eventually(lambda: _has(_details(b), "identities", "2"))
        assert counted[(4400, False)] == 0
        await store.revoke(lease)
    finally:
        await client.close()
    announced = await eventually(lambda: view.live_identity(4400))
    assert [(x.source, x.key, x.value) for x in announced.identity.labels] == [("k8s", "app", "unannounced")]


async def test_a_collection_pass_leaves_identities_its_watch_has_not_reached_to_the_watch(bus: Bus) -> None:
    """The collector's listing can overtake the etcd watch: an identity another replica just created
    is listed before the watch says whose it is. Announcing it then would send it twice (its creator
    sends it); the pass leaves such identities to the watch, and sends only what it knows is owed."""
    counted = await _count_identity_messages(bus)
    publisher = IdentityPublisher(bus)
    fresh, heard, old = (LabelSet.of([f"k8s:app={app}", "k8s:io.kubernetes.pod.namespace=gc"]) for app in "abc")
    publisher.heard(Identity(5002, heard), revision=7)
    await publisher.resync({5001: fresh, 5002: heard, 5003: old}, revision=9, unwatched={5001, 5002})
    await bus.nc.flush()
    # 5003 predates the watch's position and is unknown here: owed. 5002 is its creator's to send.
    await eventually(lambda: counted[(5003, False)] == 1)
    # A barrier through the same connection: everything sent before it has arrived.
    await publisher.resync({5001: fresh, 5002: heard, 5003: old, 5004: old}, revision=10, unwatched={5001, 5002})
    await eventually(lambda: counted[(5004, False)] == 1)
    assert counted[(5001, False)] == 0 and counted[(5002, False)] == 0 and counted[(5003, False)] == 1
    # The watch catches up: the next pass finds 5001 still unannounced and owed to no creator.
    await publisher.resync({5001: fresh, 5002: heard, 5003: old, 5004: old}, revision=11)
    await eventually(lambda: counted[(5001, False)] == 1)
    assert counted[(5002, False)] == 0 and not any(deleted for _, deleted in counted)


async def test_no_identity_is_missed_when_a_replica_is_killed_mid_burst(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    view = await BusView.start(bus)
    await K8s(bus).synced()
    args = ipam_args(nats_server, etcd_server, "--identity-gc-interval", "3600", "--identity-lease-ttl", "2")
    doomed, survivor = service("ipam", *args), service("ipam", *args)
    api = Api(doomed.address)
    answered = 0
    enough = asyncio.Event()

    async def allocate(i: int) -> None:
        nonlocal answered
        labels = [common_pb2.Label(source="k8s", key="app", value=f"burst-{i}")]
        request = identity_pb2.AllocateIdentityRequest(labels=labels, node=NODE, owner=f"pod/shop/burst-{i}")
        with contextlib.suppress(grpc.RpcError):
            await api.identity.AllocateIdentity(request, timeout=10)
            answered += 1
            if answered == 100:
                enough.set()

    queue = list(range(1000))

    async def worker() -> None:
        while queue:
            await allocate(queue.pop())

    workers = [asyncio.create_task(worker()) for _ in range(16)]
    await enough.wait()
    assert doomed.proc is not None
    doomed.proc.kill()  # SIGKILL: allocations in flight may be in etcd and not on the bus
    await asyncio.gather(*workers)
    assert queue == []

    # Every identity etcd holds is announced (those the dead replica created once its lease expired).
    listed = await Api(survivor.address).identity.ListIdentities(identity_pb2.ListIdentitiesRequest(), timeout=10)
    held = {i.id: i.labels[0].value for i in listed.identities}
    assert len(held) >= 100

    def announced() -> dict[int, str]:
        return {i: live.identity.labels[0].value for i in held if (live := view.live_identity(i)) is not None}

    await eventually(lambda: announced() == held, timeout=30)
