"""Two ipam processes on one etcd: each serves what etcd holds, not only its own writes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from palisade.v1 import common_pb2, identity_pb2, ipam_pb2
from services.common.bus import Bus
from services.common.store import connect_etcd
from services.ipam import keys
from services.ipam.kv import Delete, Put, Store
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
