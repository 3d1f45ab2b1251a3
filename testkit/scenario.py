"""The three-node scenario shared by the service tests: who lives where, and the environment."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from palisade.v1 import policy_pb2, policy_pb2_grpc
from services.common.access import may_call
from testkit import builders
from testkit.harness import NatsServer, ServiceProcess
from testkit.policycluster import Datapath, Feed, OrderLog, eventually

WEB, DB, CACHE = 256, 257, 258
PODS = {
    "n1": {"default/web-1": (11, WEB)},
    "n2": {"default/db-1": (21, DB)},
    "n3": {"default/web-2": (31, WEB), "default/cache-1": (32, CACHE)},
}
IPS = {
    "default/web-1": "10.0.1.1",
    "default/db-1": "10.0.2.1",
    "default/web-2": "10.0.3.1",
    "default/cache-1": "10.0.3.2",
}


@dataclass
class Env:
    nats: NatsServer
    feed: Feed
    log: OrderLog
    policy: ServiceProcess
    datapaths: dict[str, Datapath]
    channel: grpc.aio.Channel
    #: The same service reached as a datapath (the realization API is theirs alone).
    node_channel: grpc.aio.Channel

    @property
    def api(self) -> policy_pb2_grpc.PolicyServiceStub:
        return policy_pb2_grpc.PolicyServiceStub(self.channel)

    def api_for(self, method: str) -> policy_pb2_grpc.PolicyServiceStub:
        """A stub whose certificate may call ``method``: the CLI's, else a datapath's."""
        if may_call("cli", f"palisade.v1.PolicyService/{method}"):
            return self.api
        return policy_pb2_grpc.PolicyServiceStub(self.node_channel)

    async def all_match_resync(self) -> bool:
        return all([await dp.matches_resync() for dp in self.datapaths.values()])

    async def settled(self, revision: int) -> None:
        """Every datapath applied an order at ``revision`` or later."""
        await eventually(
            lambda: all(dp.state.revision >= revision for dp in self.datapaths.values()),
            f"every node at revision {revision}",
        )


async def seeded(nats: NatsServer) -> tuple[Feed, OrderLog]:
    """The bus as the watcher and ipam leave it: the world, one NetworkPolicy, the synced marker;
    and a log of every order published from now on."""
    feed = await Feed.open(nats)
    log = OrderLog()
    await log.start(feed.bus)
    await publish_world(feed)
    await feed.policy(builders.netpol("db-from-web", {"app": "db"}, {"app": "web"}, 5432))
    await feed.synced()
    return feed, log


async def publish_world(feed: Feed) -> None:
    await feed.identity(WEB, app="web")
    await feed.identity(DB, app="db")
    await feed.identity(CACHE, app="cache")
    for node, pods in PODS.items():
        for pod, (_, ident) in pods.items():
            await feed.pod(IPS[pod], ident, node, pod.split("/")[1])


async def next_orders(env: Env, before: dict[str, int], what: str) -> dict[str, policy_pb2.RegenerationOrder]:
    """The order right after ``before``'s sequence on every node."""

    def found() -> dict[str, policy_pb2.RegenerationOrder] | None:
        out = {}
        for node, seq in before.items():
            match = [o for o in env.log.by_node.get(node, []) if o.sequence == seq + 1]
            if not match:
                return None
            out[node] = match[0]
        return out

    result: dict[str, policy_pb2.RegenerationOrder] = await eventually(found, what)
    return result
