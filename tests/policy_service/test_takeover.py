"""A leader's takeover claims the stored state: on a real NATS, the interleavings that used to let
two leaders hand out the same order sequences.

Found in an HA run: a replica elected while a NATS server was down read the state only after
the lease had passed to another replica that had already published; it continued that
replica's sequences, the datapaths applied its orders, and then dropped the real leader's as
already seen. The takeover now reads the lease after the state and writes the state back
before it plans anything.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from services.common.bus import Bus
from services.policy.controller import NotLeading
from services.policy.election import LEADER_KEY, Election
from services.policy.engine.orders import PolicyEpoch
from services.policy.revision import EPOCH_KEY, EpochConflictError, RevisionStore
from services.policy.service import claim_state
from testkit.harness import NatsServer, creds

STATE = "PALISADE_POLICY"
LEASE_BUCKET = "PALISADE_POLICY_LEADER"
#: Long enough that no lease expires by itself during a test: only the tests move it.
LEASE = 30.0


@contextlib.asynccontextmanager
async def leader(server: NatsServer, name: str) -> AsyncIterator[tuple[Bus, Election, RevisionStore]]:
    """A replica that has just won the lease (its election loop is not running: the test moves it)."""
    bus = await Bus.connect([server.url], name=name, tls=creds("policy"))
    try:
        election = await Election.open(bus, LEASE_BUCKET, member=name, address=lambda: f"{name}:1", lease=LEASE)
        election.run_for_leader()
        await election._campaign()
        store = await RevisionStore.open(bus.js, STATE)
        yield bus, election, store
    finally:
        await bus.close()


async def take_lease(bus: Bus, winner: Election) -> None:
    """The lease passes to ``winner``, as when it wins after the holder's lease expired."""
    kv = await bus.js.key_value(LEASE_BUCKET)
    await kv.put(LEADER_KEY, winner._value())


async def stored(bus: Bus) -> dict[str, object]:
    kv = await bus.js.key_value(STATE)
    entry = await kv.get(EPOCH_KEY)
    value: dict[str, object] = json.loads(entry.value or b"{}")
    return value


async def test_a_takeover_that_reads_the_state_after_another_leader_published_stands_down(
    nats_server: NatsServer,
) -> None:
    async with leader(nats_server, "slow") as (slow_bus, slow, slow_store):
        assert slow.leading.is_set()
        # The lease passes to "quick" (slow's takeover is stalled); quick claims and publishes.
        async with leader(nats_server, "quick") as (quick_bus, quick, quick_store):
            await take_lease(quick_bus, quick)
            quick.leading.set()
            assert await claim_state(quick_bus, quick, quick_store) == PolicyEpoch()
            await quick_store.save(PolicyEpoch(12, {"n1": 6}))
            before = await stored(quick_bus)
            # slow's takeover goes on only now: it reads quick's state, then finds the lease quick's.
            with pytest.raises(NotLeading):
                await claim_state(slow_bus, slow, slow_store)
            assert slow.stepped_down.is_set() and not slow.leading.is_set()
            assert await stored(quick_bus) == before  # slow wrote nothing: its sequences are never used
            await quick_store.save(PolicyEpoch(13, {"n1": 7}))  # quick's writes still go through


async def test_a_deposed_leaders_write_fails_once_the_new_leader_claimed(nats_server: NatsServer) -> None:
    async with leader(nats_server, "old") as (old_bus, old, old_store):
        assert await claim_state(old_bus, old, old_store) == PolicyEpoch()
        await old_store.save(PolicyEpoch(5, {"n1": 2}))
        async with leader(nats_server, "new") as (new_bus, new, new_store):
            await take_lease(new_bus, new)
            new.leading.set()
            assert await claim_state(new_bus, new, new_store) == PolicyEpoch(5, {"n1": 2})
            # The old leader has not noticed yet: its next write (before any order) is refused.
            with pytest.raises(EpochConflictError):
                await old_store.save(PolicyEpoch(6, {"n1": 3}))
            assert not await old.confirm() and old.stepped_down.is_set()
            await new_store.save(PolicyEpoch(6, {"n1": 3}))


async def test_a_deposed_leaders_write_between_the_read_and_the_claim_is_read_again(nats_server: NatsServer) -> None:
    async with leader(nats_server, "old") as (old_bus, old, old_store):
        await claim_state(old_bus, old, old_store)
        await old_store.save(PolicyEpoch(5, {"n1": 2}))
        async with leader(nats_server, "new") as (new_bus, new, new_store):
            await take_lease(new_bus, new)
            new.leading.set()
            load = new_store.load
            reads: list[PolicyEpoch] = []

            async def load_then_old_writes() -> PolicyEpoch:
                epoch = await load()
                reads.append(epoch)
                if len(reads) == 1:  # the deposed leader's last write lands right after our read
                    await old_store.save(PolicyEpoch(6, {"n1": 3}))
                return epoch

            new_store.load = load_then_old_writes  # type: ignore[method-assign]
            claimed = await claim_state(new_bus, new, new_store)
            # Its sequence 3 may have been published: the new leader continues above it.
            assert reads == [PolicyEpoch(5, {"n1": 2}), PolicyEpoch(6, {"n1": 3})]
            assert claimed == PolicyEpoch(6, {"n1": 3})
            with pytest.raises(EpochConflictError):
                await old_store.save(PolicyEpoch(7, {"n1": 4}))


async def test_two_claims_of_the_same_state_are_told_apart(nats_server: NatsServer) -> None:
    """Both read the same state; the second claim must not take the first one's bytes for its own
    (as a retried write whose ack was lost)."""
    async with leader(nats_server, "a") as (_, _a, a_store), leader(nats_server, "b") as (_, _b, b_store):
        await a_store.load()
        await b_store.load()
        await a_store.claim("a")
        with pytest.raises(EpochConflictError):
            await b_store.claim("b")


async def test_a_lease_that_expired_with_nobody_taking_it_is_not_simply_renewed(nats_server: NatsServer) -> None:
    """Another replica may have led meanwhile: the leader steps down and takes over anew if it wins."""
    async with leader(nats_server, "a") as (bus, a, _):
        kv = await bus.js.key_value(LEASE_BUCKET)
        await kv.delete(LEADER_KEY)  # as the lease's expiry while NATS was away
        await a._renew()
        assert a.stepped_down.is_set() and not a.leading.is_set()
        a.resume()
        await a._campaign()
        assert a.leading.is_set()
        await kv.delete(LEADER_KEY)
        assert not await a.confirm()  # a lease found expired is not this leader's either
        assert a.stepped_down.is_set()
