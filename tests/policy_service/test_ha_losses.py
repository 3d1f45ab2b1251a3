"""Two policy replicas on a 3-server NATS cluster: the leader and a NATS server lost together.

Two losses at once may slow things down, but a replica never exits over them: the leader,
restarted in place as the dev stack (or a kubelet) restarts it, starts while the streams that
the lost server led have no leader yet, and the follower takes over through the same gap
(whichever of the two then leads, the other follows: a leader that loses its lease meanwhile
steps down in place, see test_replicas and test_election).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from palisade.v1 import common_pb2, common_pb2_grpc
from services.common.bus import ALL_STREAMS, Bus
from testkit import builders
from testkit.harness import NatsCluster, ServiceProcess, creds
from testkit.harness import channel as open_channel
from testkit.policycluster import PATIENCE, Datapath, Feed, eventually
from testkit.scenario import CACHE, DB, PODS, publish_world

STATE_BUCKET = "PALISADE_POLICY"


async def _role(address: str) -> str:
    channel = open_channel(address, "policy")
    try:
        status = await common_pb2_grpc.StatusServiceStub(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return ""
    finally:
        await channel.close()
    return status.details.get("role", "") if status.synced else ""


async def _stream_leader(bus: Bus, stream: str) -> str:
    info = await bus.js.stream_info(stream)
    return info.cluster.leader if info.cluster is not None and info.cluster.leader else ""


async def test_losing_the_leader_and_a_nats_server_together_stops_no_replica(
    nats_cluster: NatsCluster, service: Callable[..., ServiceProcess]
) -> None:
    bus = await Bus.connect(nats_cluster.urls, name="test-feed", tls=creds())
    feed = Feed(bus)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(feed.close)
        await bus.retry("ensure streams", lambda: bus.ensure_streams(*ALL_STREAMS))
        await publish_world(feed)
        await feed.policy(builders.netpol("db-from-web", {"app": "db"}, {"app": "web"}, 5432))
        await feed.synced()

        def replica(name: str) -> ServiceProcess:
            args = ("--nats-url", nats_cluster.url, "--log-format", "text", "--member", name, "--leader-lease", "1.5")
            return service("policy", *args, wait=False)

        one = replica("policy-1")
        await asyncio.to_thread(one.wait_serving, 60)
        two = replica("policy-2")
        await asyncio.to_thread(two.wait_serving, 60)
        await eventually(lambda: _role(two.address), "policy-2 to follow")
        assert await _role(one.address) == "leader"
        db_node = Datapath(bus, two.address, "n2", PODS["n2"])
        await db_node.start()
        stack.push_async_callback(db_node.stop)

        # The NATS server that leads the policy state's stream goes with the policy leader; the
        # leader comes back at once on its address and name, as the dev stack restarts it.
        victim_name = await _stream_leader(bus, f"KV_{STATE_BUCKET}")
        victim = next(m for m in nats_cluster.members if m.cluster is not None and m.cluster.server_name == victim_name)
        one.kill()
        victim.stop(kill=True)
        one.start(wait=False)

        # A policy edit meanwhile is planned and published by whichever replica leads.
        await feed.policy(builders.netpol("db-from-cache", {"app": "db"}, {"app": "cache"}, 6379))

        def enforced() -> bool:
            _, entries = db_node.state.policies.get(DB, ((False, False), {}))
            return any(key[1] == CACHE and key[3] == 6379 for key in entries)

        await eventually(enforced, "the edit in the orders of db's node", 3 * PATIENCE)
        await eventually(lambda: _both_serving(one, two), "both replicas serving, one leading", 3 * PATIENCE)
        for proc in (one, two):
            assert proc.proc is not None and proc.proc.poll() is None, proc.logs()[-3000:]


async def _both_serving(one: ServiceProcess, two: ServiceProcess) -> bool:
    for proc in (one, two):
        assert proc.proc is not None and proc.proc.poll() is None, f"{proc.name} exited:\n{proc.logs()[-3000:]}"
    return sorted([await _role(one.address), await _role(two.address)]) == ["follower", "leader"]
