"""The common NATS and etcd helpers against real servers."""

from __future__ import annotations

import asyncio

from nats.js import api as jsapi

from palisade.v1 import identity_pb2, policy_pb2
from services.common.bus import IDENTITY_STREAM, MAX_CONSUMERS, REGEN_STREAM, Bus, Follower
from services.common.store import connect_etcd
from services.common.subjects import IDENTITY_ALL, identity_subject, regen_subject
from testkit.harness import EtcdServer, NatsServer, creds


async def test_nats_round_trip_and_compacted_replay(nats_server: NatsServer) -> None:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.ensure_stream(IDENTITY_STREAM)
        await bus.ensure_stream(IDENTITY_STREAM)  # idempotent
        for labels in ("k8s:app=a", "k8s:app=b"):
            msg = identity_pb2.IdentityUpdate(identity=identity_pb2.Identity(id=300, cidr=labels))
            await bus.publish(identity_subject(300), msg)
        await bus.publish(identity_subject(301), identity_pb2.IdentityUpdate(identity=identity_pb2.Identity(id=301)))

        seen: list[tuple[str, int, str]] = []

        async def handler(subject: str, m: identity_pb2.IdentityUpdate) -> None:
            seen.append((subject, m.identity.id, m.identity.cidr))

        follower = await bus.follow(IDENTITY_ALL, identity_pb2.IdentityUpdate, handler)
        await asyncio.wait_for(follower.caught_up.wait(), 5)
        # Compacted: only the last value per subject is replayed.
        assert seen == [("palisade.identity.300", 300, "k8s:app=b"), ("palisade.identity.301", 301, "")]
        await bus.publish(identity_subject(302), identity_pb2.IdentityUpdate(identity=identity_pb2.Identity(id=302)))
        for _ in range(50):
            if len(seen) == 3:
                break
            await asyncio.sleep(0.05)
        assert seen[-1][1] == 302
        await follower.stop()


async def test_follow_on_empty_stream_is_caught_up_at_once(nats_server: NatsServer) -> None:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.ensure_stream(IDENTITY_STREAM)

        async def handler(subject: str, m: identity_pb2.IdentityUpdate) -> None:
            raise AssertionError("nothing to deliver")

        follower = await bus.follow(IDENTITY_ALL, identity_pb2.IdentityUpdate, handler)
        assert follower.caught_up.is_set()
        await follower.stop()


async def test_a_stream_takes_a_consumer_per_node_past_the_servers_default_of_1000(nats_server: NatsServer) -> None:
    """A cluster of 1,001 nodes: each node's datapath follows its own orders (nats-server 2.15
    refuses the 1,001st consumer of a stream that sets no limit of its own)."""
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.ensure_stream(REGEN_STREAM)

        async def handler(subject: str, m: policy_pb2.RegenerationOrder) -> None:
            pass

        followers: list[Follower] = []
        for i in range(1001):
            followers.append(
                await bus.follow(regen_subject(f"node-{i}"), policy_pb2.RegenerationOrder, handler, deliver_new=True)
            )
        info = await bus.js.stream_info(REGEN_STREAM.name)
        assert info.state.consumer_count == 1001
        for follower in followers:
            await follower.stop()


async def test_a_stream_made_without_the_consumer_limit_gets_it(nats_server: NatsServer) -> None:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.js.add_stream(jsapi.StreamConfig(name=REGEN_STREAM.name, subjects=list(REGEN_STREAM.subjects)))
        await bus.ensure_stream(REGEN_STREAM)
        info = await bus.js.stream_info(REGEN_STREAM.name)
        assert info.config.max_consumers == MAX_CONSUMERS


async def test_etcd_transaction_through_factory(etcd_server: EtcdServer) -> None:
    host, port = etcd_server.endpoint.split(":")
    client = await connect_etcd([(host, int(port))], tls=creds("ipam"))
    try:
        key = b"/palisade/test/k"
        ok = await client.transaction(
            compare=[client.transactions.create(key) == 0],
            success=[client.transactions.put(key, b"v1")],
            failure=[],
        )
        assert ok[0] is True
        again = await client.transaction(
            compare=[client.transactions.create(key) == 0],
            success=[client.transactions.put(key, b"v2")],
            failure=[],
        )
        assert again[0] is False
        got = await client.get(key)
        assert got is not None and got.value == b"v1"
    finally:
        await client.close()


async def test_follow_with_filter_matching_nothing_in_a_busy_stream_is_caught_up(nats_server: NatsServer) -> None:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.ensure_stream(IDENTITY_STREAM)
        await bus.publish(identity_subject(400), identity_pb2.IdentityUpdate(identity=identity_pb2.Identity(id=400)))

        async def handler(subject: str, m: identity_pb2.IdentityUpdate) -> None:
            raise AssertionError("nothing matches the filter")

        follower = await bus.follow("palisade.identity.999", identity_pb2.IdentityUpdate, handler)
        assert follower.caught_up.is_set()
        await follower.stop()
