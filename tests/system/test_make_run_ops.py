"""Operating a running stack as a user would on a cluster: scheduling, the node's CLI, versions,
and the bug-report archive (`palisade sysdump`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import __version__
from testkit.harness import ROOT
from testkit.stack import SERVICES, Stack, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

# Pods of a namespace of their own: a single-node stack's pods are named namespaces of the host.
BASE = """\
apiVersion: v1
kind: Namespace
metadata: {name: opsdemo, labels: {team: ops}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: opsdemo, labels: {app: client}}
spec:
  nodeName: dev-node
  containers: [{name: c, image: busybox}]
"""
UNBOUND_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: unbound
  namespace: opsdemo
  labels: {app: unbound}
spec:
  containers:
    - name: web
      image: nginx
      ports: [{containerPort: 8081, protocol: TCP}]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    examples = tmp_path_factory.mktemp("manifests")
    (examples / "10-base.yaml").write_text(BASE)
    with running_stack(tmp_path_factory.mktemp("stack"), examples) as s:
        yield s


def test_a_pod_without_node_name_is_scheduled_onto_the_single_dev_node(stack: Stack) -> None:
    # As people write them: no spec.nodeName. The dev cluster's scheduler binds it to dev-node.
    (stack.manifests / "90-unbound.yaml").write_text(UNBOUND_POD)

    def created() -> bool:
        return stack.palisade("endpoint", "get", "opsdemo/unbound", "-o", "json").returncode == 0

    assert wait_for(created, 60), "a pod without spec.nodeName was never created on the dev node"
    endpoint = json.loads(stack.palisade("endpoint", "get", "opsdemo/unbound", "-o", "json").stdout)
    assert endpoint["node"] == "dev-node"
    # It is a pod like the others: its identity is its own, and policy reaches it.
    assert stack.reach("opsdemo/client", "opsdemo/unbound", 8081)


POLICY = """\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-in, namespace: opsdemo}
spec:
  podSelector: {matchLabels: {app: client}}
  ingress: [{from: [{podSelector: {}}]}]
"""


def _env(stack: Stack, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PALISADE_TLS_DIR": str(stack.tls_dir)}
    for service in SERVICES:
        env[f"PALISADE_{service.upper()}_ADDRESS"] = stack.address(service)
    return {**env, **extra}


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_version_names_the_cli_and_every_component(stack: Stack) -> None:
    out = _cli(_env(stack), "version", "-o", "json")
    assert out.returncode == 0, out.stderr
    versions = json.loads(out.stdout)["versions"]
    assert [v["component"] for v in versions] == ["cli", *SERVICES]
    assert {v["version"] for v in versions} == {__version__} and not any(v["error"] for v in versions)
    assert next(v for v in versions if v["component"] == "datapath")["node"] == "dev-node"
    table = _cli(_env(stack), "--version")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[1].split() == ["cli", __version__]


def test_sysdump_writes_one_archive_with_every_part_and_no_key(stack: Stack, tmp_path: Path) -> None:
    (stack.manifests / "20-policy.yaml").write_text(POLICY)
    assert wait_for(lambda: "client-in" in stack.palisade("policy", "get").stdout, 60)
    path = tmp_path / "dump.tar.gz"
    out = _cli(_env(stack), "sysdump", "--no-cluster", "--logs-dir", str(stack.run_dir / "logs"),
               "--output-file", str(path))  # fmt: skip
    assert out.returncode == 0, out.stderr
    with tarfile.open(path) as tar:
        files = {m.name.partition("/")[2]: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    node = "nodes/dev-node"
    for part in ("versions.json", "status.json", "policies.json", "identities.json", "allocations.json",
                 f"{node}/status.json", f"{node}/endpoints.json", f"{node}/services.json", f"{node}/maps.json",
                 f"{node}/fqdn.json", "config/processes.json", "errors.json", "README.txt"):  # fmt: skip
        assert part in files, f"no {part} in {sorted(files)}"
    assert json.loads(files["errors.json"]) == {}
    assert set(json.loads(files[f"{node}/fqdn.json"])) == {"cache", "selectors"}, "the DNS proxy's view"
    for service in ("watcher", "policy", "ipam", "datapath"):
        assert f"logs/{service}.log" in files and files[f"logs/{service}.log"].strip(), service
    # Policy revisions, endpoints and their maps, the versions, the configuration.
    policy = next(p for p in json.loads(files["policies.json"])["policies"] if p["ref"]["name"] == "client-in")
    assert int(policy["revision"]) > 0
    endpoints = json.loads(files[f"{node}/endpoints.json"])["endpoints"]
    assert {f"{e['namespace']}/{e['pod']}" for e in endpoints} >= {"opsdemo/client"}
    client = next(m for m in json.loads(files[f"{node}/maps.json"]) if m["pod"] == "opsdemo/client")
    assert client["enforcement"].get("ingress") is True and client["entries"] > 0
    assert {v["version"] for v in json.loads(files["versions.json"])} == {__version__}
    processes = json.loads(files["config/processes.json"])
    assert any("services.policy" in p["argv"] for p in processes)
    # No private key, in any form: the components' keys are on this machine, none is in the archive.
    keys = [p.read_text() for p in stack.tls_dir.glob("*.key")]
    for name, text in files.items():
        assert "PRIVATE KEY" not in text, name
        assert not any(key.strip() in text for key in keys), name


def test_the_cli_in_the_datapaths_container_needs_no_set_up(stack: Stack, tmp_path: Path) -> None:
    """`kubectl exec ds/palisade-datapath -- palisade status`: what the container has is its own
    certificate (no CLI one), the node socket, and the addresses the manifest gives it."""
    node_tls = tmp_path / "tls"
    node_tls.mkdir(mode=0o700)
    for name in ("ca.crt", "datapath.crt", "datapath.key"):
        shutil.copy2(stack.tls_dir / name, node_tls / name)
    socket = stack.run_dir / "datapath" / "cni.sock"
    assert socket.exists()
    env = _env(stack, PALISADE_TLS_DIR=str(node_tls), PALISADE_DATAPATH_ADDRESS=f"unix:{socket}")
    status = _cli(env, "status", "-o", "json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert {s["health"] for s in json.loads(status.stdout)["services"]} == {"SERVING"}
    endpoints = _cli(env, "endpoint", "list", "-o", "json")
    assert endpoints.returncode == 0, endpoints.stderr
    assert "opsdemo/client" in endpoints.stdout or '"pod": "client"' in endpoints.stdout
    policies = _cli(env, "policy", "get")
    assert policies.returncode == 0, policies.stderr
    # Reads only: the node's certificate cannot change policy.
    (tmp_path / "p.yaml").write_text(POLICY.replace("client-in", "from-node"))
    imported = _cli(env, "policy", "import", str(tmp_path / "p.yaml"))
    assert imported.returncode != 0 and "PERMISSION_DENIED" in imported.stderr


FAKE_KUBECTL = """#!/bin/sh
# kubectl for a cluster of one node whose datapath pod is this stack's dev node.
case "$*" in
  *" exec "*) exec {python} -m services.cli.main sysdump --no-cluster --json ;;
  *"get pods -o name"*) echo pod/palisade-datapath-x7k2p ;;
  *" logs "*) echo "a line of $5's log" ;;
  *" get "*) echo "items: []" ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac
"""


def test_sysdump_with_kubectl_collects_every_node_from_its_datapath_pod(stack: Stack, tmp_path: Path) -> None:
    """From an operator's machine that reaches only the API server: every node's parts come from
    `palisade sysdump --json` run in its datapath pod (its node socket, its certificate)."""
    node_tls = tmp_path / "node-tls"
    node_tls.mkdir(mode=0o700)
    for name in ("ca.crt", "datapath.crt", "datapath.key"):
        shutil.copy2(stack.tls_dir / name, node_tls / name)
    socket = stack.run_dir / "datapath" / "cni.sock"
    # In the pod: its own certificate, its node socket, the addresses its manifest gives it.
    pod_env = _env(stack, PALISADE_TLS_DIR=str(node_tls), PALISADE_DATAPATH_ADDRESS=f"unix:{socket}")
    settings = " ".join(f"{k}={v}" for k, v in pod_env.items() if k.startswith("PALISADE_"))
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(python=f"env {settings} {sys.executable}"))
    kubectl.chmod(0o755)
    # This machine reaches no component and holds no certificate.
    outer_env = {k: v for k, v in os.environ.items() if not k.startswith("PALISADE_")}
    for service in SERVICES:
        outer_env[f"PALISADE_{service.upper()}_ADDRESS"] = "127.0.0.1:1"
    outer_env["PALISADE_TLS_DIR"] = str(tmp_path / "none")
    path = tmp_path / "dump.tar.gz"
    out = _cli(outer_env, "sysdump", "--kubectl", str(kubectl), "--output-file", str(path))
    assert out.returncode == 0, out.stderr
    with tarfile.open(path) as tar:
        files = {m.name.partition("/")[2]: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    for part in ("nodes/dev-node/endpoints.json", "nodes/dev-node/maps.json", "logs/palisade-datapath-x7k2p.log",
                 "config/cluster-objects.yaml", "config/processes-palisade-datapath-x7k2p.json"):  # fmt: skip
        assert part in files, f"no {part} in {sorted(files)}"
    # The cluster-wide parts this machine could not reach came from the pod, complete.
    assert {v["version"] for v in json.loads(files["versions.json"])} == {__version__}
    assert "policies.json" in files and "identities.json" in files
    assert "nodes" not in json.loads(files["errors.json"])
