"""Each service process starts against real NATS/etcd, serves health and reflection, and stops cleanly."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from palisade.v1 import common_pb2, common_pb2_grpc
from tests.harness import ROOT, EtcdServer, NatsServer, ServiceProcess, free_port

EXPECTED = {
    "watcher": {"palisade.v1.StatusService"},
    "policy": {"palisade.v1.StatusService", "palisade.v1.PolicyService"},
    "ipam": {"palisade.v1.StatusService", "palisade.v1.IdentityService", "palisade.v1.IPAMService"},
    "datapath": {"palisade.v1.StatusService", "palisade.v1.DatapathService"},
}


def _args(name: str, nats: NatsServer, etcd: EtcdServer, tmp: str) -> list[str]:
    args = ["--nats-url", nats.url, "--etcd-endpoints", etcd.endpoint]
    if name == "watcher":
        args += ["--manifests", tmp]
    if name == "datapath":
        args += ["--state-dir", tmp + "/state", "--bpffs", tmp + "/bpf"]
    return args


def _reflected(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    return names


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_service_serves_health_reflection_and_exits_zero_on_sigterm(
    name: str,
    nats_server: NatsServer,
    etcd_server: EtcdServer,
    service: Callable[..., ServiceProcess],
    tmp_path: object,
) -> None:
    proc = service(name, *_args(name, nats_server, etcd_server, str(tmp_path)))
    names = _reflected(proc.address)
    assert EXPECTED[name] <= names
    assert "grpc.health.v1.Health" in names
    with grpc.insecure_channel(proc.address) as ch:
        status = common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    assert status.service == name
    assert proc.terminate() == 0, proc.logs()


def test_unimplemented_methods_say_so(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], tmp_path: object
) -> None:
    """Methods a later capability fills in answer UNIMPLEMENTED, not fake data."""
    from palisade.v1 import datapath_pb2, datapath_pb2_grpc

    proc = service("datapath", *_args("datapath", nats_server, etcd_server, str(tmp_path)))
    with grpc.insecure_channel(proc.address) as ch:
        stub = datapath_pb2_grpc.DatapathServiceStub(ch)
        try:
            stub.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=5)
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.UNIMPLEMENTED,)
        else:  # implemented by the datapath capability: then it must answer for real
            pass


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
