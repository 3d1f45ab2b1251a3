"""The bus on a 3-server NATS cluster: replicated streams, and clients that ride out a lost server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from palisade.v1 import k8s_pb2
from services.common.bus import ALL_STREAMS, K8S_STREAM, Bus, k8s_subject, replicas_for
from services.common.retry import StartupError
from services.common.subjects import k8s_filter
from testkit.harness import NatsCluster, NatsServer, bus_call_failed, creds


def test_three_servers_or_more_mean_three_replicas() -> None:
    assert replicas_for(["nats://a:4222"]) == 1
    assert replicas_for(["nats://a:4222", "nats://b:4222"]) == 1
    assert replicas_for(["nats://a", "nats://b", "nats://c"]) == 3


async def _connect(urls: list[str], name: str) -> Bus:
    # A cluster elects its JetStream meta leader after the servers meet: wait for it like a service does.
    bus = await Bus.connect(urls, name=name, tls=creds())
    for _ in range(100):
        try:
            await bus.js.account_info()
            return bus
        except Exception:
            await asyncio.sleep(0.1)
    await bus.close()
    raise AssertionError("JetStream never became available on the cluster")


async def test_streams_are_created_with_three_replicas(nats_cluster: NatsCluster) -> None:
    bus = await _connect(nats_cluster.urls, "replicas")
    try:
        await bus.retry("ensure streams", lambda: bus.ensure_streams(*ALL_STREAMS))
        for spec in ALL_STREAMS:
            info = await bus.js.stream_info(spec.name)
            assert info.config.num_replicas == 3, spec.name
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, spec.name
        store = await bus.object_store("PALISADE_K8S_OBJECTS", "test")
        assert (await store.status()).replicas == 3
    finally:
        await bus.close()


async def test_streams_are_ensured_while_the_cluster_forms(tmp_path: Path) -> None:
    """The first stream calls meet one server of three (no JetStream leader yet): they time out or find
    JetStream unavailable, and ensure_streams waits until the other two have joined."""
    with NatsCluster(tmp_path) as nats:
        nats.members[0].start()
        with bus_call_failed("ensure stream") as failed:
            async with await Bus.connect(nats.urls, name="forming", tls=creds()) as bus:
                ensuring = asyncio.create_task(bus.ensure_streams(*ALL_STREAMS))
                noticed = asyncio.create_task(failed.wait())
                await asyncio.wait({ensuring, noticed}, return_when=asyncio.FIRST_COMPLETED)
                noticed.cancel()
                assert failed.is_set() and not ensuring.done(), "the first call did not meet an unformed cluster"
                for member in nats.members[1:]:
                    member.start()
                await ensuring
                for spec in ALL_STREAMS:
                    assert (await bus.js.stream_info(spec.name)).config.num_replicas == 3, spec.name


async def test_streams_wait_for_enough_servers_to_place_their_replicas(tmp_path: Path) -> None:
    """Two servers of three elect a JetStream leader but cannot place three replicas ("no suitable
    peers for placement") until the third joins: ensure_streams waits for it."""
    with NatsCluster(tmp_path) as nats:
        for member in nats.members[:2]:
            member.start()
        with bus_call_failed("ensure stream") as failed:
            bus = await _connect(nats.urls, "placing")  # JetStream answers: a leader is elected
            async with bus:
                ensuring = asyncio.create_task(bus.ensure_streams(K8S_STREAM))
                noticed = asyncio.create_task(failed.wait())
                await asyncio.wait({ensuring, noticed}, return_when=asyncio.FIRST_COMPLETED)
                noticed.cancel()
                assert failed.is_set() and not ensuring.done(), f"not waiting: {ensuring}"
                nats.members[2].start()
                await ensuring
                assert (await bus.js.stream_info(K8S_STREAM.name)).config.num_replicas == 3


async def test_a_cluster_that_never_forms_fails_clearly_after_the_patience(tmp_path: Path) -> None:
    with NatsCluster(tmp_path) as nats:
        nats.members[0].start()
        async with await Bus.connect(nats.urls, name="alone", tls=creds(), patience=0.5) as bus:
            with pytest.raises(StartupError) as failure:
                await bus.ensure_streams(K8S_STREAM)
        message = str(failure.value)
        assert "'ensure stream' (stream PALISADE_K8S)" in message
        assert "have formed it" in message


async def test_a_single_server_keeps_one_replica(nats_server: NatsServer) -> None:
    async with await Bus.connect([nats_server.url], name="single", tls=creds()) as bus:
        await bus.ensure_stream(K8S_STREAM)
        assert (await bus.js.stream_info(K8S_STREAM.name)).config.num_replicas == 1


async def test_losing_any_one_server_loses_no_message(nats_cluster: NatsCluster) -> None:
    publisher = await _connect(nats_cluster.urls, "publisher")
    follower = await _connect(list(reversed(nats_cluster.urls)), "follower")
    got: list[str] = []
    try:
        await publisher.retry("ensure streams", lambda: publisher.ensure_stream(K8S_STREAM))

        async def on_delta(subject: str, delta: k8s_pb2.K8sDelta) -> None:
            got.append(delta.name)

        await follower.follow(k8s_filter("pod"), k8s_pb2.K8sDelta, on_delta)

        async def publish(i: int) -> None:
            delta = k8s_pb2.K8sDelta(namespace="ns", name=f"m{i}")
            await publisher.publish(k8s_subject("pod", "ns", f"p{i}"), delta)

        for i in range(50):
            await publish(i)
        # kill -9 the server that holds the follower's consumer (the worst one to lose for it):
        # the publisher fails over if it was connected there, the follower re-creates its consumer.
        (follower_sub,) = [f for f in follower._followers]
        info = await follower_sub._sub.consumer_info()
        host = info.cluster.leader if info.cluster else None
        victim = next(m for m in nats_cluster.members if m.cluster and m.cluster.server_name == host)
        victim.stop(kill=True)
        for i in range(50, 100):
            await publish(i)
        for _ in range(600):
            if len(got) >= 100:
                break
            await asyncio.sleep(0.05)
        assert got == [f"m{i}" for i in range(100)]
    finally:
        await publisher.close()
        await follower.close()
