"""End to end with the real ipam: Kubernetes deltas in, identities and ipcache from ipam, orders out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc

from palisade.v1 import identity_pb2, identity_pb2_grpc, policy_pb2, policy_pb2_grpc
from testkit import builders
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, channel
from testkit.policycluster import Datapath, Feed, OrderLog, eventually, start_policy

NS = "shop"


def pod(name: str, app: str, node: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": app}, "uid": f"uid-{name}"},
        "spec": {"nodeName": node, "containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


async def apply(feed: Feed, obj: dict[str, Any]) -> None:
    await feed.bus.publish(builders.delta_subject(obj), builders.delta(obj))


async def resolve(channel: grpc.aio.Channel, name: str) -> identity_pb2.ResolvePodResponse | None:
    try:
        answer: identity_pb2.ResolvePodResponse = await identity_pb2_grpc.IdentityServiceStub(channel).ResolvePod(
            identity_pb2.ResolvePodRequest(namespace=NS, name=name), timeout=5
        )
    except grpc.aio.AioRpcError:
        return None
    return answer


async def test_kubernetes_to_orders_through_the_real_ipam(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess]
) -> None:
    feed = await Feed.open(nats_server)
    log = OrderLog()
    await log.start(feed.bus)
    await apply(feed, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS, "labels": {"team": "a"}}})
    await apply(feed, pod("web-1", "web", "node-a", "10.244.0.10"))
    await apply(feed, pod("db-1", "db", "node-b", "10.244.1.10"))
    await apply(feed, pod("web-2", "web", "node-c", "10.244.2.10"))
    await feed.policy(builders.netpol("db-from-web", {"app": "db"}, {"app": "web"}, 5432, namespace=NS))
    await feed.synced()

    ipam = service(
        "ipam",
        "--nats-url",
        nats_server.url,
        "--etcd-endpoints",
        etcd_server.endpoint,
        "--log-format",
        "text",
        wait=False,
    )
    await asyncio.to_thread(ipam.wait_serving)
    policy = await start_policy(service, nats_server)
    async with channel(ipam.address, "ipam", "datapath") as ipam_channel:
        resolved: dict[str, identity_pb2.ResolvePodResponse] = {}
        for name in ("web-1", "db-1", "web-2"):
            resolved[name] = await eventually(partial(resolve, ipam_channel, name), f"ipam resolving {name}")
        web = resolved["web-1"].identity.id
        db = resolved["db-1"].identity.id
        assert resolved["web-2"].identity.id == web and web != db

        endpoints = {
            "node-a": {f"{NS}/web-1": (1, web)},
            "node-b": {f"{NS}/db-1": (2, db)},
            "node-c": {f"{NS}/web-2": (3, web)},
        }
        datapaths = {n: Datapath(feed.bus, policy.address, n, eps) for n, eps in endpoints.items()}
        for dp in datapaths.values():
            await dp.start()
        await eventually(lambda: all(web in datapaths[n].state.policies for n in ("node-a", "node-c")), "web on a, c")
        db_policy = await eventually(lambda: datapaths["node-b"].state.policies.get(db), "db's policy on node-b")
        assert db_policy[0] == (True, False)
        assert [(k[1], k[3]) for k in db_policy[1]] == [(web, 5432)]

        # A second policy selects web: only node-a and node-c get a diff, for web only.
        before = {n: log.last_sequence(n) for n in endpoints}
        await feed.policy(builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 80, namespace=NS))
        nxt = await eventually(
            lambda: (
                all(log.last_sequence(n) > before[n] for n in endpoints)
                and {n: next(o for o in log.by_node[n] if o.sequence == before[n] + 1) for n in endpoints}
            ),
            "orders for web-from-db",
        )
        assert {n: [d.identity for d in o.diffs] for n, o in nxt.items()} == {
            "node-a": [web],
            "node-b": [],
            "node-c": [web],
        }

        # A new db pod lands on node-a: node-a gets db's full policy, nobody else hears of it.
        before = {n: log.last_sequence(n) for n in endpoints}
        await apply(feed, pod("db-2", "db", "node-a", "10.244.0.11"))
        full = await eventually(
            lambda: [o for o in log.by_node["node-a"] if o.sequence > before["node-a"] and o.diffs],
            "db's policy sent to node-a",
        )
        assert [(d.identity, d.full) for d in full[0].diffs] == [(db, True)]
        assert all(log.last_sequence(n) == before[n] for n in ("node-b", "node-c"))
        datapaths["node-a"].endpoints[f"{NS}/db-2"] = (4, db)

        await eventually(lambda: db in datapaths["node-a"].state.policies, "db on node-a")
        async with channel(policy.address, "policy") as operator:  # listing is the CLI's, not a datapath's
            current = (
                await policy_pb2_grpc.PolicyServiceStub(operator).ListPolicies(policy_pb2.ListPoliciesRequest())
            ).revision
        await datapaths["node-a"].resync()  # report the new endpoint at the current revision
        waited = await datapaths["node-a"].stub.WaitForRevision(
            policy_pb2.WaitForRevisionRequest(revision=current, timeout_seconds=20), timeout=30
        )
        assert waited.realized, list(waited.behind)
        for dp in datapaths.values():
            assert await dp.matches_resync(), dp.node
            await dp.stop()
    await feed.close()
