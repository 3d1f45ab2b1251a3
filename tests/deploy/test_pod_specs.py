"""deploy/kubernetes run as written: the datapath DaemonSet's pod spec under containerd on a dev node.

A `make run` stack provides the control plane (``--no-datapath --ha``: three NATS and etcd
members, as the StatefulSets run, two policy and ipam replicas and the watcher, on the ports
the manifests' Services give, on the stack's bridge) and one
dev node with no datapath. On that node containerd runs with CRI (tests/deploy/node.py)
and tests/deploy/kubelet.py does kubelet's part with the DaemonSet's pod spec read from
deploy/kubernetes: the image `make image` built, imported under the manifests' name; the
init container (the CNI installer) and then the datapath, with the spec's commands,
environment, security context, host network and volumes (the node's own folders at the
node's paths), the TLS Secret `palisade install` makes, and /etc/hosts from hostAliases.

What stands in for the cluster: kube-proxy (the Services' fixed ClusterIPs that hostAliases
name lead to the stack's control plane: DNAT in the node's network namespace) and the API
server (the stack's manifest folder, where the tests' Pods and policies are written).

Then pods: sandboxes created through containerd with the conflist and plugin the installer
put on the node get endpoints, and a default-deny policy plus one allow decide real
packets between them as `palisade analyze` says.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cri_api.v1 import api_pb2

from services.cli.install import MANIFESTS, load_kustomization, tls_secrets
from services.cni.install import CONFLIST, DEFAULT_SOCKET, PLUGIN
from services.datapath.datapath import teardown_all
from services.devstack import hosts
from testkit.builders import netpol
from testkit.containerd import missing
from testkit.stack import Stack, analyze, pod_server, probe, running_stack, wait_for
from tests.deploy.engine import IMAGE, Engine
from tests.deploy.kubelet import ApiObjects, Kubelet, NodeFacts, Pod, kustomized_image, pod_of
from tests.deploy.manifests import COMPOSE_FILE
from tests.deploy.node import NodeRuntime

pytestmark = [pytest.mark.root, pytest.mark.bcc, pytest.mark.timeout(3600)]

Obj = dict[str, Any]
NODE = "dev-node"
#: The ports the manifests' Services and environments give the control plane.
CONTROL_PLANE_PORTS = ("--nats-port", "4222", "--etcd-port", "9379", "--grpc-port-base", "9401")
CACHE = Path("/var/cache/palisade/k8s")
NS = "podspec"


def workload(kind: str, name: str) -> Obj:
    for obj in load_kustomization(MANIFESTS):
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"deploy/kubernetes has no {kind} {name}")


def kustomization() -> Obj:
    return dict(yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text()))


@pytest.fixture(scope="module")
def archive(engine: Engine, image: str) -> Path:
    """The image as a `docker save` archive, once per image id."""
    return saved(engine, [image], "palisade")


def saved(engine: Engine, images: list[str], stem: str) -> Path:
    """``images`` as one `docker save` archive, kept while their ids stay the same."""
    ids = [engine.run("docker", "image", "inspect", "-f", "{{.Id}}", i).stdout.strip().split(":")[-1] for i in images]
    path = CACHE / f"{stem}-{'-'.join(i[:12] for i in ids)}.tar"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        for old in CACHE.glob(f"{stem}-*.tar"):
            old.unlink()
        engine.run("docker", "save", "-o", f"{path}.tmp", *images, timeout=1200)
        Path(f"{path}.tmp").rename(path)
    return path


def compose_images() -> dict[str, str]:
    """The NATS and etcd images `make image` chose (deploy/compose/.env): local ones where pulls fail."""
    env = COMPOSE_FILE.parent / ".env"
    values = dict(line.split("=", 1) for line in env.read_text().splitlines() if "=" in line and line[0] != "#")
    return {"nats": values["PALISADE_NATS_IMAGE"], "etcd": values["PALISADE_ETCD_IMAGE"]}


@pytest.fixture(scope="module")
def servers_archive(engine: Engine, image: str) -> tuple[Path, dict[str, str]]:
    """The NATS and etcd images, saved; and each one's name."""
    images = compose_images()
    return saved(engine, sorted(images.values()), "servers"), images


