"""The persisted revision and sequences in a real JetStream key-value bucket."""

from __future__ import annotations

import pytest

from services.common.bus import Bus
from services.policy.engine.orders import PolicyEpoch
from services.policy.revision import EPOCH_KEY, EpochConflictError, EpochCorruptError, RevisionStore
from testkit.harness import NatsServer, creds


async def connect(nats: NatsServer) -> Bus:
    return await Bus.connect([nats.url], name="test-revision", retries=3, backoff=0.05, tls=creds())


async def test_state_round_trips_and_survives_a_nats_restart(nats_server: NatsServer) -> None:
    async with await connect(nats_server) as bus:
        store = await RevisionStore.open(bus.js, "POLICY_T")
        assert await store.load() == PolicyEpoch()
        await store.save(PolicyEpoch(7, {"n1": 3}))
        await store.save(PolicyEpoch(9, {"n1": 4, "n2": 1}))
    nats_server.restart()
    async with await connect(nats_server) as bus:
        store = await RevisionStore.open(bus.js, "POLICY_T")
        assert await store.load() == PolicyEpoch(9, {"n1": 4, "n2": 1})


async def test_a_second_writer_is_detected(nats_server: NatsServer) -> None:
    async with await connect(nats_server) as bus:
        first = await RevisionStore.open(bus.js, "POLICY_T")
        second = await RevisionStore.open(bus.js, "POLICY_T")
        await first.load()
        await second.load()
        await first.save(PolicyEpoch(1, {"n1": 1}))
        with pytest.raises(EpochConflictError, match="another writer"):
            await second.save(PolicyEpoch(1, {"n1": 2}))


async def test_corrupt_state_names_the_bucket(nats_server: NatsServer) -> None:
    async with await connect(nats_server) as bus:
        store = await RevisionStore.open(bus.js, "POLICY_T")
        kv = await bus.js.key_value("POLICY_T")
        await kv.put(EPOCH_KEY, b'{"revision": -1}')
        with pytest.raises(EpochCorruptError, match="bucket POLICY_T"):
            await store.load()
