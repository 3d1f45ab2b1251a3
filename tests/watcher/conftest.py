"""Fixtures for the watcher tests: a list/watch API server, a bus, a stream reader, a manifest folder."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from nats.js import api as jsapi

from services.common.bus import K8S_STREAM, Bus
from services.common.subjects import k8s_filter
from testkit.apiserver import FakeApiServer
from testkit.harness import NatsServer, creds
from tests.watcher.helpers import StreamReader


@pytest.fixture
async def apiserver() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def kubeconfig(apiserver: FakeApiServer, tmp_path: Path) -> Path:
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_stream(K8S_STREAM)
        yield b


@pytest.fixture
async def reader(bus: Bus) -> AsyncIterator[Callable[[], Awaitable[StreamReader]]]:
    made: list[StreamReader] = []

    async def make() -> StreamReader:
        r = StreamReader()
        r._sub = await bus.js.subscribe(
            k8s_filter(),
            cb=r.on_msg,
            ordered_consumer=True,
            config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL),
        )
        made.append(r)
        return r

    yield make
    for r in made:
        with contextlib.suppress(Exception):
            await r.stop()


@pytest.fixture
def manifests(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "manifests"
    folder.mkdir()
    yield folder