@dataclass
class Cluster:
    stack: Stack
    node: NodeRuntime
    host: hosts.NodeHost
    kubelet: Kubelet
    tls: Path

    def secrets(self) -> dict[str, dict[str, bytes]]:
        """The TLS Secrets `palisade install` makes, as the API server would serve them to kubelet."""
        return {
            s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()} for s in tls_secrets(self.tls)
        }


#: The stack's control plane (``--ha``: three NATS and etcd members, as the StatefulSets run) behind
#: each Service of the manifests' hostAliases: Service port -> the member's port on the gateway.
ENDPOINTS = {
    "palisade-nats": (4222, 4222),
    **{f"palisade-nats-{i}": (4222, 4222 + i) for i in range(3)},
    "palisade-etcd": (9379, 9379),
    **{f"palisade-etcd-{i}": (9379, 9379 + 2 * i) for i in range(3)},
    "palisade-policy": (9402, 9402),
    "palisade-ipam": (9403, 9403),
    "palisade-watcher": (9401, 9401),
}


def serve_cluster_ips(netns: str, aliases: list[Obj], gateway: str) -> None:
    """kube-proxy's part, in the node's network namespace: each Service address the hostAliases name
    leads to the stack's member behind it."""
    rules = []
    for alias in aliases:
        (hostname,) = alias["hostnames"]
        port, target = ENDPOINTS[hostname.split(".")[0]]
        rules.append(f"    ip daddr {alias['ip']} tcp dport {port} dnat to {gateway}:{target}")
    chain = "  chain output {\n    type nat hook output priority -100;\n" + "\n".join(rules) + "\n  }\n"
    table = f"table ip kube-proxy-stand-in {{\n{chain}}}\n"
    subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=table, text=True, check=True)


