"""`make run` as the system tests drive it: one stack on free ports, talked to as a user does.

The stack is ``python -m services.devstack`` (what `make run` starts) on its own ports, bpffs
directory and run directory, reading a manifest folder of the test's; tests use the
`palisade` CLI against it, the prober for real packets, and the PIDs its banner lists.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from palisade.v1 import common_pb2, common_pb2_grpc
from services.cli.client import dial_target
from services.common.grpcserver import open_sync_channel
from services.common.trust import Credentials
from testkit.harness import ROOT, free_port

SERVICES = ("watcher", "policy", "ipam", "datapath")
#: The story examples/ tells, as (from pod, to pod, TCP port, whether it connects): the shop's tiers
#: talk in order, the debug pod reaches the frontend only, and nothing but the backend reaches the
#: database (on its named port "pg"; a clusterwide deny keeps tools out).
EXAMPLE_STORY = (
    ("shop/frontend", "shop/backend", 8080, True),
    ("tools/debug", "shop/frontend", 80, True),
    ("tools/debug", "shop/backend", 8080, False),
    ("shop/backend", "shop/db", 5432, True),
    ("shop/frontend", "shop/db", 5432, False),
    ("tools/debug", "shop/db", 5432, False),
)


@dataclass
class Stack:
    proc: subprocess.Popen[str]
    manifests: Path
    run_dir: Path
    bpffs: str
    #: Service -> its address, or its replicas' comma-separated (what the stack wrote for the CLI).
    addresses: dict[str, str]
    output: list[str]

    def address(self, service: str) -> str:
        return str(self.addresses[service])

    def child_address(self, child: str) -> str:
        """The gRPC address of one child ("policy-2"), as the banner lists it."""
        for line in self.output:
            parts = line.split()
            if line.startswith("  ") and len(parts) >= 2 and parts[0] == child:
                return parts[1]
        return self.address(child)

    def status(self) -> dict[str, Any]:
        out = self.palisade("status", "-o", "json", timeout=30)
        assert out.stdout, out.stderr
        return dict(json.loads(out.stdout))

    def policy_revision(self, status: dict[str, Any] | None = None, timeout: float = 30.0) -> int:
        """The policy revision, as the leader reports it (followers report none of their own).

        A leader reports it once it has taken over: after a change of leader this waits for that
        (up to ``timeout``), and returns 0 when no leader is in place by then.
        """
        deadline = time.monotonic() + timeout
        while True:
            rows = (status or self.status())["services"]
            revision = max((int(r.get("revision") or 0) for r in rows if r["service"] == "policy"), default=0)
            if revision or status is not None or time.monotonic() > deadline:
                return revision
            time.sleep(0.2)

    def policy_leader(self) -> str:
        """The policy replica that leads now ("policy-1"), from `palisade status`."""
        leaders = {m["name"] for m in self.status()["members"] if m["group"] == "policy" and m["role"] == "leader"}
        assert len(leaders) == 1, leaders
        return str(leaders.pop())

    @property
    def tls_dir(self) -> Path:
        """The stack's installation (its CA and certificates), made by the stack on start."""
        return self.run_dir / "tls"

    def channel(self, service: str) -> grpc.Channel:
        """A mutual-TLS channel to ``service`` presenting the CLI's certificate, as `palisade` does."""
        return open_sync_channel(dial_target(self.address(service)), service, Credentials.load(self.tls_dir, "cli"))

    @contextlib.contextmanager
    def node_channels(self) -> Iterator[dict[str, grpc.Channel]]:
        """A channel to every node's datapath, by the node it serves (as `palisade` finds them)."""
        with contextlib.ExitStack() as stack:
            out: dict[str, grpc.Channel] = {}
            for target in self.address("datapath").split(","):
                ch = stack.enter_context(
                    open_sync_channel(dial_target(target), "datapath", Credentials.load(self.tls_dir, "cli"))
                )
                status = common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=30)
                out[status.node] = ch
            yield out

    def palisade(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli.main", *args, *self.flags(*args[:2])],
            cwd=ROOT,
            env={**os.environ, "PALISADE_TLS_DIR": str(self.tls_dir), "PALISADE_MANIFESTS": str(self.manifests)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def flags(self, command: str, sub: str = "") -> list[str]:
        if (command, sub) == ("policy", "diff"):
            return [f for n in ("policy", "datapath") for f in (f"--{n}-address", self.address(n))]
        wanted = {
            "observe": ("datapath", "policy"),
            "status": SERVICES,
            "endpoint": ("datapath",),
            "service": ("datapath",),
            "connectivity": ("datapath", "policy", "ipam"),
            "policy": ("policy",),
        }.get(command, ())
        return [f for n in wanted for f in (f"--{n}-address", self.address(n))]

    def pid(self, child: str) -> int:
        """The PID ``child`` (nats, etcd, or a service) runs as now (the stack restarts what dies); 0: none."""
        if child.partition("-")[0] in ("nats", "etcd"):  # "nats", or a cluster's "nats-2"
            marks = [str(self.run_dir / child).encode()]
        else:
            component = child.partition("-")[0]
            marks = [f"services.{component}".encode(), f"--grpc-listen\0{self.child_address(child)}\0".encode()]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if all(m in cmdline for m in marks):
                return int(entry)
        return 0

    def kill(self, child: str) -> int:
        """kill -9 ``child``; returns the PID it had."""
        pid = self.pid(child)
        assert pid, f"{child} is not running"
        os.kill(pid, signal.SIGKILL)
        return pid

    def serving_again(self, child: str, old_pid: int, timeout: float = 60.0) -> None:
        """Wait until the stack restarted ``child`` (a new PID) and `palisade status` shows it synced."""

        def back() -> bool:
            pid = self.pid(child)
            if not pid or pid == old_pid:
                return False
            if child.partition("-")[0] in ("nats", "etcd"):
                return True
            out = self.palisade("status", "-o", "json", timeout=30)
            if out.returncode != 0:
                return False
            rows = {r["address"]: r for r in json.loads(out.stdout)["services"]}
            row = rows.get(self.child_address(child), {})
            return bool(row.get("health") == "SERVING" and row.get("synced"))

        assert wait_for(back, timeout), f"{child} did not come back within {timeout:.0f}s"

    def check_policy_edit(self, timeout: float = 30.0) -> float:
        """Add a policy file that lets tools/debug reach shop/backend:8080, see it enforced with
        real packets, remove it, and see it gone: the system still follows its manifest folder.

        Returns the seconds from the file's write to the first connection the edit let in.
        """
        # Looked up once: each probe is then only a connection attempt (the CLI takes ~0.5 s a call).
        netns, ip = self.netns("tools/debug"), self.ip("shop/backend")
        extra = self.manifests / "70-debug-to-backend.yaml"
        written = time.monotonic()
        extra.write_text(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
            "metadata: {name: debug-to-backend, namespace: shop}\n"
            "spec:\n  podSelector: {matchLabels: {app: backend}}\n  ingress:\n"
            "  - from: [{namespaceSelector: {matchLabels: {team: tools}}}]\n    ports: [{port: 8080}]\n"
        )
        try:
            assert wait_for(lambda: probe(netns, ip, 8080), timeout), "the edit was not enforced"
            enforced = time.monotonic() - written
        finally:
            extra.unlink()
        assert wait_for(lambda: not probe(netns, ip, 8080), timeout), "the removal was not"
        return enforced

    def endpoints(self) -> dict[str, dict[str, Any]]:
        """Every node's endpoints as `palisade endpoint list` gives them, by "namespace/pod"."""
        out = self.palisade("endpoint", "list", "-o", "json")
        assert out.returncode == 0, out.stderr
        return {f"{e['namespace']}/{e['pod']}": e for e in json.loads(out.stdout).get("endpoints", [])}

    def netns(self, pod: str) -> str:
        out = self.palisade("endpoint", "get", pod, "-o", "json")
        assert out.returncode == 0, out.stderr
        return str(json.loads(out.stdout)["netns"])

    def ip(self, pod: str) -> str:
        out = self.palisade("endpoint", "get", pod, "-o", "json")
        return str(json.loads(out.stdout)["ips"][0])

    def reach(self, src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        return probe(self.netns(src), self.ip(dst), port, protocol)

    def story_broken(self) -> list[tuple[str, str, int, bool]]:
        """The connections of :data:`EXAMPLE_STORY` whose real packets do not do as it says (none: it holds)."""
        return [(src, dst, port, want) for src, dst, port, want in EXAMPLE_STORY if self.reach(src, dst, port) != want]

    def interrupt(self) -> str:
        """Ctrl-C the stack as a user ends `make run`: it exits 0 saying it left nothing behind; its last output."""
        self.proc.send_signal(signal.SIGINT)
        rest, _ = self.proc.communicate(timeout=90)
        assert self.proc.returncode == 0, rest
        assert "nothing left behind" in rest
        return rest

    def frontends(self) -> list[dict[str, Any]]:
        """Every node's Service frontends, as `palisade service list` gives them."""
        out = self.palisade("service", "list", "-o", "json")
        assert out.returncode == 0, out.stderr
        return [f for node in json.loads(out.stdout)["nodes"] for f in node.get("frontends", [])]

    def cluster_ip(self, service: str, port: int) -> str:
        """The ClusterIP of NAMESPACE/NAME serving ``port``, once every node serves it."""
        ns, name = service.split("/")
        found: list[str] = []

        def served() -> bool:
            found[:] = [
                f["address"]
                for f in self.frontends()
                if f["namespace"] == ns and f["name"] == name and f.get("port") == port
            ]
            return bool(found)

        assert wait_for(served), f"{service} port {port} is not served"
        return found[0]

    def reach_service(self, src: str, service: str, port: int, protocol: str = "TCP") -> bool:
        return probe(self.netns(src), self.cluster_ip(service, port), port, protocol)


def analyze(*args: str) -> dict[str, Any]:
    """`palisade analyze ARGS -o json` on manifests alone (no cluster): its answer."""
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "analyze", *args, "-o", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def probe(netns: str, ip: str, port: int, protocol: str = "TCP") -> bool:
    """One connection attempt from inside ``netns`` (the prober a pod would run)."""
    return prober(netns, [{"id": "t", "ip": ip, "port": port, "protocol": protocol}])["t"]


def prober(netns: str, targets: list[dict[str, Any]], timeout: float = 1.5, resolver: str = "") -> dict[str, bool]:
    """The dev cluster's prober from inside ``netns``: each target's id (targets as
    ``{"id", "ip", "port", "protocol"}``, or ``"name"`` for ``"ip"``: resolved through ``resolver``
    first), True where a connection got through within ``timeout``."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.devstack.prober",
            "--netns",
            netns,
            "--timeout",
            str(timeout),
            *(("--resolver", resolver) if resolver else ()),
        ],
        cwd=ROOT,
        input=json.dumps(targets),
        capture_output=True,
        text=True,
        check=True,
    )
    return {key: bool(got) for key, got in json.loads(out.stdout).items()}


@contextlib.contextmanager
def pod_server(netns: str, name: str, *ports: str) -> Iterator[subprocess.Popen[str]]:
    """The dev cluster's pod server in ``netns`` (``ports`` as its flags: "--tcp", "80", ...), ready
    when the block starts and stopped when it ends."""
    server = subprocess.Popen(
        [sys.executable, "-m", "services.devstack.podserver", "--netns", netns, "--name", name, *ports],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield server
    finally:
        server.terminate()
        server.wait(10)


@contextlib.contextmanager
def running_stack(tmp: Path, examples: Path | None, *extra: str) -> Iterator[Stack]:
    """A stack on ``tmp``, its manifest folder a copy of ``examples`` (or empty); stopped at the end."""
    manifests = tmp / "manifests"
    if examples is not None:
        shutil.copytree(examples, manifests)
    else:
        manifests.mkdir()
    ha = "--ha" in extra
    # With --ha: 3 NATS servers and their 3 route ports, 3 etcd client/peer pairs, a second ipam.
    # With --ha the second ipam and the second policy replica take the two ports after the datapath's.
    base = free_port(len(SERVICES) + (2 if ha else 0))
    members = 3 if ha else 1
    bpffs = f"/sys/fs/bpf/palisade-e2e-{secrets.token_hex(3)}"
    cmd = [
        sys.executable, "-m", "services.devstack",
        "--manifests", str(manifests),
        "--run-dir", str(tmp / "run"),
        "--bpffs", bpffs,
        "--nats-port", str(free_port(members)),
        "--nats-route-port", str(free_port(members)),
        "--etcd-port", str(free_port(2 * members)),
        "--grpc-port-base", str(base),
        *extra,
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
        raise RuntimeError("make run did not come up:\n" + "".join(output))
    addresses = json.loads((tmp / "run" / "addresses.json").read_text())
    try:
        yield Stack(proc, manifests, tmp / "run", bpffs, addresses, output)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_for(check: Callable[[], object], timeout: float = 30.0) -> bool:
    """Poll ``check`` until it is truthy; False after ``timeout`` (a safety net, not a speed assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.3)
    return False


def assert_clean(counts: dict[str, int]) -> None:
    """What counted traffic must show: no denied connection got in, no allowed one failed, both tried."""
    assert counts["denied_admitted"] == 0, counts
    assert counts["allowed_failed"] == 0, counts
    assert counts["allowed_ok"] > 0 and counts["denied_blocked"] > 0, counts


class Traffic:
    """Counted connections from one pod of a stack while a block runs (see :mod:`tests.system.traffic`)."""

    def __init__(self, stack: Stack, src: str, allowed: list[tuple[str, int]], denied: list[tuple[str, int]]) -> None:
        cmd = [sys.executable, "-m", "tests.system.traffic", "--netns", stack.netns(src)]
        cmd += [a for pod, port in allowed for a in ("--allowed", f"{stack.ip(pod)}:{port}")]
        cmd += [a for pod, port in denied for a in ("--denied", f"{stack.ip(pod)}:{port}")]
        self._proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.counts: dict[str, int] = {}

    def __enter__(self) -> Traffic:
        assert self._proc.stdout is not None
        assert self._proc.stdout.readline().strip() == "ready", "the traffic counter did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._proc.communicate(input="", timeout=30)
        self.counts = json.loads(out)
