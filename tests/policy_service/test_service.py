"""The policy service as a process on a real NATS, with datapaths played over the real gRPC API."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2

from palisade.v1 import common_pb2, common_pb2_grpc, policy_pb2, policy_pb2_grpc
from services.common.largeobjects import LargeObjects
from testkit import builders
from testkit.harness import NatsServer, ServiceProcess, channel, health_status
from testkit.policycluster import Feed, OrderLog, eventually, start_policy
from testkit.scenario import CACHE, DB, PODS, WEB, Env, next_orders, publish_world


async def test_not_serving_and_no_orders_until_kubernetes_is_synced(
    nats_server: NatsServer, service: Callable[..., ServiceProcess]
) -> None:
    feed = await Feed.open(nats_server)
    log = OrderLog()
    await log.start(feed.bus)
    await publish_world(feed)
    await feed.policy(builders.netpol("db-from-web", {"app": "db"}, {"app": "web"}, 5432))
    proc = await start_policy(service, nats_server, wait=False)
    await eventually(lambda: health_status(proc.address, proc.name) != -1, "the gRPC server to listen")
    async with channel(proc.address, "policy", "datapath") as ch:  # Resync is the datapaths' call
        status = await common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
        assert not status.synced
        assert health_status(proc.address, proc.name) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await policy_pb2_grpc.PolicyServiceStub(ch).Resync(policy_pb2.ResyncRequest(node="n1"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "synced marker" in (err.value.details() or "")

        await feed.synced()
        await asyncio.to_thread(proc.wait_serving)
        status = await common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    assert status.synced and status.revision > 0
    assert status.details["nodes"] == "3"
    # Nothing was ordered before the marker; the first orders carry each node's whole state.
    await eventually(lambda: set(log.by_node) == {"n1", "n2", "n3"}, "first orders")
    firsts = {node: orders[0] for node, orders in log.by_node.items()}
    assert all(o.replace and o.sequence == 1 and o.revision == status.revision for o in firsts.values())
    assert {node: sorted(d.identity for d in o.diffs) for node, o in firsts.items()} == {
        "n1": [WEB],
        "n2": [DB],
        "n3": [WEB, CACHE],
    }
    await feed.close()
    assert await asyncio.to_thread(proc.terminate) == 0, proc.logs()


async def test_policy_deltas_order_only_affected_nodes_with_exact_diffs(env: Env) -> None:
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.policy(builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 80))
    orders = await next_orders(env, before, "orders for the new policy")
    # Web lives on n1 and n3: only they get a diff, for web only; n2 gets a revision bump.
    assert {n: [d.identity for d in o.diffs] for n, o in orders.items()} == {"n1": [WEB], "n2": [], "n3": [WEB]}
    assert all(o.sequence == before[n] + 1 for n, o in orders.items())
    web_diff = orders["n1"].diffs[0]
    assert [(e.key.remote_identity, e.key.port_low) for e in web_diff.add] == [(DB, 80)]
    assert web_diff.enforcement.ingress and not web_diff.full

    # The same object with another port: remove the old entry, add the new one.
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.policy(builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 8080))
    orders = await next_orders(env, before, "orders for the replacement")
    web_diff = orders["n3"].diffs[0]
    assert [(e.key.remote_identity, e.key.port_low) for e in web_diff.add] == [(DB, 8080)]
    assert [(e.key.remote_identity, e.key.port_low) for e in web_diff.remove] == [(DB, 80)]
    assert orders["n2"].diffs == []

    # A rejected object: no order at all, and its error is visible.
    bad = builders.netpol("broken", {"app": "db"}, {"app": "web"}, 5432)
    bad["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"] = [{"key": "x", "operator": "Sideways"}]
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.policy(bad)
    await env.feed.policy(builders.netpol("later", {"app": "cache"}, {"app": "web"}, 11211))
    orders = await next_orders(env, before, "orders after the rejected policy")
    # One order per node: the rejected object caused none.
    assert all(o.sequence == before[n] + 1 for n, o in orders.items())
    assert {n: [d.identity for d in o.diffs] for n, o in orders.items()} == {"n1": [], "n2": [], "n3": [CACHE]}
    status = await env.api.GetPolicy(
        policy_pb2.GetPolicyRequest(ref=common_pb2.ObjectRef(kind="NetworkPolicy", namespace="default", name="broken"))
    )
    assert status.state == policy_pb2.POLICY_STATE_REJECTED
    assert status.source == policy_pb2.POLICY_SOURCE_KUBERNETES
    assert "NetworkPolicy default/broken" in status.error
    assert "spec.ingress[0].from[0].podSelector.matchExpressions[0].operator" in status.error

    revision = max(o.revision for o in orders.values())
    await env.settled(revision)
    assert await env.all_match_resync()


async def test_a_policy_larger_than_a_message_is_read_from_the_object_store(env: Env) -> None:
    doc = builders.netpol("huge", {"app": "web"}, {"app": "db"}, 80)
    doc["spec"]["ingress"] = [
        {"from": [{"ipBlock": {"cidr": f"10.{i // 256 % 256}.{i % 256}.0/24"}}], "ports": [{"port": 1 + i % 60000}]}
        for i in range(20_000)
    ]
    doc["spec"]["ingress"].append({"from": [{"podSelector": {"matchLabels": {"app": "db"}}}], "ports": [{"port": 80}]})
    delta = builders.delta(doc)
    assert delta.ByteSize() > env.feed.bus.max_payload
    slim = await LargeObjects(env.feed.bus).externalize(delta)
    assert slim.object_ref and not slim.object_json
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.bus.publish(builders.delta_subject(doc), slim)
    orders = await next_orders(env, before, "orders for the large policy")
    assert {n: [d.identity for d in o.diffs] for n, o in orders.items()} == {"n1": [WEB], "n2": [], "n3": [WEB]}
    status = await env.api.GetPolicy(
        policy_pb2.GetPolicyRequest(ref=common_pb2.ObjectRef(kind="NetworkPolicy", namespace="default", name="huge"))
    )
    assert status.state != policy_pb2.POLICY_STATE_REJECTED and not status.error
    assert "10.78.31.0/24" in status.document  # the last of the 20,000 blocks