@pytest.fixture(scope="module")
def cluster(
    archive: Path, servers_archive: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    problem = missing()
    if problem:
        pytest.skip(problem)
    tmp = tmp_path_factory.mktemp("podspec")
    with running_stack(tmp, None, "--no-pods", "--no-datapath", "--ha", "--node", NODE, *CONTROL_PLANE_PORTS) as stack:
        network = hosts.plan([NODE], "172.31.255.0/24", hosts.tag_of(stack.run_dir))
        host = network.node(NODE)
        datapath = workload("DaemonSet", "palisade-datapath")
        serve_cluster_ips(host.netns, datapath["spec"]["template"]["spec"]["hostAliases"], network.gateway)
        node = NodeRuntime(tmp / "node", host.netns, Path(f"/sys/fs/bpf/palisade-k8s-{secrets.token_hex(3)}"))
        try:
            node.start()
            images = {
                kustomized_image(c["image"], kustomization())
                for c in datapath["spec"]["template"]["spec"]["initContainers"]
                + datapath["spec"]["template"]["spec"]["containers"]
            }
            node.import_image(archive, IMAGE, sorted(images))
            # NATS and etcd under the names the StatefulSets give (the local images where pulls fail).
            servers, names = servers_archive
            for component in ("nats", "etcd"):
                (container,) = workload("StatefulSet", f"palisade-{component}")["spec"]["template"]["spec"][
                    "containers"
                ]
                node.import_image(servers, names[component], [container["image"]])
            facts = NodeFacts(NODE, host.address, node.host_view, node.on_node)
            kubelet = Kubelet(node.socket, facts, tmp / "pods")
            try:
                yield Cluster(stack, node, host, kubelet, stack.run_dir / "tls")
            finally:
                kubelet.close()
        finally:
            node.stop()
            pins = node.bpffs / "palisade"
            if pins.is_dir():
                teardown_all(str(pins))
            shutil.rmtree(node.bpffs, ignore_errors=True)


def as_written(obj: Obj) -> Obj:
    """A workload with its images as the kustomization names them (what `kubectl apply -k` sends)."""
    images = kustomization()
    spec = obj["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        c["image"] = kustomized_image(c["image"], images)
    return obj


@pytest.fixture(scope="module")
def datapath(cluster: Cluster) -> Pod:
    pod = pod_of(as_written(workload("DaemonSet", "palisade-datapath")), NODE, str(uuid.uuid4()))
    return cluster.kubelet.run(pod, ApiObjects(secrets=cluster.secrets()))


def test_the_installer_puts_the_plugin_and_its_conflist_on_the_node(cluster: Cluster, datapath: Pod) -> None:
    assert datapath.init_exits == {"install-cni": 0}
    assert "palisade-cni installed" in datapath.log("install-cni")
    plugin = cluster.node.host_view("/opt/cni/bin") / PLUGIN
    assert plugin.is_file() and plugin.stat().st_mode & 0o111
    conflist = json.loads((cluster.node.host_view("/etc/cni/net.d") / CONFLIST).read_text())
    assert conflist["plugins"] == [{"type": PLUGIN, "socket": DEFAULT_SOCKET}]
    (runtime,) = cluster.node.host_view("/opt/palisade-cni").iterdir()
    assert (runtime / "python" / "bin").is_dir() and f"/opt/palisade-cni/{runtime.name}/" in plugin.read_text()
    # The launcher runs on the node (outside the image) with the runtime it was given.
    version = subprocess.run(
        ["nsenter", "-t", str(cluster.node.pid), "-m", "-n", "env", "CNI_COMMAND=VERSION", "/opt/cni/bin/palisade"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert version.returncode == 0, version.stdout + version.stderr
    assert "1.0.0" in json.loads(version.stdout)["supportedVersions"]


def test_the_datapath_comes_up_healthy_by_its_own_probes(cluster: Cluster, datapath: Pod) -> None:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        ok, said = cluster.kubelet.wait_probe(datapath, "datapath", kind)
        assert ok, f"{kind}: {said}\n{datapath.log('datapath')[-4000:]}"
    # It serves the node from the host network, on the node's address (the manifest's $(HOST_IP):9404).
    status = cluster.stack.status()
    rows = [r for r in status["services"] if r["service"] == "datapath"]
    assert rows and all(r.get("healthy", True) for r in rows), status
    # Everything it does by default works in the image (masquerade needs nft there).
    assert "masquerade_error" not in json.dumps(rows), rows
    assert cluster.stack.address("datapath") == f"{cluster.host.address}:9404"
    # Its pins are on the node's BPF file system (the bpffs volume), where the manifest says.
    assert (cluster.node.bpffs / "palisade").is_dir()


POLICIES = [
    {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "default-deny", "namespace": NS},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    },
    netpol("server-from-client", {"app": "server"}, {"app": "client"}, 80, NS),
]


def app_pod(name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}, "uid": f"uid-{NS}-{name}"},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "i", "ports": [{"containerPort": 80}]}]},
    }


