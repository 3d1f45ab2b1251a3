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
packets between them as `palisade analyze` says. The policy and ipam Deployments join that
control plane on the same node.

The rest of the control plane runs from its own manifests on three more nodes (each with its
containerd and kubelet): the NATS and etcd StatefulSets' three replicas, one per node, which
form their clusters through the headless Service's names, and the watcher Deployment, which
lists and watches testkit/apiserver.py in-cluster (service account token and CA, the API
server's Service address) and publishes to that NATS.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import shutil
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cri_api.v1 import api_pb2
from nats.js.errors import NotFoundError

from palisade.v1 import k8s_pb2
from services.cli.install import MANIFESTS, load_kustomization, tls_secrets
from services.cni.install import CONFLIST, DEFAULT_SOCKET, FALLBACK, PLUGIN
from services.common.bus import K8S_STREAM, Bus
from services.common.subjects import k8s_subject
from services.common.trust import CA_NAME, Credentials, ensure_pki
from services.datapath.datapath import teardown_all
from services.devstack import hosts
from testkit.apiserver import ApiServerThread, FakeApiServer
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
        return tls_secrets_of(self.tls)


#: The stack's control plane (``--ha``: three NATS and etcd members) behind each Service of the
#: manifests' hostAliases: Service port -> the member's port on the gateway.
ENDPOINTS = {
    "palisade-nats": (4222, 4222),
    **{f"palisade-nats-{i}": (4222, 4222 + i) for i in range(3)},
    "palisade-etcd": (9379, 9379),
    **{f"palisade-etcd-{i}": (9379, 9379 + 2 * i) for i in range(3)},
    "palisade-policy": (9402, 9402),
    "palisade-ipam": (9403, 9403),
    "palisade-watcher": (9401, 9401),
}


#: A Service's name -> (its port, the backend's address, the backend's port) for each port.
Backends = dict[str, list[tuple[int, str, int]]]


def stack_backends(gateway: str) -> Backends:
    return {name: [(port, gateway, target)] for name, (port, target) in ENDPOINTS.items()}


def serve_cluster_ips(netns: str, aliases: list[Obj], backends: Backends, extra: Backends | None = None) -> None:
    """kube-proxy's part, in the node's network namespace: each Service address the hostAliases name
    leads to the backend behind it (a Service with none gets no rule: nothing answers, as with no
    endpoints). ``extra`` maps further addresses (by address, not name), such as the API server's."""
    rules = []
    for alias in aliases:
        (hostname,) = alias["hostnames"]
        for port, address, target in backends.get(hostname.split(".")[0], []):
            rules.append(f"    ip daddr {alias['ip']} tcp dport {port} dnat to {address}:{target}")
    for ip, ports in (extra or {}).items():
        for port, address, target in ports:
            rules.append(f"    ip daddr {ip} tcp dport {port} dnat to {address}:{target}")
    chain = "  chain output {\n    type nat hook output priority -100;\n" + "\n".join(rules) + "\n  }\n"
    table = f"table ip kube-proxy-stand-in {{\n{chain}}}\n"
    subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=table, text=True, check=True)


