"""`palisade install` / `uninstall` as far as a machine without a cluster allows: what they would
apply (validated like the manifests), their steps, and the node-side uninstall on folders standing
for a node's /etc/cni/net.d and /opt/cni/bin.

Not tested here (no API server, no kubelet): kubectl applying and deleting, the DaemonSets running
on real nodes, and `kubectl rollout status` waiting for them.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from services.cli import install
from services.cni.install import CONFLIST, PLUGIN
from testkit.harness import ROOT, is_root
from tests.deploy.test_kubernetes import CILIUM_KINDS, KUBERNETES_VERSIONS, _errors

Obj = dict[str, Any]


def palisade(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _dry_run(tmp_path: Path, *extra: str) -> list[Obj]:
    out = palisade("install", "--dry-run", "-o", "yaml", "--tls-dir", str(tmp_path / "tls"), *extra)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _validate(objects: list[Obj]) -> list[str]:
    problems = []
    for obj in objects:
        if obj["kind"] in CILIUM_KINDS:
            problems += [f"{obj['metadata']['name']}: {e}" for e in _errors(obj)]
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{version} {obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    return problems


def _named(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _pod(objects: list[Obj], kind: str, name: str) -> Obj:
    spec: Obj = _named(objects, kind, name)["spec"]["template"]["spec"]
    return spec


def test_install_dry_run_prints_every_object_valid_namespace_and_crds_first(tmp_path: Path) -> None:
    objects = _dry_run(tmp_path)
    assert _validate(objects) == []
    kinds = [o["kind"] for o in objects]
    assert kinds[0] == "Namespace" and kinds[1:3] == ["CustomResourceDefinition"] * 2
    # Everything of deploy/kubernetes is there, plus one Secret per component.
    expected = {(o["kind"], o["metadata"]["name"]) for o in install.load_kustomization(install.MANIFESTS)}
    assert expected <= {(o["kind"], o["metadata"]["name"]) for o in objects}
    secrets_ = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    assert set(secrets_) == {f"palisade-tls-{c}" for c in install.CLUSTER_COMPONENTS}


def test_each_secret_holds_its_components_key_and_never_the_cas(tmp_path: Path) -> None:
    objects = _dry_run(tmp_path)
    tls = tmp_path / "tls"
    for component in install.CLUSTER_COMPONENTS:
        secret = _named(objects, "Secret", f"palisade-tls-{component}")
        assert secret["metadata"]["namespace"] == install.NAMESPACE
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        assert set(data) == {"ca.crt", f"{component}.crt", f"{component}.key"}
        assert data[f"{component}.key"] == (tls / f"{component}.key").read_bytes()
        # What each workload mounts is this Secret.
    ca_key = (tls / "ca.key").read_bytes()
    assert all(base64.b64encode(ca_key).decode() not in json.dumps(o) for o in objects)
    # A second run keeps the installation (same CA): re-applying does not break running components.
    again = _dry_run(tmp_path)
    assert (
        _named(again, "Secret", "palisade-tls-nats")["data"] == _named(objects, "Secret", "palisade-tls-nats")["data"]
    )


@pytest.mark.parametrize("mode", install.MODES)
def test_the_mode_reaches_the_cni_installer(tmp_path: Path, mode: str) -> None:
    objects = _dry_run(tmp_path, "--mode", mode)
    init = _pod(objects, "DaemonSet", "palisade-datapath")["initContainers"][0]
    assert {"name": "PALISADE_CNI_MODE", "value": mode} in init["env"]


def test_another_service_range_moves_every_fixed_address_and_its_aliases(tmp_path: Path) -> None:
    objects = _dry_run(tmp_path, "--service-cidr", "10.43.0.0/16", "--image", "registry.example/palisade:9")
    assert _validate(objects) == []
    fixed = {o["metadata"]["name"]: o["spec"].get("clusterIP") for o in objects if o["kind"] == "Service"}
    assert _named(objects, "Service", "palisade-policy")["spec"]["clusterIP"] == "10.43.0.208"
    addresses = {ip for name, ip in fixed.items() if name in install.STATIC_SERVICES}
    assert addresses == set(install.static_cluster_ips("10.43.0.0/16").values())
    for workload in [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]:
        pod = workload["spec"]["template"]["spec"]
        assert {a["ip"] for a in pod.get("hostAliases", [])} <= addresses, workload["metadata"]["name"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            if "palisade" in container["image"]:
                assert container["image"] == "registry.example/palisade:9"


def test_a_service_range_too_small_is_refused_with_the_reason(tmp_path: Path) -> None:
    out = palisade("install", "--dry-run", "--tls-dir", str(tmp_path / "tls"), "--service-cidr", "10.43.0.0/24")
    assert out.returncode == 2
    assert "too small" in out.stderr and "/20" in out.stderr


def test_install_without_kubectl_says_so(tmp_path: Path) -> None:
    out = palisade("install", "--tls-dir", str(tmp_path / "tls"), "--kubectl", str(tmp_path / "no-kubectl"))
    assert out.returncode == 2 and "not found" in out.stderr


def test_install_plan_applies_the_crds_and_waits_for_them_before_the_policies(tmp_path: Path) -> None:
    out = palisade("install", "--dry-run", "--tls-dir", str(tmp_path / "tls"))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line[:1].isdigit()]
    assert "namespace and the CRDs" in lines[0] and "wait --for=condition=Established" in lines[1]
    assert "--server-side" in lines[2]  # Secrets are not copied into a last-applied annotation
    skipped = palisade("install", "--dry-run", "-o", "yaml", "--skip-crds", "--tls-dir", str(tmp_path / "tls"))
    assert "CustomResourceDefinition" not in skipped.stdout


def test_uninstall_plan_cleans_the_nodes_before_deleting_and_keeps_the_crds() -> None:
    out = palisade("uninstall", "--dry-run")
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line[:1].isdigit()]
    assert "delete daemonset/palisade-datapath" in steps[0]
    assert (
        "DaemonSet/palisade-node-cleanup" in out.stdout and "rollout status daemonset/palisade-node-cleanup" in steps[2]
    )
    assert "delete" in steps[3] and len(steps) == 4, "the CRDs stay"
    assert "CustomResourceDefinition" not in out.stdout
    with_crds = palisade("uninstall", "--dry-run", "--delete-crds")
    assert "crd/ciliumnetworkpolicies.cilium.io" in with_crds.stdout.splitlines()[-1]
    cleanup = [doc for doc in yaml.safe_load_all(palisade("uninstall", "--dry-run", "-o", "yaml").stdout) if doc]
    assert _validate(cleanup) == []
    (init,) = _pod(cleanup, "DaemonSet", "palisade-node-cleanup")["initContainers"]
    assert init["command"][:4] == ["python", "-m", "services.cni.install", "--uninstall"]
    assert "--bpffs" in init["command"] and "--state-dir" in init["command"]


# ---------------------------------------------------------------------------
# the node side: the installer's uninstall on folders standing for a node


def _installer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cni.install", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def _node(tmp_path: Path) -> list[str]:
    for d in ("net.d", "bin", "runtime"):
        (tmp_path / d).mkdir(exist_ok=True)
    return ["--conf-dir", str(tmp_path / "net.d"), "--bin-dir", str(tmp_path / "bin"),
            "--runtime-dir", str(tmp_path / "runtime" / "palisade-cni")]  # fmt: skip


KINDNET = {"cniVersion": "0.3.1", "name": "kindnet", "plugins": [{"type": "ptp"}, {"type": "portmap"}]}


@pytest.mark.parametrize("chained", [False, True])
def test_the_node_uninstall_removes_the_conflist_and_plugin_and_leaves_the_nodes_own(
    tmp_path: Path, chained: bool
) -> None:
    node = _node(tmp_path)
    theirs = tmp_path / "net.d" / "10-kindnet.conflist"
    if chained:
        theirs.write_text(json.dumps(KINDNET))
    (tmp_path / "bin" / "ptp").write_text("#!/bin/sh\n")
    (tmp_path / "runtime" / "palisade-cni").mkdir()
    assert _installer(*node, "--no-runtime", *(["--chain"] if chained else [])).returncode == 0
    assert (tmp_path / "net.d" / CONFLIST).is_file() and (tmp_path / "bin" / PLUGIN).is_file()

    out = _installer(*node, "--uninstall")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "net.d").iterdir()) == (["10-kindnet.conflist"] if chained else [])
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["ptp"]
    assert not (tmp_path / "runtime" / "palisade-cni").exists()
    if chained:
        assert json.loads(theirs.read_text()) == KINDNET, "the cluster's own plugin is as it was"
    # Running it again (a node cleaned twice, or never installed) is fine.
    assert _installer(*node, "--uninstall").returncode == 0


@pytest.mark.skipif(not is_root(), reason="needs root (the BPF file system)")
def test_the_node_uninstall_removes_the_datapaths_pins_and_state(tmp_path: Path) -> None:
    from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap

    bpffs = f"/sys/fs/bpf/palisade-uninstall-{secrets.token_hex(3)}"
    os.makedirs(bpffs)
    pinned = PinnedMap.open_or_create(bpffs, MapSpec("probe", MapType.HASH, 4, 4, 4))
    pinned.close()
    state = tmp_path / "state"
    (state / "endpoints").mkdir(parents=True)
    out = _installer(*_node(tmp_path), "--uninstall", "--bpffs", bpffs, "--state-dir", str(state))
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(bpffs) and not state.exists()
    assert "datapath programs detached and maps removed" in out.stdout


RECORDING_KUBECTL = """#!/bin/sh
# Stands for the cluster: records each call and the objects it was given.
n=$(ls {log} | grep -c args)
echo "$*" > {log}/$n.args
cat > {log}/$n.stdin
"""


def _calls(log: Path) -> list[tuple[str, list[Obj]]]:
    out = []
    for n in range(len(list(log.glob("*.args")))):
        objects = [doc for doc in yaml.safe_load_all((log / f"{n}.stdin").read_text()) if doc]
        out.append(((log / f"{n}.args").read_text().strip(), objects))
    return out


def _recording_kubectl(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls"
    log.mkdir()
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(RECORDING_KUBECTL.format(log=log))
    kubectl.chmod(0o755)
    return kubectl, log


def test_install_applies_the_crds_then_waits_then_the_rest(tmp_path: Path) -> None:
    kubectl, log = _recording_kubectl(tmp_path)
    out = palisade("install", "--tls-dir", str(tmp_path / "tls"), "--kubectl", str(kubectl), "--context", "kind-x",
                   "--mode", "chained", "--wait")  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = _calls(log)
    assert [args.split()[1] for args, _ in calls] == ["apply", "wait", "apply", "-n"]
    assert all(args.startswith("--context=kind-x ") for args, _ in calls)
    first, second = calls[0][1], calls[2][1]
    assert [o["kind"] for o in first] == ["Namespace", "CustomResourceDefinition", "CustomResourceDefinition"]
    assert "crd/ciliumnetworkpolicies.cilium.io" in calls[1][0]
    kinds = {o["kind"] for o in second}
    assert {
        "Secret",
        "DaemonSet",
        "CiliumClusterwideNetworkPolicy",
    } <= kinds and "CustomResourceDefinition" not in kinds
    assert "rollout status daemonset/palisade-datapath" in calls[3][0]
    assert "chained" in out.stdout


def test_uninstall_stops_the_datapaths_cleans_the_nodes_then_deletes_the_rest(tmp_path: Path) -> None:
    kubectl, log = _recording_kubectl(tmp_path)
    out = palisade("uninstall", "--kubectl", str(kubectl))
    assert out.returncode == 0, out.stderr
    calls = _calls(log)
    assert "delete daemonset/palisade-datapath" in calls[0][0]
    assert calls[1][0].startswith("apply") and [o["metadata"]["name"] for o in calls[1][1]] == ["palisade-node-cleanup"]
    assert "rollout status daemonset/palisade-node-cleanup" in calls[2][0]
    assert calls[3][0].startswith("delete")
    deleted = calls[3][1]
    assert deleted[-1]["kind"] == "Namespace", "the namespace last: it takes the cleanup DaemonSet with it"
    assert "CustomResourceDefinition" not in {o["kind"] for o in deleted} and len(calls) == 4
    assert "CRDs and your CiliumNetworkPolicies are kept" in out.stdout


def test_a_failing_kubectl_step_stops_the_install_naming_it(tmp_path: Path) -> None:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text("#!/bin/sh\necho 'error: the server could not be reached' >&2\nexit 1\n")
    kubectl.chmod(0o755)
    out = palisade("install", "--tls-dir", str(tmp_path / "tls"), "--kubectl", str(kubectl))
    assert out.returncode == 1
    assert "the server could not be reached" in out.stderr
    assert "failed (the namespace and the CRDs)" in out.stderr and "components" not in out.stderr.split("failed")[1]