def test_sandboxes_through_the_installed_conflist_are_enforced(cluster: Cluster, datapath: Pod) -> None:
    ok, said = cluster.kubelet.wait_probe(datapath, "datapath", "startupProbe")
    assert ok, said
    stack = cluster.stack
    names = ("client", "server", "other")
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    (stack.manifests / "podspec.yaml").write_text(
        yaml.safe_dump_all([namespace, *(app_pod(n) for n in names), *POLICIES])
    )
    assert wait_for(lambda: stack.palisade("policy", "get", "networkpolicy", "server-from-client", "-n", NS)
                    .returncode == 0)  # fmt: skip
    pods = {n: cluster.kubelet.sandbox(app_pod(n)) for n in names}
    try:
        eps = stack.endpoints()
        assert set(eps) == {f"{NS}/{n}" for n in names}, eps
        for name, pod in pods.items():
            assert eps[f"{NS}/{name}"]["ips"] == [cluster.kubelet.sandbox_ip(pod)]
        assert wait_for(lambda: 5 not in {e["identity"] for e in stack.endpoints().values()}), stack.endpoints()
        server_netns = cluster.kubelet.sandbox_netns(pods["server"])
        with pod_server(server_netns, "server", "--tcp", "80"):
            matrix = analyze("-f", str(stack.manifests), "--probe", "80/TCP")["probes"][0]["matrix"]
            target = cluster.kubelet.sandbox_ip(pods["server"])
            for src in ("client", "other"):
                want = matrix[f"{NS}/{src}"][f"{NS}/server"]
                netns = cluster.kubelet.sandbox_netns(pods[src])
                assert wait_for(lambda n=netns, w=want: probe(n, target, 80) == w), (src, want)  # type: ignore[misc]
        assert matrix[f"{NS}/client"][f"{NS}/server"] and not matrix[f"{NS}/other"][f"{NS}/server"]
    finally:
        for pod in pods.values():
            cluster.kubelet.remove(pod)
        (stack.manifests / "podspec.yaml").unlink(missing_ok=True)
    assert wait_for(lambda: stack.endpoints() == {}, 30), stack.endpoints()


def test_the_cli_in_the_datapath_container_reaches_every_component(cluster: Cluster, datapath: Pod) -> None:
    """deploy/README's recipe, `kubectl -n palisade-system exec ds/palisade-datapath -- palisade status`
    (and `endpoint list`, `policy get`): the CLI in the running datapath container, with no set-up,
    reaches its node's datapath on the node socket and the control plane through the Services' names
    (the hostAliases, kube-proxy's addresses), each within status's connect timeout."""
    ok, said = cluster.kubelet.wait_probe(datapath, "datapath", "startupProbe")
    assert ok, said
    out = cluster.kubelet.runtime.ExecSync(
        api_pb2.ExecSyncRequest(container_id=datapath.containers["datapath"], cmd=["palisade", "status", "-o", "json"],
                                timeout=60),
        timeout=90,
    )  # fmt: skip
    report = json.loads(out.stdout.decode())
    health = {(s["service"], s["address"]): s["health"] for s in report["services"]}
    assert {name for name, _ in health} == {"watcher", "policy", "ipam", "datapath"}, health
    assert all(state == "SERVING" for state in health.values()), health
    assert ("datapath", f"unix:{DEFAULT_SOCKET}") in health, health
    for name in ("watcher", "policy", "ipam"):
        assert (name, f"palisade-{name}.palisade-system.svc:{ENDPOINTS[f'palisade-{name}'][0]}") in health, health
    assert out.exit_code == 0, out.stdout.decode() + out.stderr.decode()
    # The other two of the recipe answer (exec_in asserts they exit 0): endpoints from the node's
    # datapath, policies from the policy service.
    listed = json.loads(exec_in(cluster, datapath, "datapath", "palisade", "endpoint", "list", "-o", "json"))
    assert "endpoints" in listed, listed
    exec_in(cluster, datapath, "datapath", "palisade", "policy", "get")


# ---------------------------------------------------------------------------
# the control plane's workloads, each on the node as written


def exec_in(cluster: Cluster, pod: Pod, container: str, *command: str) -> str:
    out = cluster.kubelet.runtime.ExecSync(
        api_pb2.ExecSyncRequest(container_id=pod.containers[container], cmd=list(command), timeout=30), timeout=60
    )
    assert out.exit_code == 0, out.stderr.decode()
    return str(out.stdout.decode())


