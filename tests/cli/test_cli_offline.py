"""The CLI without a running system: help everywhere, clear errors naming addresses and fields."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.cli.main import build_parser
from testkit.harness import ROOT, free_port

COMMANDS = [
    ["status"],
    ["policy", "import"],
    ["policy", "delete"],
    ["policy", "get"],
    ["policy", "wait"],
    ["policy", "trace"],
    ["identity", "list"],
    ["identity", "get"],
    ["endpoint", "list"],
    ["endpoint", "get"],
    ["bpf", "policy", "get"],
    ["fqdn", "cache", "list"],
    ["fqdn", "names"],
    ["observe"],
    ["analyze"],
    ["connectivity", "probe"],
    ["tls", "init"],
]


def palisade(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command: list[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([*command, "--help"])
    assert exc.value.code == 0


@pytest.mark.parametrize(
    ("args", "service"),
    [
        (["policy", "get", "--policy-address", "{addr}"], "policy"),
        (["identity", "list", "--ipam-address", "{addr}"], "ipam"),
        (["endpoint", "list", "--datapath-address", "{addr}"], "datapath"),
        (["bpf", "policy", "get", "1", "--datapath-address", "{addr}"], "datapath"),
    ],
)
def test_unreachable_service_names_address_and_how_to_start(args: list[str], service: str) -> None:
    addr = f"127.0.0.1:{free_port()}"
    result = palisade(*[a.format(addr=addr) for a in args])
    assert result.returncode == 1
    assert addr in result.stderr
    assert "make run" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_reports_each_unreachable_service_and_fails() -> None:
    ports = {name: free_port() for name in ("watcher", "policy", "ipam", "datapath")}
    args = ["status", "-o", "json"]
    for name, port in ports.items():
        args += [f"--{name}-address", f"127.0.0.1:{port}"]
    result = palisade(*args)
    assert result.returncode == 1
    import json

    services = {s["service"]: s for s in json.loads(result.stdout)["services"]}
    assert set(services) == set(ports)
    assert all(s["health"] == "unreachable" for s in services.values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["endpoint", "get", "not-an-endpoint", "--datapath-address"], "NAMESPACE/POD"),
        (["bpf", "policy", "get", "x/", "--datapath-address"], "NAMESPACE/POD"),
        (["policy", "trace", "--src", "x", "--dst", "y/b", "--policy-address"], "NAMESPACE/NAME"),
        (["policy", "delete", "widget", "p", "--policy-address"], "unknown policy kind"),
        (["policy", "trace", "--src", "x/a", "--policy-address"], "give one of --dst"),
        (
            ["policy", "trace", "--src", "x/a", "--dst", "y/b", "--dns-query", "a.test", "--policy-address"],
            "not --dst and --dns-query",
        ),
        (["policy", "trace", "--src", "x/a", "--to-fqdn", "a.test", "--policy-address"], "write NAME=IP"),
        (
            ["policy", "trace", "--src", "x/a", "--dst", "y/b", "--protocol", "gre", "--policy-address"],
            "unknown protocol",
        ),
    ],
)
def test_bad_arguments_exit_2_before_connecting(args: list[str], message: str) -> None:
    result = palisade(*args, f"127.0.0.1:{free_port()}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_connectivity_probe_bad_input_names_file(tmp_path: object) -> None:
    from pathlib import Path

    bad = Path(str(tmp_path)) / "bad.yaml"
    bad.write_text(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\n"
        "spec:\n  podSelector: {}\n  ingress:\n  - from:\n    - ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}\n"
    )
    result = palisade("connectivity", "probe", "-f", str(bad), "--probe", "80/TCP")
    assert result.returncode == 2
    assert str(bad) in result.stderr and "except" in result.stderr


def test_observe_merges_nodes_histories_in_time_order_and_keeps_the_newest() -> None:
    from google.protobuf.timestamp_pb2 import Timestamp

    from palisade.v1 import datapath_pb2
    from services.cli.observe import merge_history, parse_since

    def ev(node: str, ns: int) -> datapath_pb2.FlowEvent:
        stamp = Timestamp()
        stamp.FromNanoseconds(ns)
        return datapath_pb2.FlowEvent(node=node, time=stamp)

    a = [ev("n1", 1), ev("n1", 4), ev("n1", 6)]
    b = [ev("n2", 2), ev("n2", 3), ev("n2", 7)]
    assert [e.time.ToNanoseconds() for e in merge_history([a, b])] == [1, 2, 3, 4, 6, 7]
    assert [(e.node, e.time.ToNanoseconds()) for e in merge_history([a, b], 2)] == [("n1", 6), ("n2", 7)]
    assert parse_since("90s", 1000.0) == 910 * 10**9
    assert parse_since("2m", 1000.0) == 880 * 10**9
    assert parse_since("1970-01-01T00:00:10Z", 0) == 10 * 10**9
    with pytest.raises(Exception, match="--since 'soon'"):
        parse_since("soon", 0)
