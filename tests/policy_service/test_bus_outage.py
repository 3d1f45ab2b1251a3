"""NATS goes away and comes back: the outage shows in status, and the next change flows at once.

The policy service keeps answering from what it knows while the bus is down (health stays
SERVING) but no longer claims to be synced. When NATS is back its consumers are re-created
on the reconnect itself, not after missed heartbeats (2 x 5 s), so the next change is applied
at once: the patience below is far shorter than heartbeat detection would need.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from palisade.v1 import common_pb2, common_pb2_grpc
from testkit import builders
from testkit.harness import health_status
from testkit.policycluster import eventually
from testkit.scenario import DB, Env

#: Well under the ~10 s an ordered consumer takes to notice, by missed heartbeats, that the server lost it.
RECOVERY_PATIENCE = 4.0


async def test_bus_outage_is_shown_and_the_next_change_flows_at_once(env: Env) -> None:
    status_api = common_pb2_grpc.StatusServiceStub(env.channel)

    async def status() -> common_pb2.ServiceStatus:
        answer: common_pb2.ServiceStatus = await status_api.GetStatus(common_pb2.GetStatusRequest(), timeout=10)
        return answer

    before = await status()
    assert before.synced and before.details["bus"] == "ok"

    await asyncio.to_thread(env.nats.stop)
    down = await eventually(
        lambda: _bus_down(status()),
        "status to show the bus down",
    )
    assert not down.synced and down.details["bus"].startswith("down"), down
    # It still answers: health is SERVING, and so are reads.
    health = await asyncio.to_thread(health_status, env.policy.address, "policy")
    assert health == health_pb2.HealthCheckResponse.SERVING

    await asyncio.to_thread(env.nats.start)
    await eventually(lambda: _bus_up(status()), "status to show the bus back")

    seen = {node: env.log.last_sequence(node) for node in env.datapaths}
    await env.feed.policy(builders.netpol("db-from-cache", {"app": "db"}, {"app": "cache"}, 6379))

    def order_for_db() -> bool:
        return any(
            o.sequence > seen["n2"] and any(d.identity == DB for d in o.diffs) for o in env.log.by_node.get("n2", [])
        )

    await eventually(order_for_db, "the change to reach n2 after the outage", timeout=RECOVERY_PATIENCE)
    assert "consumer re-created" in env.policy.logs()


async def _bus_down(pending: object) -> common_pb2.ServiceStatus | None:
    answer = await pending  # type: ignore[misc]
    return answer if answer.details.get("bus", "").startswith("down") else None


async def _bus_up(pending: object) -> common_pb2.ServiceStatus | None:
    answer = await pending  # type: ignore[misc]
    return answer if answer.details.get("bus") == "ok" and answer.synced else None
