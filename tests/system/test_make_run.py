"""The whole system as `make run` brings it up: real services, real pods, real packets.

One stack per module (it takes a few seconds to start); every test talks to it the way
a user does, through the `palisade` CLI and the manifest folder.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import ROOT, free_port

pytestmark = [pytest.mark.root, pytest.mark.bcc]

HERE = Path(__file__).resolve().parent
PROBES = ["80/TCP", "81/UDP", "8080/TCP"]


@dataclass
class Stack:
    proc: subprocess.Popen[str]
    manifests: Path
    run_dir: Path
    bpffs: str
    addresses: list[str]
    output: list[str]

    def palisade(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli.main", *args, *self.flags(args[0])],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def flags(self, command: str) -> list[str]:
        wanted = {
            "status": ("watcher", "policy", "ipam", "datapath"),
            "endpoint": ("datapath",),
            "connectivity": ("datapath", "policy"),
            "policy": ("policy",),
        }.get(command, ())
        names = ("watcher", "policy", "ipam", "datapath")
        return [f for n in wanted for f in (f"--{n}-address", self.addresses[names.index(n)])]

    def netns(self, pod: str) -> str:
        out = self.palisade("endpoint", "get", pod, "-o", "json")
        assert out.returncode == 0, out.stderr
        return str(json.loads(out.stdout)["netns"])

    def ip(self, pod: str) -> str:
        out = self.palisade("endpoint", "get", pod, "-o", "json")
        return str(json.loads(out.stdout)["ips"][0])

    def reach(self, src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        target = [{"id": "t", "ip": self.ip(dst), "port": port, "protocol": protocol}]
        out = subprocess.run(
            [sys.executable, "-m", "services.devstack.prober", "--netns", self.netns(src), "--timeout", "1.5"],
            cwd=ROOT,
            input=json.dumps(target),
            capture_output=True,
            text=True,
            check=True,
        )
        return bool(json.loads(out.stdout)["t"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    manifests = tmp / "manifests"
    shutil.copytree(ROOT / "examples", manifests)
    base = free_port()
    while not all(_free(base + i) for i in range(4)):
        base = free_port()
    bpffs = f"/sys/fs/bpf/palisade-e2e-{secrets.token_hex(3)}"
    cmd = [
        sys.executable, "-m", "services.devstack",
        "--manifests", str(manifests),
        "--run-dir", str(tmp / "run"),
        "--bpffs", bpffs,
        "--nats-port", str(free_port()),
        "--etcd-port", str(_free_pair()),
        "--grpc-port-base", str(base),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        if line.startswith("Ctrl-C stops everything"):
            break
    if not any(line.startswith("Palisade is running") for line in output):
        proc.kill()
        pytest.fail("make run did not come up:\n" + "".join(output))
    addresses = [f"127.0.0.1:{base + i}" for i in range(4)]
    s = Stack(proc, manifests, tmp / "run", bpffs, addresses, output)
    try:
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_pair() -> int:
    port = free_port()
    while not (_free(port) and _free(port + 1)):
        port = free_port()
    return port


def wait_for(check: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.3)
    return False


def test_banner_lists_services_and_pods(stack: Stack) -> None:
    text = "".join(stack.output)
    for name in ("nats", "etcd", "watcher", "ipam", "policy", "datapath"):
        assert f"  {name} " in text
    for pod in ("shop/frontend", "shop/backend", "shop/db", "tools/debug"):
        assert pod in text


def test_status_shows_every_service_serving_and_synced(stack: Stack) -> None:
    out = stack.palisade("status", "-o", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    services = {s["service"]: s for s in json.loads(out.stdout)["services"]}
    assert {s["health"] for s in services.values()} == {"SERVING"}
    assert all(s["synced"] for s in services.values())


def test_example_story_is_enforced_with_real_packets(stack: Stack) -> None:
    assert stack.reach("shop/frontend", "shop/backend", 8080)
    assert stack.reach("tools/debug", "shop/frontend", 80)
    assert not stack.reach("tools/debug", "shop/backend", 8080)
    assert stack.reach("shop/backend", "shop/db", 5432)
    assert not stack.reach("shop/frontend", "shop/db", 5432)
    assert not stack.reach("tools/debug", "shop/db", 5432)  # the clusterwide deny


def test_editing_a_policy_file_changes_connectivity(stack: Stack) -> None:
    extra = stack.manifests / "70-debug-to-backend.yaml"
    extra.write_text(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        "metadata: {name: debug-to-backend, namespace: shop}\n"
        "spec:\n  podSelector: {matchLabels: {app: backend}}\n  ingress:\n"
        "  - from: [{namespaceSelector: {matchLabels: {team: tools}}}]\n    ports: [{port: 8080}]\n"
    )
    try:
        assert wait_for(lambda: stack.reach("tools/debug", "shop/backend", 8080))
    finally:
        extra.unlink()
    assert wait_for(lambda: not stack.reach("tools/debug", "shop/backend", 8080))


def test_a_broken_policy_file_leaves_everything_else_enforced(stack: Stack) -> None:
    bad = stack.manifests / "80-broken.yaml"
    bad.write_text("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: x\n")
    try:
        time.sleep(2)
        assert stack.reach("shop/frontend", "shop/backend", 8080)
        assert not stack.reach("tools/debug", "shop/db", 5432)
        out = stack.palisade("status", "-o", "json")
        watcher = next(s for s in json.loads(out.stdout)["services"] if s["service"] == "watcher")
        assert watcher["details"].get("errors") not in (None, "0")
    finally:
        bad.unlink()


def test_connectivity_probe_matches_analyze(stack: Stack) -> None:
    files = ["-f", str(HERE / "manifests" / "xyz.yaml")]
    probes = [a for p in PROBES for a in ("--probe", p)]
    analyzed = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "analyze", *files, *probes, "-o", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    probed = stack.palisade("connectivity", "probe", *files, *probes, "-o", "json")
    assert probed.returncode == 0, probed.stderr
    expected = json.loads(analyzed.stdout)
    assert json.loads(probed.stdout) == expected
    # The matrix is not trivial: something is allowed and something denied.
    cells = [v for p in expected["probes"] for row in p["matrix"].values() for v in row.values()]
    assert True in cells and False in cells
    # And the probe cleaned up after itself.
    listed = stack.palisade("endpoint", "list", "-o", "json")
    pods = {f"{e['namespace']}/{e['pod']}" for e in json.loads(listed.stdout)["endpoints"]}
    assert not any(p.startswith(("px/", "py/")) for p in pods)


def test_zz_ctrl_c_stops_everything_and_leaves_nothing_behind(stack: Stack) -> None:
    # The datapath is gone when the stack stops (killed, or restarted by hand outside it), so the
    # pods' deletions fail: the stack still removes their namespaces, veths, routes and pins itself.
    listed = stack.palisade("endpoint", "list", "-o", "json")
    host_ifnames = [e["host_ifname"] for e in json.loads(listed.stdout)["endpoints"]]
    assert host_ifnames
    pid = next(int(line.split()[-1]) for line in stack.output if line.split()[:1] == ["datapath"])
    os.kill(pid, signal.SIGKILL)
    stack.proc.send_signal(signal.SIGINT)
    rest, _ = stack.proc.communicate(timeout=90)
    assert stack.proc.returncode == 0, rest
    assert "nothing left behind" in rest
    assert not os.path.exists(stack.bpffs)
    assert not stack.run_dir.exists()
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    # This stack's pods (the examples' namespaces and the probe's), not other stacks' on the machine.
    assert not [n for n in netns if n.startswith(("pal_shop_", "pal_tools_", "pal_px_", "pal_py_"))]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in links.splitlines() if any(f"{ep}@" in line for ep in host_ifnames)]
    leftover = subprocess.run(["pgrep", "-f", str(stack.manifests)], capture_output=True, text=True).stdout
    assert leftover.strip() == ""