@pytest.mark.parametrize("component", ["policy", "ipam"])
def test_a_control_plane_deployment_runs_as_written_and_passes_its_probes(cluster: Cluster, component: str) -> None:
    """It joins the running control plane (the stack's replicas) through the Services' names: NATS,
    and for ipam etcd (palisade-etcd's Service, with ipam's certificate)."""
    obj = pod_of(as_written(workload("Deployment", f"palisade-{component}")), NODE, str(uuid.uuid4()))
    pod = cluster.kubelet.run(obj, ApiObjects(secrets=cluster.secrets()))
    try:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            ok, said = cluster.kubelet.wait_probe(pod, component, kind)
            assert ok, f"{kind}: {said}\n{pod.log(component)[-4000:]}"
        # Unprivileged (the pod's runAsUser), reading its own key and no other.
        assert exec_in(cluster, pod, component, "id", "-u").strip() == "10001"
        listed = exec_in(cluster, pod, component, "ls", "/etc/palisade/tls").split()
        assert sorted(listed) == sorted(["ca.crt", f"{component}.crt", f"{component}.key"])
        exec_in(cluster, pod, component, "cat", f"/etc/palisade/tls/{component}.key")
    finally:
        cluster.kubelet.remove(pod)


def config_maps() -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: dict(o["data"]) for o in load_kustomization(MANIFESTS) if o["kind"] == "ConfigMap"}


#: What a member of a three-member cluster says alone, in its log and to its probe (HTTP 503).
ALONE = {
    "nats": ("Waiting for routing to be established", "JetStream is still recovering meta layer"),
    "etcd": ("serving /health false; no leader",),
}


@pytest.mark.parametrize("component", ["nats", "etcd"])
def test_a_nats_or_etcd_member_starts_as_written_and_waits_for_its_peers(cluster: Cluster, component: str) -> None:
    """One node holds one member of each StatefulSet (host network: their ports are the node's), so the
    member runs alone: it starts with its command, configuration, certificate and data volume, listens
    on the node's address and serves its probe, which answers "not ready" until the two other members
    (on other nodes) join. What three members do together, the stack's own --ha members show."""
    obj = pod_of(as_written(workload("StatefulSet", f"palisade-{component}")), NODE, str(uuid.uuid4()), ordinal=0)
    pod = cluster.kubelet.run(obj, ApiObjects(secrets=cluster.secrets(), config_maps=config_maps()))
    try:
        answered = ""
        for _ in range(60):
            ok, answered = cluster.kubelet.probe(pod, component, "startupProbe")
            assert not ok, "a lone member of a three-member cluster cannot be ready"
            if "503" in answered:
                break
            time.sleep(1)
        assert "503" in answered, answered
        state, _ = cluster.kubelet.state(pod.containers[component])
        assert state == api_pb2.CONTAINER_RUNNING
        log = pod.log(component)
        assert all(line in log for line in ALONE[component]), log[-3000:]
        listen = {"nats": f"{cluster.host.address}:4222", "etcd": f"{cluster.host.address}:9379"}[component]
        assert listen in log
        assert exec_in(cluster, pod, component, "id", "-u").strip() == "10001"
    finally:
        cluster.kubelet.remove(pod)


def test_the_watcher_starts_as_written_and_needs_the_api_server(cluster: Cluster) -> None:
    """The watcher lists and watches the API server (PALISADE_SOURCE=kubernetes, in-cluster): there is
    none here, nor the service account token kubelet would mount (kubelet does give it the API server's
    Service address, KUBERNETES_SERVICE_HOST), so it exits at once, saying so."""
    obj = pod_of(as_written(workload("Deployment", "palisade-watcher")), NODE, str(uuid.uuid4()))
    pod = cluster.kubelet.run(obj, ApiObjects(secrets=cluster.secrets()))
    try:
        code = cluster.kubelet.wait_exit(pod.containers["watcher"], 120)
        assert code == 1
        assert "cannot load the in-cluster service account" in pod.log("watcher"), pod.log("watcher")
    finally:
        cluster.kubelet.remove(pod)
