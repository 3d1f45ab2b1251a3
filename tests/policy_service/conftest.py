"""Fixtures for the policy service tests: a real NATS, the service, and three played datapaths."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from testkit.harness import NatsServer, ServiceProcess
from testkit.harness import channel as policy_channel
from testkit.policycluster import Datapath, start_policy
from testkit.scenario import PODS, Env, seeded


@pytest.fixture
async def env(nats_server: NatsServer, service: Callable[..., ServiceProcess]) -> AsyncIterator[Env]:
    feed, log = await seeded(nats_server)
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
