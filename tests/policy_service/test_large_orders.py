"""Orders above --max-order-bytes travel in chunks, or as fetch orders answered by Resync."""

from __future__ import annotations

from collections.abc import Callable

from testkit import builders
from testkit.harness import NatsServer, ServiceProcess
from testkit.policycluster import Datapath, Feed, OrderLog, eventually, start_policy

FRONT = range(300, 330)


def front_policy(name: str, ports: list[int]) -> dict[str, object]:
    doc = builders.cnp(name, {"tier": "front"}, {"tier": "front"}, ports[0])
    doc["spec"]["ingress"][0]["toPorts"] = [{"ports": [{"port": str(p), "protocol": "TCP"} for p in ports]}]
    return doc


async def test_large_orders_are_chunked_or_fetched_and_applied_whole(
    nats_server: NatsServer, service: Callable[..., ServiceProcess]
) -> None:
    feed = await Feed.open(nats_server)
    log = OrderLog()
    await log.start(feed.bus)
    for i, ident in enumerate(FRONT):
        await feed.identity(ident, tier="front", app=f"w{i}")
        await feed.pod(f"10.0.9.{i + 1}", ident, "n1", f"w{i}")
    await feed.synced()
    proc = await start_policy(service, nats_server, "--max-order-bytes", "4096", "--max-order-chunks", "8")
    dp = Datapath(feed.bus, proc.address, "n1", {})
    await dp.start()

    # 30 identities x 30 peers: about 18 KB of diffs, sent as a handful of chunks.
    await feed.policy(front_policy("one-port", [80]))

    def all_chunks() -> list:  # type: ignore[type-arg]
        chunks = [o for o in log.by_node.get("n1", []) if o.chunks > 1]
        # Chunks are published one by one: wait until the last one is in.
        return chunks if chunks and len(chunks) >= chunks[0].chunks else []

    chunked = await eventually(all_chunks, "every chunk of a chunked order")
    assert all(o.ByteSize() <= 4096 for o in chunked)
    assert len({o.sequence for o in chunked}) == 1 and len(chunked) == chunked[0].chunks
    await eventually(lambda: dp.state.sequence == chunked[0].sequence, "the chunked order applied")
    assert dp.resyncs == 1
    assert len(dp.state.policies) == len(FRONT)
    assert all(len(entries) == len(FRONT) for _, entries in dp.state.policies.values())
    assert await dp.matches_resync()

    # Ten ports each: one identity's diff alone is above the limit, so the datapath must fetch.
    await feed.policy(front_policy("ten-ports", list(range(8000, 8010))))
    fetch = await eventually(lambda: [o for o in log.by_node["n1"] if o.fetch], "a fetch order")
    assert not fetch[0].diffs
    await eventually(lambda: dp.resyncs == 2 and dp.state.sequence >= fetch[0].sequence, "the fetch answered")
    assert all(len(entries) == len(FRONT) * 11 for _, entries in dp.state.policies.values())
    assert await dp.matches_resync()
    await dp.stop()
    await feed.close()
