"""The DNS proxy's read-only socket: what the datapath reads is the proxy's view; a socket that
cannot be opened leaves the proxy serving DNS, and the datapath's error names the socket."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from services.datapath.fqdnview import LearnedAddress, NamesView
from services.datapath.namesapi import NamesApi, NamesUnavailable, read_names, socket_path

VIEW = NamesView((LearnedAddress("api.example.test", "192.0.2.1", 1 << 25, 30.0, 1e9, (4,)),), {"*.example.test": (4,)})


async def test_the_datapath_reads_the_proxys_view(tmp_path: Path) -> None:
    path = socket_path(str(tmp_path))
    await asyncio.to_thread(Path(path).write_text, "a killed run's socket")
    async with NamesApi(path, lambda: VIEW):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert await read_names(path) == VIEW
        assert await read_names(path) == VIEW
    assert not await asyncio.to_thread(os.path.exists, path)
    with pytest.raises(NamesUnavailable, match=f"the node's DNS proxy does not answer at {path}"):
        await read_names(path)


async def test_a_socket_that_cannot_be_opened_is_logged_not_fatal(tmp_path: Path) -> None:
    path = str(tmp_path / ("x" * 120) / "dnsproxy.sock")  # over AF_UNIX's 108 bytes
    async with NamesApi(path, lambda: VIEW) as api:
        assert api.path == path
    with pytest.raises(NamesUnavailable, match="does not answer"):
        await read_names(path)


async def test_an_answer_of_another_format_is_named(tmp_path: Path) -> None:
    path = socket_path(str(tmp_path))

    class Other(NamesView):
        def to_json(self) -> dict[str, object]:
            return {"format": 99}

    async with NamesApi(path, Other):
        with pytest.raises(NamesUnavailable, match="run the proxy and the datapath of one version"):
            await read_names(path)
