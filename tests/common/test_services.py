"""Each service process starts against real NATS/etcd, serves health and reflection, and stops cleanly."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from palisade.v1 import common_pb2, common_pb2_grpc
from testkit.harness import (
    ROOT,
    EtcdServer,
    NatsServer,
    ServiceProcess,
    bcc_problem,
    datapath_flags,
    free_port,
    sync_channel,
)

# With root, a datapath serves on the host beside the others: in turn with the kernel's tests.
pytestmark = pytest.mark.kernel

EXPECTED = {
    "watcher": {"palisade.v1.StatusService"},
    "policy": {"palisade.v1.StatusService", "palisade.v1.PolicyService"},
    "ipam": {"palisade.v1.StatusService", "palisade.v1.IdentityService", "palisade.v1.IPAMService"},
    "datapath": {"palisade.v1.StatusService", "palisade.v1.DatapathService"},
}


def _reflected(address: str, name: str) -> set[str]:
    with sync_channel(address, name) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    return names


def test_whole_system_serves_health_reflection_status_and_exits_zero_on_sigterm(
    nats_server: NatsServer,
    etcd_server: EtcdServer,
    service: Callable[..., ServiceProcess],
    tmp_path: Path,
    bpffs: str,
) -> None:
    """Each service, started in dependency order against real NATS and etcd, reaches SERVING
    (which means synced), lists its services via reflection, and exits 0 on SIGTERM."""
    common = ["--nats-url", nats_server.url, "--etcd-endpoints", etcd_server.endpoint, "--node-name", "n1"]
    (tmp_path / "manifests").mkdir()
    procs = {
        "watcher": service("watcher", *common, "--manifests", str(tmp_path / "manifests")),
        "ipam": service("ipam", *common),
    }
    procs["policy"] = service("policy", *common)
    if bcc_problem() is None:
        procs["datapath"] = service(
            "datapath",
            *common,
            *datapath_flags(procs["policy"].address, procs["ipam"].address, tmp_path / "state", bpffs),
        )
    for name, proc in procs.items():
        names = _reflected(proc.address, name)
        assert EXPECTED[name] <= names, name
        assert "grpc.health.v1.Health" in names
        with sync_channel(proc.address, name) as ch:
            status = common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
        assert status.service == name
        assert status.synced, name
    for name, proc in reversed(procs.items()):
        assert proc.terminate() == 0, f"{name}:\n{proc.logs()[-3000:]}"


def test_unreachable_nats_exits_nonzero_with_one_line_naming_address() -> None:
    port = free_port()
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.policy",
            "--nats-url",
            f"nats://127.0.0.1:{port}",
            "--connect-retries",
            "2",
            "--connect-backoff",
            "0.05",
            "--grpc-listen",
            f"127.0.0.1:{free_port()}",
            "--log-level",
            "error",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


def test_bad_flag_value_exits_2_naming_the_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.ipam", "--connect-retries", "many"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "--connect-retries" in result.stderr
