"""Kubernetes Services in `make run`: ClusterIPs load-balanced in BPF before policy, with real packets.

One stack for the module: the examples (whose story now goes through ClusterIPs) plus two
echo pods and the Services of ``manifests/echo-services.yaml``.
"""

from __future__ import annotations

import errno
import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.datapath.netns import in_netns
from testkit import tuplereuse
from testkit.harness import ROOT
from testkit.stack import Stack, analyze, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    examples = tmp / "examples"
    shutil.copytree(ROOT / "examples", examples)
    shutil.copy(HERE / "manifests" / "echo-services.yaml", examples / "70-echo-services.yaml")
    with running_stack(tmp, examples) as s:
        yield s


class Conn:
    """A TCP connection from inside a pod: the server greets with its pod's name, then echoes."""

    def __init__(self, netns: str, ip: str, port: int) -> None:
        self.sock = in_netns(netns, socket.socket, socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect((ip, port))
        self.server = self._read_line()

    def _read_line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.sock.recv(256)
            if not chunk:
                raise ConnectionResetError("closed")
            data += chunk
        return data.decode().strip()

    def echo(self, text: str = "ping") -> bool:
        try:
            self.sock.sendall(f"{text}\n".encode())
            return self._read_line() == text
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


def greeting(stack: Stack, src: str, service: str, port: int = 80) -> str:
    conn = Conn(stack.netns(src), stack.cluster_ip(service, port), port)
    conn.close()
    return conn.server


def test_service_list_shows_cluster_ips_and_backends_with_named_ports_resolved(stack: Stack) -> None:
    backend_ip = stack.ip("shop/backend")
    stack.cluster_ip("shop/backend", 80)
    frontends = {(f["namespace"], f["name"], f["port"]): f for f in stack.frontends()}
    api = frontends[("shop", "backend", 80)]
    assert api["address"].startswith("10.96.") and api["id"] > 0
    assert [(b["address"], b["port"]) for b in api["backends"]] == [(backend_ip, 8080)]  # targetPort: api
    stats = frontends[("shop", "backend", 9125)]
    assert stats["protocol"] == "PROTOCOL_UDP" and [b["port"] for b in stats["backends"]] == [9125]
    assert frontends[("svc", "empty", 80)].get("backends", []) == []
    text = stack.palisade("service", "list").stdout
    assert "shop/backend:api" in text and "connections refused" in text


def test_the_example_story_through_cluster_ips(stack: Stack) -> None:
    # Policy judges the backend pod and its target port (8080), not the ClusterIP's port 80.
    assert stack.reach_service("shop/frontend", "shop/backend", 80)
    assert not stack.reach_service("tools/debug", "shop/backend", 80)
    assert stack.reach_service("shop/backend", "shop/db", 5432)
    assert not stack.reach_service("shop/frontend", "shop/db", 5432)
    assert not stack.reach_service("tools/debug", "shop/db", 5432)  # the clusterwide deny
    assert stack.reach_service("tools/debug", "shop/frontend", 80)
    assert stack.reach_service("shop/frontend", "shop/backend", 9125, "UDP")


def test_probe_through_cluster_ips_matches_analyze(stack: Stack) -> None:
    files = ["-f", str(HERE / "manifests" / "xyz.yaml")]
    # SCTP too: its ClusterIPs are load-balanced like TCP's and UDP's (raw-socket INIT and INIT-ACK where
    # the kernel has no SCTP, each checked by its receiver's CRC32c after the datapath rewrote the ports).
    probes = [a for p in ("80/TCP", "81/UDP", "82/SCTP") for a in ("--probe", p)]
    expected = analyze(*files, *probes)
    probed = stack.palisade("connectivity", "probe", "--via-services", *files, *probes, "-o", "json", timeout=300)
    assert probed.returncode == 0, probed.stderr
    assert json.loads(probed.stdout) == expected
    # Not trivial: something allowed, something denied (px/b's egress to pod a admits nothing else).
    for probe in expected["probes"]:
        cells = [v for row in probe["matrix"].values() for v in row.values()]
        assert True in cells and False in cells, probe["protocol"]
    # The probe's Services went with it.
    assert wait_for(lambda: not [f for f in stack.frontends() if f["name"].startswith("probe-")])
    assert not list(stack.manifests.glob("zz-connectivity-probe-*"))


def test_a_service_without_backends_refuses_connections_at_once(stack: Stack) -> None:
    ip = stack.cluster_ip("svc/empty", 80)
    with in_netns(stack.netns("tools/debug"), socket.socket, socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        with pytest.raises(OSError) as refused:
            s.connect((ip, 80))
    assert refused.value.errno == errno.ECONNREFUSED  # not a timeout: the connection is answered


def test_client_ip_affinity_keeps_a_client_on_one_backend(stack: Stack) -> None:
    sticky = {greeting(stack, "tools/debug", "svc/sticky") for _ in range(12)}
    assert len(sticky) == 1
    spread: set[str] = set()

    def both_seen() -> bool:
        spread.add(greeting(stack, "tools/debug", "svc/spread"))
        return len(spread) == 2

    assert wait_for(both_seen, 60)
    assert spread == {"svc/echo-1", "svc/echo-2"}


def test_a_backend_removed_during_a_long_connection_ends_it_cleanly(stack: Stack) -> None:
    conn = Conn(stack.netns("tools/debug"), stack.cluster_ip("svc/one", 80), 80)
    path = stack.manifests / "70-echo-services.yaml"
    original = path.read_text()
    try:
        assert conn.server == "svc/echo-1" and conn.echo()
        path.write_text(original.replace("selector: {name: echo-1}", "selector: {name: echo-2}"))
        # The next segment goes to echo-2, which knows no such connection and resets it.
        errors: list[BaseException] = []

        def ended() -> bool:
            try:
                conn.sock.sendall(b"ping\n")
                data = conn.sock.recv(64)
                if not data:
                    errors.append(ConnectionResetError("closed"))
                    return True
            except OSError as exc:
                errors.append(exc)
                return True
            return False

        assert wait_for(ended, 30), "the connection to the removed backend kept going"
        assert isinstance(errors[0], ConnectionResetError), errors  # a reset, not a timeout
        assert wait_for(lambda: greeting(stack, "tools/debug", "svc/one") == "svc/echo-2")
    finally:
        conn.close()
        path.write_text(original)


def test_an_established_connection_through_a_cluster_ip_survives_a_datapath_kill(stack: Stack) -> None:
    before = {(f["name"], f["port"]): f["id"] for f in stack.frontends() if f["namespace"] == "shop"}
    conn = Conn(stack.netns("shop/frontend"), stack.cluster_ip("shop/backend", 80), 80)
    try:
        assert conn.server == "shop/backend" and conn.echo("before")
        old = stack.kill("datapath")
        assert conn.echo("while-down")  # the pinned programs and maps go on without the agent
        stack.serving_again("datapath", old)
        assert conn.echo("after")
        time.sleep(0.5)
        assert conn.echo("later")
        after = {(f["name"], f["port"]): f["id"] for f in stack.frontends() if f["namespace"] == "shop"}
        assert after == before  # every service kept its id (conntrack names it for reverse NAT)
        assert stack.reach_service("shop/frontend", "shop/backend", 80)
    finally:
        conn.close()


def test_one_client_port_reaches_a_backend_by_cluster_ip_and_by_pod_address(stack: Stack) -> None:
    """The two paths to one backend from one bound client port, one after the other and side by
    side, TCP and UDP: not one exchange lost (after DNAT they are one tuple to the backend)."""
    path = stack.manifests / "80-reuse.yaml"
    path.write_text(tuplereuse.manifest("dev-node", "dev-node"))
    try:
        assert wait_for(lambda: stack.palisade("endpoint", "get", "reuse/backend").returncode == 0, 60)
        assert wait_for(lambda: stack.palisade("endpoint", "get", "reuse/client").returncode == 0, 60)
        cluster_ip = stack.cluster_ip("reuse/backend", tuplereuse.FRONT_UDP)
        assert stack.cluster_ip("reuse/backend", tuplereuse.FRONT_TCP) == cluster_ip
        counts = tuplereuse.alternate(stack.netns("reuse/client"), stack.ip("reuse/backend"), cluster_ip)
        assert counts["failed"] == 0 and counts["ok"] > 0, counts
    finally:
        path.unlink()
