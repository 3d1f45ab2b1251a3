"""The watcher starts on a NATS cluster whose servers are still forming it (the HA start of `make run`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.common.bus import K8S_STREAM, Bus
from testkit.harness import NatsCluster, bus_call_failed, creds
from tests.watcher.helpers import manifest_source, running


async def test_the_watcher_waits_out_a_forming_cluster_then_publishes(tmp_path: Path, manifests: Path) -> None:
    (manifests / "ns.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n")
    with NatsCluster(tmp_path / "nats") as nats:
        nats.members[0].start()
        with bus_call_failed("ensure stream") as failed:
            async with await Bus.connect(nats.urls, name="watcher", tls=creds()) as bus:
                async with running(bus, manifest_source(manifests)) as run:
                    # Its first stream call meets one server of three: no JetStream leader yet.
                    noticed = asyncio.create_task(failed.wait())
                    await asyncio.wait({run.task, noticed}, return_when=asyncio.FIRST_COMPLETED)
                    noticed.cancel()
                    assert failed.is_set(), f"the watcher stopped: {run.task.exception()!r}"
                    assert not run.task.done()
                    for member in nats.members[1:]:
                        member.start()
                    synced = asyncio.create_task(run.watcher.synced.wait())
                    await asyncio.wait({run.task, synced}, return_when=asyncio.FIRST_COMPLETED)
                    assert run.watcher.synced.is_set(), f"the watcher stopped: {run.task.exception()!r}"
                info = await bus.js.stream_info(K8S_STREAM.name, subjects_filter="palisade.k8s.namespace.>")
                assert info.config.num_replicas == 3 and info.state.subjects
