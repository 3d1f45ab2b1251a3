"""The leader lease on a real NATS: one leader, a follower takes over when it goes, fencing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.js.errors import KeyNotFoundError

from services.common.bus import Bus
from services.policy.election import LEADER_KEY, Election
from testkit.harness import NatsServer, creds
from testkit.policycluster import eventually

BUCKET = "PALISADE_POLICY_LEADER"  # the bucket the policy user may use
LEASE = 1.0


@contextlib.asynccontextmanager
async def replica(server: NatsServer, name: str, address: str) -> AsyncIterator[tuple[Election, asyncio.Task[None]]]:
    bus = await Bus.connect([server.url], name=name, tls=creds("policy"))
    election = await Election.open(bus, BUCKET, member=name, address=lambda: address, lease=LEASE)
    task = asyncio.create_task(election.run())
    try:
        yield election, task
    finally:
        # Resigned, run() ends after its step (cancelling it inside a read of the bucket's keys
        # would leave the client's watcher tasks behind).
        await election.resign()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        await bus.close()


async def _expired(election: Election, key: str) -> bool:
    try:
        await election._kv.get(key)
    except KeyNotFoundError as err:
        return err.op is None  # gone, not deleted
    return False


def _leads(election: Election, name: str) -> bool:
    return election.leader is not None and election.leader.name == name


async def test_one_leader_and_a_follower_that_takes_over_when_it_dies(nats_server: NatsServer) -> None:
    async with replica(nats_server, "a", "10.0.0.1:1") as (a, a_task):
        a.run_for_leader()
        await asyncio.wait_for(a.leading.wait(), 5)
        async with replica(nats_server, "b", "10.0.0.2:1") as (b, _):
            b.run_for_leader()
            await eventually(lambda: _leads(b, "a"), "b to see a lead", 5)
            await asyncio.sleep(3 * LEASE)  # renewals keep the lease: b never leads meanwhile
            assert not b.leading.is_set() and b.leader is not None and b.leader.address == "10.0.0.1:1"
            await eventually(lambda: {"a", "b"} <= set(b.members), "both heartbeats", 5)
            assert b.members["a"].role == "leader" and b.members["b"].role == "follower"
            # a dies without a word (no resign): its lease expires and b takes it.
            a_task.cancel()
            loop = asyncio.get_running_loop()
            stopped = loop.time()
            await asyncio.wait_for(b.leading.wait(), 5 * LEASE)
            assert loop.time() - stopped <= 2 * LEASE + 0.5
            # Its heartbeat expired with it; it stays listed, silent, for status to show.
            await eventually(lambda: _expired(b, "member.a"), "a's heartbeat to expire", 5)
            await b._refresh()  # a read of the bucket that no longer holds a's heartbeat
            assert "a" in b.members and b.members["a"].role == "leader"


async def test_a_clean_stop_hands_over_at_once(nats_server: NatsServer) -> None:
    async with replica(nats_server, "a", "10.0.0.1:1") as (a, _):
        a.run_for_leader()
        await asyncio.wait_for(a.leading.wait(), 5)
        async with replica(nats_server, "b", "10.0.0.2:1") as (b, _):
            b.run_for_leader()
            await eventually(lambda: _leads(b, "a"), "b to see a lead", 5)
            await a.resign()
            loop = asyncio.get_running_loop()
            stopped = loop.time()
            await asyncio.wait_for(b.leading.wait(), 5)
            # Well before the lease would have expired: b campaigns every quarter lease.
            assert loop.time() - stopped < LEASE
            # A replica that resigned is no longer listed (it is not silent: it left).
            await eventually(lambda: "a" not in b.members, "a to leave the member list", 5)


@contextlib.asynccontextmanager
async def dead_leader(server: NatsServer, name: str, address: str) -> AsyncIterator[None]:
    """The lease of a leader killed without a word (kill -9: never resigned), written as it left it."""
    bus = await Bus.connect([server.url], name="dead", tls=creds("policy"))
    try:
        election = await Election.open(bus, BUCKET, member=name, address=lambda: address, lease=LEASE)
        await election._kv.put(LEADER_KEY, election._value())
        yield
    finally:
        await bus.close()


@pytest.mark.parametrize("old_name", ["old", "new"])
async def test_a_replica_restarted_in_place_takes_its_predecessors_lease(
    nats_server: NatsServer, old_name: str
) -> None:
    # Same address (it holds the port the dead process held), under another name or its own (make
    # run names its one replica "policy" every time): no wait for the lease.
    async with (
        dead_leader(nats_server, old_name, "10.0.0.1:1"),
        replica(nats_server, "new", "10.0.0.1:1") as (new, _),
    ):
        new.run_for_leader()
        await asyncio.wait_for(new.leading.wait(), LEASE / 2)
        assert await new.confirm()  # its own lease now, not its predecessor's


async def test_a_replica_restarted_in_place_never_takes_its_predecessor_for_a_leader(nats_server: NatsServer) -> None:
    """Before it is warm, a replica restarted in place reads its dead predecessor's lease: that is
    no leader to follow (the service would report SERVING and forward every call to itself, each
    refused with "no policy leader right now"). It sees none until it takes the lease."""
    async with dead_leader(nats_server, "old", "10.0.0.1:1"), replica(nats_server, "new", "10.0.0.1:1") as (new, _):
        await new._refresh()  # not warm yet: not a candidate, reading the bucket
        assert new.leader is None and not new.leader_known.is_set()
        new.run_for_leader()
        await asyncio.wait_for(new.leading.wait(), LEASE / 2)
        assert new.leader_known.is_set() and _leads(new, "new")


async def test_a_leader_whose_lease_was_taken_steps_down_and_can_lead_again(nats_server: NatsServer) -> None:
    async with replica(nats_server, "a", "10.0.0.1:1") as (a, a_task):
        a.run_for_leader()
        await asyncio.wait_for(a.leading.wait(), 5)
        # Another replica takes the lease (as after a partition, or a NATS outage, that outlived it).
        bus = await Bus.connect([nats_server.url], name="thief", tls=creds("policy"))
        try:
            kv = await bus.js.key_value(BUCKET)
            await kv.put(LEADER_KEY, b'{"member": "b", "address": "10.0.0.2:1"}')
            await asyncio.wait_for(a.stepped_down.wait(), 5)
            assert not a.leading.is_set() and not a_task.done()  # a follower now, still running
            await eventually(lambda: _leads(a, "b"), "a to see b lead", 5)
            # Until the service has put its state back to a follower's, it does not campaign.
            await kv.delete(LEADER_KEY)
            await eventually(lambda: a.leader is None, "a to see the lease free", 5)
            assert not a.leading.is_set()
            a.resume()
            await asyncio.wait_for(a.leading.wait(), 5)
        finally:
            await bus.close()


async def test_a_leader_confirms_its_lease_or_steps_down(nats_server: NatsServer) -> None:
    """On a refused state write: still its lease (a real conflict), or another's (step down)."""
    async with replica(nats_server, "a", "10.0.0.1:1") as (a, _):
        a.run_for_leader()
        await asyncio.wait_for(a.leading.wait(), 5)
        assert await a.confirm()
        bus = await Bus.connect([nats_server.url], name="thief", tls=creds("policy"))
        try:
            await (await bus.js.key_value(BUCKET)).put(LEADER_KEY, b'{"member": "b", "address": "10.0.0.2:1"}')
            assert not await a.confirm()
            assert a.stepped_down.is_set() and not a.leading.is_set()
        finally:
            await bus.close()
