"""The plugin executable (services/cni/shim.c): what it does itself, and what it hands to the Python plugin.

With a datapath answering, every command is answered by the datapath running the plugin's code,
so a copy of the executable with no Python plugin beside it does them all. What the datapath
cannot be made to do on cue (answer "handoff", die in the middle of a call) is played by a peer
on a socket of the test's own that speaks the framed protocol and records what it was sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from palisade.v1 import datapath_pb2
from services.cni import spec
from services.cni.spec import plugin_socket
from services.common.grpcserver import ErrorInterceptor
from services.datapath.pluginapi import CNI_CALLS, PluginApi
from testkit.ipam import eventually
from tests.cni.test_plugin import PLUGIN, cni, conf, endpoints, netns
from tests.datapath_service.agent import InProcessAgent

__all__ = ["netns"]


@pytest.fixture
def alone(tmp_path: Path) -> Path:
    """The executable with no Python plugin beside it: anything it hands over fails loudly."""
    (tmp_path / "bin").mkdir()
    return Path(shutil.copy2(PLUGIN, tmp_path / "bin" / "palisade"))


#: An environment in which no Python interpreter starts (it finds no standard library).
NO_PYTHON = {"PYTHONHOME": "/nonexistent"}


@pytest.mark.root
async def test_with_the_datapath_answering_every_command_needs_no_python(
    agent: InProcessAgent, netns: str, alone: Path
) -> None:
    code, out = await cni("ADD", conf(agent), netns=netns, plugin=alone, **NO_PYTHON)
    assert code == 0, out
    assert (out["interfaces"][1]["name"], out["interfaces"][1]["sandbox"]) == ("eth0", netns)
    assert list(endpoints(agent)) == ["c1"]
    code, out = await cni("CHECK", conf(agent, prevResult=out), netns=netns, plugin=alone, **NO_PYTHON)
    assert (code, out) == (0, {})
    assert (await cni("STATUS", conf(agent, "1.1.0"), plugin=alone, **NO_PYTHON)) == (0, {})
    valid = {"cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]}
    assert (await cni("GC", conf(agent, "1.1.0", **valid), plugin=alone, **NO_PYTHON)) == (0, {})
    assert list(endpoints(agent)) == ["c1"]
    # The plugin's own errors come from the datapath's run of its code, in the configuration's version.
    chained = conf(agent, "0.4.0", prevResult={"interfaces": [{"name": "eth0", "sandbox": netns}]})
    code, out = await cni("ADD", chained, netns=netns, plugin=alone, **NO_PYTHON)
    assert code == 1 and out["code"] == 7 and "host-side" in out["msg"] and out["cniVersion"] == "0.4.0", out
    code, out = await cni("ADD", conf(agent, timeout=-1), netns=netns, plugin=alone, **NO_PYTHON)
    assert code == 1 and out["code"] == 7 and "timeout" in out["msg"], out
    code, out = await cni("ADD", conf(agent), netns=netns, plugin=alone, CNI_ARGS="IgnoreUnknown=1", **NO_PYTHON)
    assert code == 1 and out["code"] == 4 and "K8S_POD_NAME" in out["msg"], out
    assert (await cni("DEL", conf(agent), netns=netns, plugin=alone, **NO_PYTHON)) == (0, {})
    assert endpoints(agent) == {}


@pytest.mark.root
async def test_what_it_cannot_hand_over_is_a_clear_error_object(agent: InProcessAgent, alone: Path) -> None:
    # No datapath on this socket: the Python plugin's to wait for; it is not there.
    config = {**conf(agent, "0.4.0"), "socket": str(alone.parent / "nowhere" / "cni.sock")}
    code, out = await cni("DEL", config, plugin=alone)
    assert code == 1 and out["code"] == 5 and out["cniVersion"] == "0.4.0", out
    assert "cannot run its Python plugin" in out["msg"] and out["details"] == f"{alone}-python"


@pytest.mark.root
async def test_it_finds_the_socket_past_any_json_and_hands_over_what_it_does_not_read(
    agent: InProcessAgent, netns: str, alone: Path
) -> None:
    # Nested values holding braces, brackets, quotes and a "socket" of their own come first.
    tricky = {"args": {"socket": "/not/this.sock", "x": '}"{', "y": [1, {"z": "]"}, [], {}]}, "dns": {}}
    config = json.dumps({**tricky, **conf(agent)}, indent=2).encode()
    code, out = await cni("ADD", config, netns=netns, plugin=alone, **NO_PYTHON)
    assert code == 0, out
    assert (await cni("DEL", config, netns=netns, plugin=alone, **NO_PYTHON)) == (0, {})
    # A key written with an escape may be "socket": that is the Python plugin's to read, never a guess.
    escaped = json.dumps(conf(agent)).replace('"socket"', '"\\u0073ocket"').encode()
    assert json.loads(escaped)["socket"] == agent.config.cni_socket_path
    code, out = await cni("ADD", escaped, netns=netns, plugin=alone)
    assert code == 1 and out["code"] == 5 and "cannot run its Python plugin" in out["msg"], out
    assert (await cni("ADD", escaped, netns=netns))[0] == 0  # which reads it
    assert list(endpoints(agent)) == ["c1"]


@pytest.mark.root
async def test_the_socket_refuses_a_malformed_call_and_keeps_serving(agent: InProcessAgent, netns: str) -> None:
    path = plugin_socket(agent.config.cni_socket_path)
    for request in (
        b"PALISADE-CNI 1 many\n",
        b"PALISADE-CNI 1 5 99999999999\n",
        b"PALISADE-CNI 1 40 40\nCNI_COMMAND=ADD\0",  # shorter than it said, then closed
    ):
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(request)
        writer.write_eof()
        assert await reader.read() == b"", request  # closed without doing anything
        writer.close()
    assert endpoints(agent) == {}
    code, out = await cni("ADD", conf(agent), netns=netns)
    assert code == 0, out


class Peer:
    """A datapath's plugin socket played by a thread: each connection gets the next answer (bytes
    written, then closed; None: closed without a word). Records the framed calls it was sent."""

    def __init__(self, directory: Path, answers: list[bytes | None]) -> None:
        self.node_socket = str(directory / "cni.sock")
        self.answers = answers
        self.calls: list[tuple[dict[str, str], bytes]] = []
        self.connections = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(plugin_socket(self.node_socket))
        self._listener.listen(8)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                stream = conn.makefile("rb")
                line = stream.readline()
                if line.startswith(b"PALISADE-CNI 1 "):
                    env_len, stdin_len = (int(n) for n in line.split()[2:])
                    env = dict(e.decode().partition("=")[::2] for e in stream.read(env_len).split(b"\0") if e)
                    self.calls.append((env, stream.read(stdin_len)))
                answer = self.answers[min(self.connections, len(self.answers) - 1)]
                self.connections += 1
                if answer is not None:
                    conn.sendall(answer)
                conn.shutdown(socket.SHUT_RDWR)  # the file object keeps the socket open past close()
                stream.close()

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        self._listener.close()
        self._thread.join(5)


@pytest.fixture
def peer(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Peer]:
    p = Peer(tmp_path, list(request.param))
    yield p
    p.close()


def peer_conf(peer: Peer, version: str = "1.0.0") -> dict[str, Any]:
    return {"cniVersion": version, "name": "k8s-pod-network", "type": "palisade", "socket": peer.node_socket,
            "timeout": 1}  # fmt: skip


def queued(peer: Peer, container_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (Path(peer.node_socket).parent / "delete-queue" / f"{container_id}.json").read_text()
    )
    return data


@pytest.mark.parametrize("peer", [[b"handoff\n", None]], indirect=True)
async def test_a_handoff_runs_the_python_plugin_with_the_same_call(peer: Peer) -> None:
    config = json.dumps(peer_conf(peer), indent=1).encode()  # as written, newlines and all
    code, out = await cni("DEL", config, netns="/run/netns/gone", cid="c7")
    assert (code, out) == (0, {})
    # The call went over as it came: every CNI_* variable, nothing else, stdin byte for byte.
    ((env, stdin),) = peer.calls
    assert stdin == config
    assert env["CNI_COMMAND"] == "DEL" and env["CNI_CONTAINERID"] == "c7" and env["CNI_NETNS"] == "/run/netns/gone"
    assert "K8S_POD_NAME=web" in env["CNI_ARGS"] and all(k.startswith("CNI_") for k in env)
    # The Python plugin met a datapath that closed without answering: the deletion is queued.
    assert peer.connections >= 2
    assert queued(peer, "c7")["container_id"] == "c7"


@pytest.mark.parametrize("peer", [[None], [b"exit 0 999\n{}"], [b"exit zero 2\n{}"]], indirect=True)
async def test_a_datapath_lost_during_a_call_is_try_again_for_add_and_queued_for_del(peer: Peer) -> None:
    code, out = await cni("ADD", peer_conf(peer, "0.4.0"), netns="/run/netns/any")
    assert code == 1 and out["code"] == 11 and out["cniVersion"] == "0.4.0", out
    assert "stopped answering" in out["msg"]
    assert peer.connections == 1, "an ADD that may have been done is not repeated: the runtime retries it"
    code, out = await cni("DEL", peer_conf(peer), cid="c8")
    assert (code, out) == (0, {})
    assert queued(peer, "c8")["container_id"] == "c8"


ERROR = b'{"cniVersion": "0.3.1", "code": 101, "msg": "x"}\n'


@pytest.mark.parametrize("peer", [[b"exit 1 %d\n%s" % (len(ERROR), ERROR)]], indirect=True)
async def test_the_answer_is_written_as_it_came_with_its_exit_status(peer: Peer) -> None:
    code, out = await cni("CHECK", peer_conf(peer), netns="/run/netns/any")
    assert (code, out) == (1, json.loads(ERROR))
    assert peer.connections == 1


def test_the_executable_and_the_plugin_agree_on_the_default_socket_and_the_plugin_socket() -> None:
    """The two constants the C program repeats from services/cni/spec.py."""
    source = (Path(__file__).parents[2] / "services" / "cni" / "shim.c").read_text()
    defines = dict(re.findall(r'^#define (\w+) "([^"]*)"$', source, re.MULTILINE))
    assert defines["DEFAULT_SOCKET"] == spec.DEFAULT_SOCKET
    assert defines["PLUGIN_SOCKET"] == spec.PLUGIN_SOCKET


class _HeldServicer:
    """A datapath servicer whose DeleteEndpoint waits until released, counting the calls in it."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.release = asyncio.Event()

    async def DeleteEndpoint(self, request: Any, context: Any) -> datapath_pb2.DeleteEndpointResponse:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        return datapath_pb2.DeleteEndpointResponse()

    CreateEndpoint = ListEndpoints = DeleteEndpoint


@pytest.mark.root
async def test_a_burst_of_calls_runs_at_most_cni_calls_at_once_and_the_rest_wait_their_turn(tmp_path: Path) -> None:
    held = _HeldServicer()
    node_socket = str(tmp_path / "cni.sock")
    api = PluginApi(held, ErrorInterceptor(), plugin_socket(node_socket))  # type: ignore[arg-type]
    await api.start()
    try:
        config = {"cniVersion": "1.0.0", "name": "burst", "type": "palisade", "socket": node_socket, "timeout": 30}
        calls = 3 * CNI_CALLS
        burst = [asyncio.create_task(cni("DEL", config, cid=f"c{i}", **NO_PYTHON)) for i in range(calls)]
        # Every call has reached the socket: CNI_CALLS in the datapath's code, the rest queued.
        await eventually(lambda: held.in_flight == CNI_CALLS and api.queued == calls - CNI_CALLS)
        assert held.peak == CNI_CALLS
        held.release.set()
        assert [code for code, _ in await asyncio.gather(*burst)] == [0] * calls
        assert held.peak == CNI_CALLS and api.queued == 0
    finally:
        await api.stop()