@pytest.fixture(scope="module")
def cluster(archive: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    problem = missing()
    if problem:
        pytest.skip(problem)
    tmp = tmp_path_factory.mktemp("podspec")
    with running_stack(tmp, None, "--no-pods", "--no-datapath", "--ha", "--node", NODE, *CONTROL_PLANE_PORTS) as stack:
        network = hosts.plan([NODE], "172.31.255.0/24", hosts.tag_of(stack.run_dir))
        host = network.node(NODE)
        datapath = workload("DaemonSet", "palisade-datapath")
        aliases = datapath["spec"]["template"]["spec"]["hostAliases"]
        serve_cluster_ips(host.netns, aliases, stack_backends(network.gateway))
        node = NodeRuntime(tmp / "node", host.netns, Path(f"/sys/fs/bpf/palisade-k8s-{secrets.token_hex(3)}"))
        try:
            node.start()
            images = {
                kustomized_image(c["image"], kustomization())
                for c in datapath["spec"]["template"]["spec"]["initContainers"]
                + datapath["spec"]["template"]["spec"]["containers"]
            }
            node.import_image(archive, IMAGE, sorted(images))
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
    # The executable, and beside it the Python plugin's launcher on the runtime it was given.
    assert plugin.read_bytes().startswith(b"\x7fELF")
    launcher = cluster.node.host_view("/opt/cni/bin") / FALLBACK
    assert (runtime / "python" / "bin").is_dir() and f"/opt/palisade-cni/{runtime.name}/" in launcher.read_text()
    # Both run on the node (outside the image): VERSION is the Python plugin's.
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
    return exec_on(cluster.kubelet, pod, container, *command)


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


# ---------------------------------------------------------------------------
# the StatefulSets and the watcher: a control plane of their own, on three more nodes

#: The nodes the StatefulSets' replicas run on (one member of each per node, as their ports are the node's).
MEMBER_NODES = ("node-a", "node-b", "node-c")
MEMBER_SUBNET = "172.31.254.0/24"
#: The API server's Service (default/kubernetes), which kubelet names in KUBERNETES_SERVICE_HOST/PORT.
API_SERVICE = ("10.96.0.1", 443)
WATCHED = "team-a"


@dataclass
class Member:
    """A node holding one replica of each StatefulSet."""

    host: hosts.NodeHost
    node: NodeRuntime
    kubelet: Kubelet


@dataclass
class Members:
    """Three nodes running NATS's and etcd's StatefulSets as written, and the API server the watcher
    lists and watches."""

    network: hosts.HostNetwork
    nodes: list[Member]
    #: Component -> its replicas' pods, by ordinal (replica i on node i).
    pods: dict[str, list[Pod]]
    tls: Path
    api: ApiServerThread
    #: What the API server's Service gives in-cluster clients: the cluster's CA and the watcher's token.
    cluster_ca: bytes
    token: str

    def on_node(self, ordinal: int, *command: str) -> str:
        done = subprocess.run(["ip", "netns", "exec", self.nodes[ordinal].host.netns, *command],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout


def member_backends(addresses: list[str]) -> Backends:
    """kube-proxy's view of the StatefulSets: member i's Services lead to node i's address (host
    network), the Services of the whole set to member 0 (kube-proxy would pick any ready one)."""
    out: Backends = {}
    for i, address in enumerate(addresses):
        out[f"palisade-nats-{i}"] = [(4222, address, 4222), (6222, address, 6222)]
        out[f"palisade-etcd-{i}"] = [(9379, address, 9379), (9380, address, 9380)]
    out["palisade-nats"] = [(4222, addresses[0], 4222)]
    out["palisade-etcd"] = [(9379, addresses[0], 9379)]
    return out


@pytest.fixture(scope="module")
def members(
    archive: Path, servers_archive: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Members]:
    """Three nodes (network namespaces on a bridge of their own, as nodes on one network), each with
    containerd and a kubelet; on node i the member of ordinal i of NATS's and etcd's StatefulSets, all
    six started at once (podManagementPolicy: Parallel). The Services' fixed addresses lead to the
    members on every node (kube-proxy's part), so the headless Service's names in the hostAliases, which
    the members' routes and peer URLs use, reach the replicas. The API server listens on the bridge."""
    problem = missing()
    if problem:
        pytest.skip(problem)
    tmp = tmp_path_factory.mktemp("members")
    network = hosts.plan(list(MEMBER_NODES), MEMBER_SUBNET, hosts.tag_of(tmp))
    servers, names = servers_archive
    statefulsets = {c: as_written(workload("StatefulSet", f"palisade-{c}")) for c in ("nats", "etcd")}
    aliases = statefulsets["nats"]["spec"]["template"]["spec"]["hostAliases"]
    backends = member_backends([n.address for n in network.nodes])
    # The cluster's CA and the API server's certificate for its Service address, as a cluster has them.
    kube_pki = ensure_pki(tmp / "kube-pki", ["kube-apiserver"], extra_hosts=[API_SERVICE[0]])
    tls_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_context.load_cert_chain(kube_pki / "kube-apiserver.crt", kube_pki / "kube-apiserver.key")
    api = ApiServerThread(FakeApiServer(token=secrets.token_urlsafe(24)))
    nodes: list[Member] = []
    hosts.create(network)
    try:
        api.start(network.gateway, tls_context)
        extra = {API_SERVICE[0]: [(API_SERVICE[1], network.gateway, api.server.port)]}
        for host in network.nodes:
            serve_cluster_ips(host.netns, aliases, backends, extra)
            runtime = NodeRuntime(tmp / host.name, host.netns, Path(f"/sys/fs/bpf/palisade-k8s-{secrets.token_hex(3)}"))
            facts = NodeFacts(host.name, host.address, runtime.host_view, runtime.on_node, API_SERVICE)
            nodes.append(Member(host, runtime, Kubelet(runtime.socket, facts, tmp / host.name / "pods")))

        def prepare(i: int, member: Member) -> None:
            member.node.start()
            for component, workload_obj in statefulsets.items():
                (container,) = workload_obj["spec"]["template"]["spec"]["containers"]
                member.node.import_image(servers, names[component], [container["image"]])
            if i == 0:
                # The watcher runs on the first node.
                watcher = as_written(workload("Deployment", "palisade-watcher"))
                member.node.import_image(
                    archive, IMAGE, [watcher["spec"]["template"]["spec"]["containers"][0]["image"]]
                )

        with ThreadPoolExecutor(len(network.nodes)) as pool:
            list(pool.map(prepare, range(len(nodes)), nodes))
        api_objects = ApiObjects(secrets=tls_secrets_of(tmp / "tls"), config_maps=config_maps())

        def start(job: tuple[str, int]) -> Pod:
            component, ordinal = job
            obj = pod_of(statefulsets[component], nodes[ordinal].host.name, str(uuid.uuid4()), ordinal=ordinal)
            return nodes[ordinal].kubelet.run(obj, api_objects)

        jobs = [(c, i) for c in statefulsets for i in range(len(nodes))]
        with ThreadPoolExecutor(len(jobs)) as pool:
            started = list(pool.map(start, jobs))
        pods = {c: [p for (jc, _), p in zip(jobs, started, strict=True) if jc == c] for c in statefulsets}
        yield Members(network, nodes, pods, tmp / "tls", api, (kube_pki / f"{CA_NAME}.crt").read_bytes(),
                      api.server.token)  # fmt: skip
    finally:
        for member in nodes:
            member.kubelet.close()
            member.node.stop()
            shutil.rmtree(member.node.bpffs, ignore_errors=True)
        api.stop()
        hosts.remove(network)


def tls_secrets_of(tls: Path) -> dict[str, dict[str, bytes]]:
    """The TLS Secrets `palisade install` makes from ``tls`` (a CA of its own), as kubelet gets them."""
    return {s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()} for s in tls_secrets(tls)}


#: A GET, run on a node: the members' monitoring ports are on the node's loopback.
GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def http_json(members: Members, ordinal: int, url: str) -> Obj:
    return dict(json.loads(members.on_node(ordinal, "python3", "-c", GET, url)))


def test_the_nats_and_etcd_statefulsets_form_clusters_and_become_ready(members: Members) -> None:
    """Three replicas of each, one per node as a cluster runs them, find each other through the
    headless Service's names (routes and peer URLs) and become Ready by their own probes: NATS's
    JetStream has a meta leader of three servers, every etcd member has a leader and its two peers."""
    for component, pods in members.pods.items():
        for i, pod in enumerate(pods):
            kubelet = members.nodes[i].kubelet
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                ok, said = kubelet.wait_probe(pod, component, kind)
                assert ok, f"{pod.name} {kind}: {said}\n{pod.log(component)[-3000:]}"
            assert exec_on(kubelet, pod, component, "id", "-u").strip() == "10001"
    names = [p.name for p in members.pods["nats"]]
    leaders = set()
    for i, name in enumerate(names):
        routes = http_json(members, i, "http://127.0.0.1:8222/routez")["routes"]
        assert {r["remote_name"] for r in routes} == set(names) - {name}, routes
        meta = http_json(members, i, "http://127.0.0.1:8222/jsz")["meta_cluster"]
        assert meta["cluster_size"] == 3, meta
        leaders.add(meta["leader"])
    assert len(leaders) == 1 and leaders <= set(names), leaders
    for i in range(len(members.nodes)):
        metrics = members.on_node(i, "python3", "-c", GET, "http://127.0.0.1:9381/metrics").splitlines()
        assert "etcd_server_has_leader 1" in metrics
        # Each member's peer links (etcd_network_active_peers{Local=...,Remote=...} 1), to both others.
        peers = [line for line in metrics if line.startswith("etcd_network_active_peers{") and line.endswith(" 1")]
        assert len(peers) == 2, peers


def exec_on(kubelet: Kubelet, pod: Pod, container: str, *command: str) -> str:
    out = kubelet.runtime.ExecSync(
        api_pb2.ExecSyncRequest(container_id=pod.containers[container], cmd=list(command), timeout=30), timeout=60
    )
    assert out.exit_code == 0, out.stderr.decode()
    return str(out.stdout.decode())


def team_pod(name: str) -> Obj:
    return {
        "metadata": {"name": name, "namespace": WATCHED, "labels": {"app": name}},
        "spec": {"nodeName": MEMBER_NODES[1], "containers": [{"name": "c", "image": "i"}]},
        "status": {"podIP": "10.244.1.7" if name == "listed" else "10.244.1.8"},
    }


def published_pod(members: Members, name: str) -> k8s_pb2.K8sDelta | None:
    """The last delta the StatefulSet's NATS holds for Pod WATCHED/name (read as the datapath reads it)."""

    async def read() -> k8s_pb2.K8sDelta | None:
        servers = [f"tls://{m.host.address}:4222" for m in members.nodes]
        bus = await Bus.connect(servers, name="podspec-test", tls=Credentials.load(members.tls, "datapath"))
        async with bus:
            try:
                msg = await bus.js.get_last_msg(K8S_STREAM.name, k8s_subject("pod", WATCHED, name))
            except NotFoundError:
                return None
            delta = k8s_pb2.K8sDelta()
            delta.ParseFromString(msg.data or b"")
            return delta

    return asyncio.run(read())


def test_the_watcher_runs_in_cluster_and_publishes_pods(members: Members) -> None:
    """The watcher Deployment as written, with what kubelet gives a pod of its service account (the
    token and the cluster's CA at /var/run/secrets/kubernetes.io/serviceaccount, KUBERNETES_SERVICE_HOST
    and _PORT): it lists and watches the API server (over HTTPS, verified against the mounted CA, with
    the bearer token) through the API server's Service address, passes its probes once synced, and
    publishes a Pod that exists (the list) and one created after (the watch) to the StatefulSet's NATS."""
    namespace = {"metadata": {"name": WATCHED, "labels": {"team": "a"}}}
    members.api.call(lambda s: (s.create("namespaces", namespace), s.create("pods", team_pod("listed"))))
    node = members.nodes[0]
    obj = pod_of(as_written(workload("Deployment", "palisade-watcher")), node.host.name, str(uuid.uuid4()))
    api_objects = ApiObjects(
        secrets=tls_secrets_of(members.tls), tokens={"palisade-watcher": members.token}, cluster_ca=members.cluster_ca
    )
    pod = node.kubelet.run(obj, api_objects)
    try:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            ok, said = node.kubelet.wait_probe(pod, "watcher", kind)
            assert ok, f"{kind}: {said}\n{pod.log('watcher')[-4000:]}"
        listed = published_pod(members, "listed")
        assert listed is not None and listed.op == k8s_pb2.DELTA_OP_UPSERT, listed
        assert json.loads(listed.object_json)["metadata"]["labels"] == {"app": "listed"}
        members.api.call(lambda s: s.create("pods", team_pod("watched")))
        assert wait_for(lambda: published_pod(members, "watched") is not None), pod.log("watcher")[-3000:]
        # It asked with its token (the API server answers 401 otherwise) and watches, not only lists.
        assert members.api.call(lambda s: s.active_watches("pods")) >= 1
    finally:
        node.kubelet.remove(pod)
