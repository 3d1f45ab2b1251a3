"""Fixtures for the policy service tests: a real NATS, the service, and three played datapaths."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from tests.harness import NatsServer, ServiceProcess
from tests.harness import channel as policy_channel
from tests.policy_service import builders
from tests.policy_service.cluster import Datapath, Feed, OrderLog, start_policy
from tests.policy_service.scenario import PODS, Env, publish_world


@pytest.fixture
async def env(nats_server: NatsServer, service: Callable[..., ServiceProcess]) -> AsyncIterator[Env]:
    feed = await Feed.open(nats_server)
    log = OrderLog()
    await log.start(feed.bus)
    await publish_world(feed)
    await feed.policy(builders.netpol("db-from-web", {"app": "db"}, {"app": "web"}, 5432))
    await feed.synced()
    proc = await start_policy(service, nats_server)
    datapaths = {node: Datapath(feed.bus, proc.address, node, pods) for node, pods in PODS.items()}
    for dp in datapaths.values():
        await dp.start()
    channel = policy_channel(proc.address, "policy")
    node_channel = policy_channel(proc.address, "policy", "datapath")
    yield Env(nats_server, feed, log, proc, datapaths, channel, node_channel)
    await channel.close()
    await node_channel.close()
    for dp in datapaths.values():
        await dp.stop()
    await feed.close()
