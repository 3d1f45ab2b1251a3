"""deploy/kubernetes: valid objects, least privilege, and consistency with the code."""

from __future__ import annotations

import copy
import functools
import ipaddress
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from services.common import natsconfig
from services.common.access import BUS_ROLES
from services.common.bus import replicas_for
from services.common.config import DEFAULT_GRPC_PORTS
from services.common.trust import Credentials
from services.datapath.netns import NETNS_DIR
from testkit.harness import ROOT
from tests.deploy.manifests import (
    DNS_PROXY,
    KUBERNETES_DIR,
    SERVICES,
    Upstream,
    check_container_config,
    check_dns_proxy,
    disagreements,
    load_documents,
    load_yaml,
    port_of,
    upstreams,
)
from tests.deploy.test_crd_schemas import strict

# Schemas shipped by kubernetes-validate (offline): the oldest version the README
# promises, and a current one.
KUBERNETES_VERSIONS = ("1.29.0", "1.35.0")
NAMESPACE = "palisade-system"
WATCHER_SA = "palisade-watcher"
READ_VERBS = {"get", "list", "watch"}
WATCHED = {
    ("", "namespaces"),
    ("", "pods"),
    ("", "nodes"),
    ("", "services"),
    ("discovery.k8s.io", "endpointslices"),
    ("networking.k8s.io", "networkpolicies"),
    ("cilium.io", "ciliumnetworkpolicies"),
    ("cilium.io", "ciliumclusterwidenetworkpolicies"),
}
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")
CILIUM_EXAMPLES = ROOT.parent / "shared" / "testdata" / "cilium-examples"

Obj = dict[str, Any]


# ---------------------------------------------------------------------------
# loading


UNINSTALL_DIR = KUBERNETES_DIR / "uninstall"


def _manifest_files() -> list[Path]:
    """What an installation holds: deploy/kubernetes and its CRDs (not the uninstall's cleanup)."""
    return sorted(
        p
        for p in KUBERNETES_DIR.rglob("*.yaml")
        if p.name != "kustomization.yaml" and not p.is_relative_to(UNINSTALL_DIR)
    )


@functools.cache
def _objects() -> tuple[Obj, ...]:
    return tuple(doc for path in _manifest_files() for doc in load_documents(path))


def _of_kind(*kinds: str) -> list[Obj]:
    return [o for o in _objects() if o["kind"] in kinds]


def _named(kind: str, name: str) -> Obj:
    found = [o for o in _of_kind(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def _palisade_containers() -> dict[str, tuple[Obj, Obj]]:
    """Service name -> (workload, container) for every container of the Palisade image."""
    out: dict[str, tuple[Obj, Obj]] = {}
    for workload in _of_kind(*WORKLOAD_KINDS):
        pod = _pod_spec(workload)
        for container in pod.get("initContainers", []) + pod["containers"]:
            if container["image"].partition(":")[0] != "palisade" or container["command"] in (CNI_INSTALL, DNS_PROXY):
                continue
            name, _ = _check(workload, container)
            assert name not in out, f"services.{name} runs in two containers"
            out[name] = (workload, container)
    return out


CNI_INSTALL = ["python", "-m", "services.cni.install"]


def test_the_dns_proxy_runs_beside_the_datapath_on_its_pins_and_state() -> None:
    (daemonset,) = [w for w in _of_kind("DaemonSet") if w["metadata"]["name"] == "palisade-datapath"]
    containers = {c["name"]: c for c in _pod_spec(daemonset)["containers"]}
    proxy, datapath = containers["dns-proxy"], containers["datapath"]
    assert proxy["command"] == DNS_PROXY and proxy["image"] == datapath["image"]

    def env(c: Obj) -> dict[str, str]:
        return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}

    check_dns_proxy("the DNS proxy container", env(proxy), env(datapath))
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    assert mounts == {"bpffs": "/sys/fs/bpf", "state": "/var/run/palisade"}
    assert proxy["securityContext"]["privileged"] is True  # transparent sockets, the node's routing


def test_the_datapath_installs_the_cni_plugin_on_its_node() -> None:
    from services.cni import install
    from services.datapath.config import DatapathConfig

    pod = _pod_spec(_named("DaemonSet", "palisade-datapath"))
    (init,) = [c for c in pod.get("initContainers", []) if c["command"] == CNI_INSTALL]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"] for m in init["volumeMounts"]}
    # The installer's defaults are the node's folders, as mounted.
    assert mounts == {"/host/opt/cni/bin": "/opt/cni/bin", "/host/etc/cni/net.d": "/etc/cni/net.d",
                      "/host/opt/palisade-cni": "/opt/palisade-cni"}  # fmt: skip
    assert _env(init)["PALISADE_CNI_MODE"] in ("standalone", "chained")
    # The plugin's default socket is where the datapath listens with the manifest's state dir.
    datapath = next(c for c in pod["containers"] if c["name"] == "datapath")
    state_dir = _env(datapath)["PALISADE_STATE_DIR"]
    assert DatapathConfig(state_dir=state_dir).cni_socket_path == install.DEFAULT_SOCKET
    assert any(Path(install.DEFAULT_SOCKET).is_relative_to(m["mountPath"]) for m in datapath["volumeMounts"])


def _env(container: Obj) -> dict[str, str]:
    """The container's environment; values from the downward API become a stand-in."""
    return {e["name"]: e.get("value", "from-downward-api") for e in container.get("env", [])}


def _check(workload: Obj, container: Obj) -> tuple[str, Any]:
    where = f"{workload['kind']} {workload['metadata']['name']} container {container['name']}"
    assert "args" not in container, f"{where}: configure with PALISADE_* variables, not args"
    return check_container_config(where, container["command"], _env(container))


# ---------------------------------------------------------------------------
# schemas


def test_kustomizations_list_every_manifest_and_the_crds_apart() -> None:
    kustomization = load_yaml(KUBERNETES_DIR / "kustomization.yaml")
    listed = [KUBERNETES_DIR / r for r in kustomization["resources"]]
    crds = [KUBERNETES_DIR / "crds" / r for r in load_yaml(KUBERNETES_DIR / "crds" / "kustomization.yaml")["resources"]]
    # The CRDs are a kustomization of their own: deleting Palisade's keeps users' policies.
    assert not any(p.is_relative_to(KUBERNETES_DIR / "crds") for p in listed)
    assert sorted(listed + crds) == _manifest_files()
    assert len(set(listed)) == len(listed)
    # No namespace transformer: it would give the cluster-wide policies a namespace.
    assert "namespace" not in kustomization


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_objects_match_the_kubernetes_schemas_strictly(version: str) -> None:
    supported = {v.rpartition(".")[0] for v in kubernetes_validate.utils.all_versions()}
    assert version.rpartition(".")[0] in supported, f"kubernetes-validate ships no schemas for {version}"
    problems = []
    for obj in _objects():
        if obj["kind"] in CILIUM_KINDS:  # against the CRDs these manifests install
            problems += [f"{obj['kind']}/{obj['metadata']['name']}: {e}" for e in _errors(obj)]
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(exc.message)
    assert not problems, "\n".join(problems)


def test_the_schema_check_rejects_unknown_fields() -> None:
    """The validator really validates: a misspelt securityContext field is an error."""
    workload = copy.deepcopy(_named("Deployment", "palisade-policy"))
    _pod_spec(workload)["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(workload, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomize_renders_the_same_objects() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the files were still validated one by one")
    rendered = []
    for directory in (KUBERNETES_DIR, KUBERNETES_DIR / "crds"):
        result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        rendered += [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def key(o: Obj) -> tuple[str, str, str]:
        return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])

    assert sorted(map(key, rendered)) == sorted(map(key, _objects()))
    images = {c["image"] for o in rendered if o["kind"] in WORKLOAD_KINDS for c in _pod_spec(o)["containers"]}
    assert "palisade:0.1.0" in images
    for obj in rendered:
        if obj["kind"] in ("CiliumClusterwideNetworkPolicy", "CustomResourceDefinition", "ClusterRole"):
            assert "namespace" not in obj["metadata"], obj["metadata"]["name"]


def test_namespaced_objects_live_in_palisade_system() -> None:
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                      "CiliumClusterwideNetworkPolicy"}  # fmt: skip
    for obj in _objects():
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']} {obj['metadata']['name']}"
    assert _named("Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == ("privileged")


# ---------------------------------------------------------------------------
# least privilege


def test_watcher_may_only_read_what_it_watches() -> None:
    grants = set()
    for role in _of_kind("ClusterRole", "Role"):
        for rule in role.get("rules", []):
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule, role["metadata"]["name"]
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        grants.add((group, resource, verb))
    assert grants == {(g, r, v) for g, r in WATCHED for v in READ_VERBS}


def test_only_the_watcher_service_account_is_bound_to_a_role() -> None:
    bindings = _of_kind("ClusterRoleBinding", "RoleBinding")
    assert bindings
    roles = {r["metadata"]["name"] for r in _of_kind("ClusterRole")}
    for binding in bindings:
        assert binding["roleRef"]["name"] in roles, "bound to a role these manifests do not define"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": WATCHER_SA, "namespace": NAMESPACE}]


def test_only_the_watcher_gets_a_kubernetes_api_token() -> None:
    accounts = {sa["metadata"]["name"]: sa for sa in _of_kind("ServiceAccount")}
    for workload in _of_kind(*WORKLOAD_KINDS):
        pod = _pod_spec(workload)
        name = workload["metadata"]["name"]
        account = pod.get("serviceAccountName")
        assert account in accounts, f"{name} must use a ServiceAccount of its own, not {account!r}"
        if name == "palisade-watcher":
            assert account == WATCHER_SA
            assert pod.get("automountServiceAccountToken", True) is True
        else:
            assert account != WATCHER_SA, f"{name} must not share the watcher's ServiceAccount"
            assert pod["automountServiceAccountToken"] is False, name
            assert accounts[account]["automountServiceAccountToken"] is False, account


# ---------------------------------------------------------------------------
# workloads


def test_the_four_services_run_as_deployments_and_a_daemonset() -> None:
    containers = _palisade_containers()
    assert set(containers) == SERVICES
    for name, (workload, _) in containers.items():
        assert workload["kind"] == ("DaemonSet" if name == "datapath" else "Deployment"), name
        assert workload["metadata"]["name"] == f"palisade-{name}"


def test_every_palisade_container_runs_its_service_with_known_settings() -> None:
    for name, (workload, container) in _palisade_containers().items():
        service, config = _check(workload, container)
        assert service == name
        assert port_of(config.grpc_listen) == DEFAULT_GRPC_PORTS[name]
        names = [e["name"] for e in container["env"]]
        assert len(names) == len(set(names)), f"{name} sets a variable twice"


def test_settings_shared_by_services_agree() -> None:
    configs = {name: _check(w, c)[1] for name, (w, c) in _palisade_containers().items()}
    assert disagreements(configs) == []


def test_probes_run_the_healthcheck_with_the_components_own_certificate() -> None:
    # kubelet's grpc: probes cannot present a client certificate: the image's healthcheck does.
    for name, (_, container) in _palisade_containers().items():
        port = DEFAULT_GRPC_PORTS[name]
        assert {"containerPort": port, "name": "grpc"} in container["ports"], name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"] == {"command": ["palisade-healthcheck"]}, f"{name} {probe}"


def _env_entries(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def test_services_listen_on_their_own_address_not_every_interface() -> None:
    for name, (_, container) in _palisade_containers().items():
        env = _env_entries(container)
        variable, field = ("HOST_IP", "status.hostIP") if name == "datapath" else ("POD_IP", "status.podIP")
        assert env[variable]["valueFrom"] == {"fieldRef": {"fieldPath": field}}, name
        names = list(env)
        for setting in ("PALISADE_GRPC_LISTEN", "PALISADE_METRICS_LISTEN"):
            value = env[setting]["value"]
            assert value.startswith(f"$({variable}):"), f"{name} {setting}={value}"
            # Kubernetes expands $(VAR) only from variables defined before it.
            assert names.index(variable) < names.index(setting), name
    etcd = _pod_spec(_named("StatefulSet", "palisade-etcd"))["containers"][0]
    listens = [a for a in etcd["args"] if a.startswith(("--listen-client-urls", "--listen-peer-urls"))]
    assert listens and all("$(POD_IP)" in a and "0.0.0.0" not in a for a in listens), listens


def _tls_mounts(workload: Obj) -> list[tuple[Obj, Obj]]:
    """(container, volume) for every mount of a TLS secret in the workload's main containers."""
    pod = _pod_spec(workload)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return [
        (c, volumes[m["name"]])
        for c in pod["containers"]
        for m in c.get("volumeMounts", [])
        if "secret" in volumes.get(m["name"], {})
    ]


COMPONENTS = {
    ("Deployment", "palisade-watcher"): "watcher",
    ("Deployment", "palisade-policy"): "policy",
    ("Deployment", "palisade-ipam"): "ipam",
    ("DaemonSet", "palisade-datapath"): "datapath",
    ("StatefulSet", "palisade-nats"): "nats",
    ("StatefulSet", "palisade-etcd"): "etcd",
}


def test_each_component_mounts_only_its_own_certificate_read_only() -> None:
    for (kind, workload_name), component in COMPONENTS.items():
        workload = _named(kind, workload_name)
        mounts = _tls_mounts(workload)
        assert len(mounts) == 1, f"{workload_name} mounts {len(mounts)} secrets"
        container, volume = mounts[0]
        assert volume["secret"]["secretName"] == f"palisade-tls-{component}", workload_name
        assert volume["secret"]["defaultMode"] & 0o007 == 0, f"{workload_name}: the key is readable by others"
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["mountPath"] == "/etc/palisade/tls" and mount["readOnly"] is True, workload_name
        pod = _pod_spec(workload)
        if pod.get("securityContext", {}).get("runAsNonRoot"):
            # The secret's files are group-readable by the pod's group, nobody else's.
            assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"], workload_name


def test_etcd_speaks_tls_and_serves_only_ipams_certificate() -> None:
    args = _pod_spec(_named("StatefulSet", "palisade-etcd"))["containers"][0]["args"]
    flags = dict(a.removeprefix("--").partition("=")[::2] for a in args)
    for url in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        assert flags[url].startswith("https://"), url
    assert "client-cert-auth" in flags and "peer-client-cert-auth" in flags
    assert flags["client-cert-allowed-hostname"] == "ipam"
    assert flags["trusted-ca-file"] == "/etc/palisade/tls/ca.crt"


def test_nats_runs_the_generated_configuration() -> None:
    nats = _pod_spec(_named("StatefulSet", "palisade-nats"))["containers"][0]
    assert nats["args"] == ["--config", "/etc/nats/nats.conf"]
    text = _named("ConfigMap", "palisade-nats-config")["data"]["nats.conf"]
    wanted = natsconfig.render(
        listen="$NATS_LISTEN",
        store_dir="/data",
        tls=Credentials("nats", Path("/etc/palisade/tls")),
        http="127.0.0.1:8222",
        cluster=natsconfig.KUBERNETES_CLUSTER,
    )
    assert text == wanted, "regenerate deploy/kubernetes/nats-config.yaml (see its header)"
    for variable in ("$POD_NAME", "$NATS_LISTEN", "$NATS_CLUSTER_LISTEN"):
        text = text.replace(variable, f'"{variable}"')
    config = json.loads(text)
    # On the node's network: the node's address, given by the pod's environment, not every interface.
    env = {e["name"]: e.get("value", "") for e in nats["env"]}
    assert config["listen"] == "$NATS_LISTEN" and env["NATS_LISTEN"] == "$(POD_IP):4222"
    assert config["cluster"]["listen"] == "$NATS_CLUSTER_LISTEN" and env["NATS_CLUSTER_LISTEN"] == "$(POD_IP):6222"
    assert list(env).index("POD_IP") < list(env).index("NATS_LISTEN")
    assert config["http"].startswith("127.0.0.1:"), "monitoring on the node's loopback only"
    assert config["server_name"] == "$POD_NAME" and len(config["cluster"]["routes"]) == 3
    assert config["jetstream"]["store_dir"] == "/data"
    assert config["tls"]["verify_and_map"] is True
    assert {u["user"] for u in config["authorization"]["users"]} == set(BUS_ROLES)


# ---------------------------------------------------------------------------
# bootstrap: the control plane needs no pod network


CONTROL_PLANE = ("palisade-watcher", "palisade-policy", "palisade-ipam", "palisade-nats", "palisade-etcd")
NOT_READY = {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}


def _aliases(workload: Obj) -> dict[str, str]:
    """Host name -> address, from the pod's hostAliases."""
    return {h: a["ip"] for a in _pod_spec(workload).get("hostAliases", []) for h in a["hostnames"]}


def _dialled_hosts(name: str, workload: Obj, container: Obj) -> set[str]:
    """Every host name a Palisade container dials (its upstreams)."""
    _, config = _check(workload, container)
    return {up.host for up in upstreams(name, config)}


def _fixed_service(host: str) -> Obj:
    """The Service whose fixed ClusterIP ``host`` should resolve to: a StatefulSet member's own
    (``palisade-nats-0.palisade-nats-headless.palisade-system.svc`` -> ``palisade-nats-0``), else
    the Service the name is (``palisade-policy.palisade-system.svc``)."""
    labels = host.split(".")
    return _named("Service", labels[0]) if len(labels) >= 4 and labels[3] == "svc" else _service_port(host, 0)


def _url_host(url: str) -> str:
    return url.partition("://")[2].rpartition(":")[0]


def test_the_control_plane_runs_on_the_node_network_and_needs_no_cluster_dns() -> None:
    """A cluster with no pod network yet: the control plane must come up without a CNI and
    without CoreDNS (itself a pod waiting for one). Each component is on the host network,
    schedulable on NotReady nodes, and every name it dials is in its hostAliases at the fixed
    ClusterIP of the Service that name designates (kube-proxy serves ClusterIPs on nodes)."""
    dialled: dict[str, set[str]] = {}
    for name, (workload, container) in _palisade_containers().items():
        dialled[workload["metadata"]["name"]] = _dialled_hosts(name, workload, container)
    etcd = _named("StatefulSet", "palisade-etcd")
    args = _pod_spec(etcd)["containers"][0]["args"]
    flags = dict(a.removeprefix("--").partition("=")[::2] for a in args)
    peers = [_url_host(u.partition("=")[2]) for u in flags["initial-cluster"].split(",")]
    advertise = _url_host(flags["advertise-client-urls"])
    advertised = {advertise.replace("$(POD_NAME)", f"palisade-etcd-{i}") for i in range(3)}
    dialled["palisade-etcd"] = set(peers) | advertised
    dialled["palisade-nats"] = {r.rpartition(":")[0] for r in natsconfig.KUBERNETES_CLUSTER.routes}
    assert all(dialled.values()), dialled

    for workload_name in (*CONTROL_PLANE, "palisade-datapath"):
        (workload,) = [w for w in _of_kind(*WORKLOAD_KINDS) if w["metadata"]["name"] == workload_name]
        pod = _pod_spec(workload)
        assert pod.get("hostNetwork") is True, workload_name
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet", workload_name
        tolerations = pod.get("tolerations", [])
        assert NOT_READY in tolerations or {"operator": "Exists"} in tolerations, workload_name
        aliases = _aliases(workload)
        for host in dialled[workload_name]:
            assert host in aliases, f"{workload_name} dials {host}, which only the cluster's DNS would resolve"
            fixed = _fixed_service(host)["spec"].get("clusterIP")
            assert aliases[host] == fixed, f"{workload_name}: {host} -> {aliases[host]}, Service has {fixed}"


def test_fixed_cluster_ips_are_distinct_and_in_the_static_band() -> None:
    from services.cli import install

    fixed = {s["metadata"]["name"]: s["spec"]["clusterIP"] for s in _of_kind("Service") if "clusterIP" in s["spec"]}
    fixed = {n: ip for n, ip in fixed.items() if ip != "None"}
    assert len(set(fixed.values())) == len(fixed), fixed
    assert fixed == install.static_cluster_ips(install.DEFAULT_SERVICE_CIDR)
    network = ipaddress.ip_network(install.DEFAULT_SERVICE_CIDR)
    for name, ip in fixed.items():
        # Kubernetes keeps the low band of the range (up to 256 addresses) for static ClusterIPs.
        assert int(ipaddress.ip_address(ip)) - int(network.network_address) < 256, name


# Ports the node's own processes hold: kubelet, kube-proxy, the API server, and a control-plane
# node's etcd (2379-2381), which a host-network Palisade etcd would otherwise collide with.
NODE_PORTS = {2379, 2380, 2381, 6443, 10248, 10249, 10250, 10256, 10257, 10259}


def test_host_network_ports_do_not_collide_on_a_node() -> None:
    seen: dict[int, str] = {}
    for workload in _of_kind(*WORKLOAD_KINDS):
        for container in _pod_spec(workload)["containers"]:
            for port in container.get("ports", []):
                number = port["containerPort"]
                where = f"{workload['metadata']['name']}/{port.get('name', number)}"
                assert number not in NODE_PORTS, f"{where} takes the node's port {number}"
                assert number not in seen, f"{where} and {seen[number]} share port {number} on a node"
                seen[number] = where


# ---------------------------------------------------------------------------
# Palisade's own network policy, as Palisade's semantics answer it


GRPC_PORTS = {"palisade-watcher": 9401, "palisade-policy": 9402, "palisade-ipam": 9403, "palisade-datapath": 9404}
METRICS_PORTS = {"palisade-watcher": 9501, "palisade-policy": 9502, "palisade-ipam": 9503, "palisade-datapath": 9504}
BUS_PORTS = {"palisade-nats": (4222, 6222), "palisade-etcd": (9379, 9380)}

EXTRA = """
apiVersion: v1
kind: Namespace
metadata: {name: rogue}
---
apiVersion: v1
kind: Namespace
metadata: {name: monitoring, labels: {palisade.io/scrape-metrics: "true"}}
---
apiVersion: v1
kind: Pod
metadata: {name: rogue, namespace: rogue, labels: {app: rogue}}
spec:
  nodeName: node-1
  containers: [{name: c, image: busybox, ports: [{containerPort: 80}]}]
---
apiVersion: v1
kind: Pod
metadata: {name: prometheus, namespace: monitoring, labels: {app: prometheus}}
spec:
  nodeName: node-2
  containers: [{name: c, image: prometheus, ports: [{containerPort: 80}]}]
"""


def _pods_of_workloads() -> list[Obj]:
    """The Pods the workloads make, two nodes apart: one member of each on node-1, node-2, node-3."""
    pods = []
    for workload in _of_kind(*WORKLOAD_KINDS):
        name = workload["metadata"]["name"]
        replicas = 3 if workload["kind"] == "DaemonSet" else workload["spec"].get("replicas", 1)
        for i in range(replicas):
            spec = {**_pod_spec(workload), "nodeName": f"node-{i + 1}"}
            pods.append({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{name}-{i}", "namespace": NAMESPACE,
                             "labels": workload["spec"]["template"]["metadata"]["labels"]},
                "spec": spec,
            })  # fmt: skip
    return pods


@functools.cache
def _analyzed(tmp: Path) -> dict[tuple[int, str], dict[str, dict[str, bool]]]:
    (tmp / "pods.yaml").write_text(yaml.safe_dump_all(_pods_of_workloads()) + "---\n" + EXTRA)
    ports = sorted({*GRPC_PORTS.values(), *METRICS_PORTS.values(), *(p for v in BUS_PORTS.values() for p in v), 80})
    cmd = [sys.executable, "-m", "services.cli.main", "analyze", "-f", str(KUBERNETES_DIR)]
    cmd += ["-f", str(tmp / "pods.yaml")]
    cmd += [a for p in ports for a in ("--probe", f"{p}/TCP")]
    out = subprocess.run([*cmd, "-o", "json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return {(p["port"], p["protocol"]): p["matrix"] for p in json.loads(out.stdout)["probes"]}


def test_palisade_analyze_says_only_the_components_reach_palisades_ports(tmp_path: Path) -> None:
    matrices = _analyzed(tmp_path)
    rogue, scraper = "rogue/rogue", "monitoring/prometheus"
    cp = f"{NAMESPACE}/"
    datapaths = [f"{cp}palisade-datapath-{i}" for i in range(3)]

    def reach(src: str, dst: str, port: int) -> bool:
        return matrices[(port, "TCP")][src][dst]

    for target, (client, peer) in BUS_PORTS.items():
        for i in range(3):
            member = f"{cp}{target}-{i}"
            for port in (client, peer):
                # A pod of any namespace is denied, on its own node (host) and on another (remote-node).
                assert not reach(rogue, member, port), f"rogue pod reaches {member}:{port}"
                assert not reach(scraper, member, port), f"scraper reaches {member}:{port}"
    for target, port in GRPC_PORTS.items():
        for member in [p for p in matrices[(port, "TCP")][rogue] if p.startswith(f"{cp}{target}-")]:
            assert not reach(rogue, member, port) and not reach(scraper, member, port), f"{member}:{port}"
    for target, port in METRICS_PORTS.items():
        for member in [p for p in matrices[(port, "TCP")][rogue] if p.startswith(f"{cp}{target}-")]:
            assert reach(scraper, member, port), f"the scraper cannot reach {member}:{port}"
            assert not reach(rogue, member, port), f"rogue pod reaches {member}:{port}"
    # The components themselves: host-network callers, which no pod policy judges (mutual TLS does).
    for datapath in datapaths:
        assert reach(datapath, f"{cp}palisade-nats-1", 4222)
        assert reach(datapath, f"{cp}palisade-policy-1", 9402)
        assert reach(datapath, f"{cp}palisade-ipam-0", 9403)
    assert reach(f"{cp}palisade-ipam-0", f"{cp}palisade-etcd-2", 9379)
    assert reach(f"{cp}palisade-etcd-0", f"{cp}palisade-etcd-1", 9380)
    assert reach(f"{cp}palisade-nats-0", f"{cp}palisade-nats-2", 6222)
    # And nothing else changes: pods still reach each other, and their own node reaches them.
    assert reach(rogue, scraper, 80) and reach(scraper, rogue, 80)
    assert reach(datapaths[0], rogue, 80)


def test_the_network_policy_puts_no_pod_into_default_deny() -> None:
    policies = _of_kind("NetworkPolicy", "CiliumNetworkPolicy", "CiliumClusterwideNetworkPolicy")
    assert policies
    for policy in policies:
        spec = policy["spec"]
        assert set(spec) - {"description"} <= {"endpointSelector", "enableDefaultDeny", "egressDeny"}, spec
        assert spec["enableDefaultDeny"] == {"ingress": False, "egress": False}


def test_unprivileged_services_are_locked_down() -> None:
    for workload in _of_kind("Deployment", "StatefulSet"):
        pod = _pod_spec(workload)
        name = workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        # The node's network (see the bootstrap tests), none of its other namespaces.
        assert pod.get("hostNetwork") is True and not pod.get("hostPID") and not pod.get("hostIPC"), name
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert not sc.get("privileged", False), name
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name


def test_datapath_is_a_privileged_daemonset_on_every_node_with_the_host_mounts() -> None:
    ds = _named("DaemonSet", "palisade-datapath")
    pod = _pod_spec(ds)
    container = next(c for c in pod["containers"] if c["name"] == "datapath")
    assert container["securityContext"]["privileged"] is True
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"operator": "Exists"} in pod["tolerations"]

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path, read_only in (("/sys/fs/bpf", False), (NETNS_DIR, False), ("/lib/modules", True), ("/usr/src", True)):
        mount = mounts[path]
        assert volumes[mount["name"]]["hostPath"]["path"] == path
        assert mount.get("readOnly", False) is read_only, path
    # Pinned maps and the pods' namespaces are the node's: shared both ways.
    assert mounts["/sys/fs/bpf"]["mountPropagation"] == "Bidirectional"
    assert mounts[NETNS_DIR]["mountPropagation"] == "Bidirectional"

    node_name = next(e for e in container["env"] if e["name"] == "PALISADE_NODE_NAME")
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    _, config = _check(ds, container)
    assert Path(config.bpffs).is_relative_to("/sys/fs/bpf")
    host_dirs = [m for m, v in mounts.items() if "hostPath" in volumes[v["name"]]]
    assert any(Path(config.state_dir).is_relative_to(d) for d in host_dirs), "endpoint state must be on the node"


def test_nats_and_etcd_run_three_members_policy_and_ipam_two_spread_over_nodes() -> None:
    for kind, name, replicas in (
        ("StatefulSet", "palisade-nats", 3),
        ("StatefulSet", "palisade-etcd", 3),
        ("Deployment", "palisade-policy", 2),
        ("Deployment", "palisade-ipam", 2),
    ):
        workload = _named(kind, name)
        assert workload["spec"]["replicas"] == replicas, name
        (term,) = _pod_spec(workload)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname", name
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
        (budget,) = [p for p in _of_kind("PodDisruptionBudget") if p["metadata"]["name"] == name]
        assert budget["spec"]["maxUnavailable"] == 1, name
        assert budget["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}
    # Every client is given every NATS server (and so creates its streams with three replicas).
    for name, (workload, container) in _palisade_containers().items():
        _, config = _check(workload, container)
        assert replicas_for(config.nats_servers()) == 3, name
    args = _pod_spec(_named("StatefulSet", "palisade-etcd"))["containers"][0]["args"]
    (initial,) = [a for a in args if a.startswith("--initial-cluster=")]
    assert initial.count("=https://") == 3
    # Policy replicas are named by their pods and reachable by each other at their pod address.
    policy = _named("Deployment", "palisade-policy")
    assert "strategy" not in policy["spec"], "replicas roll one at a time (the default), not Recreate"
    _, config = _check(policy, _pod_spec(policy)["containers"][0])
    assert config.member == "$(POD_NAME)" and config.advertise_address == "$(POD_IP):9402"


def test_etcd_is_3_5() -> None:
    etcd = _pod_spec(_named("StatefulSet", "palisade-etcd"))["containers"][0]
    assert etcd["image"].startswith(("quay.io/coreos/etcd:v3.5.", "gcr.io/etcd-development/etcd:v3.5."))


# ---------------------------------------------------------------------------
# services and addresses


def _selected(service: Obj) -> list[Obj]:
    selector = service["spec"]["selector"]
    member = selector.get("statefulset.kubernetes.io/pod-name")
    if member is not None:  # one member of a StatefulSet, by the label its controller sets
        workload = _named("StatefulSet", member.rpartition("-")[0])
        assert int(member.rpartition("-")[2]) < workload["spec"]["replicas"], member
        return [workload]
    return [
        w for w in _of_kind(*WORKLOAD_KINDS) if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def test_every_service_selects_one_workload_and_existing_ports() -> None:
    for service in _of_kind("Service"):
        name = service["metadata"]["name"]
        selected = _selected(service)
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        ports = [p for c in _pod_spec(selected[0])["containers"] for p in c.get("ports", [])]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in (p.get("name"), p["containerPort"]) for p in ports), f"{name}: {target}"


def _service_port(host: str, port: int) -> Obj:
    """The Service that ``host:port`` names: ``<service>.<namespace>.svc[.cluster.local]``, or a
    StatefulSet member ``<set>-<ordinal>.<headless service>.<namespace>.svc`` (that Service)."""
    labels = host.split(".")
    if len(labels) >= 4 and labels[3] == "svc":
        member, service_name, namespace = labels[:3]
        workload = _named("StatefulSet", member.rpartition("-")[0])
        assert workload["spec"]["serviceName"] == service_name, f"{host}: not the set's governing Service"
        assert int(member.rpartition("-")[2]) < workload["spec"]["replicas"], f"{host}: no such member"
        labels = [service_name, namespace, *labels[3:]]
    service_name, namespace, *rest = labels
    assert rest in (["svc"], ["svc", "cluster", "local"]), f"{host} is not a Service DNS name"
    service = _named("Service", service_name)
    assert service["metadata"]["namespace"] == namespace
    if port:
        assert any(p["port"] == port for p in service["spec"]["ports"]), f"Service {service_name} has no port {port}"
    return service


EXPECTED_TARGET = {
    "nats_url": "palisade-nats",
    "etcd_endpoints": "palisade-etcd",
    "policy_address": "palisade-policy",
    "ipam_address": "palisade-ipam",
}


def test_every_address_reaches_the_right_service() -> None:
    for name, (workload, container) in _palisade_containers().items():
        _, config = _check(workload, container)
        found: list[Upstream] = list(upstreams(name, config))
        assert found, name
        for up in found:
            service = _service_port(up.host, up.port)
            target = service["spec"]["selector"]["app.kubernetes.io/name"]
            assert target == EXPECTED_TARGET[up.setting], f"{name} {up}"


# ---------------------------------------------------------------------------
# Cilium CustomResourceDefinitions


def _crd(kind: str) -> Obj:
    found = [c for c in _of_kind("CustomResourceDefinition") if c["spec"]["names"]["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def _schema(kind: str) -> Obj:
    (version,) = _crd(kind)["spec"]["versions"]
    schema: Obj = version["schema"]["openAPIV3Schema"]
    return schema


CILIUM_KINDS = {"CiliumNetworkPolicy": "Namespaced", "CiliumClusterwideNetworkPolicy": "Cluster"}


def test_crds_define_the_cilium_kinds_the_watcher_may_read() -> None:
    readable = {r for g, r in WATCHED if g == "cilium.io"}
    plurals = set()
    for kind, scope in CILIUM_KINDS.items():
        spec = _crd(kind)["spec"]
        assert spec["group"] == "cilium.io" and spec["scope"] == scope
        assert [(v["name"], v["served"], v["storage"]) for v in spec["versions"]] == [("v2", True, True)]
        assert _crd(kind)["metadata"]["name"] == f"{spec['names']['plural']}.cilium.io"
        plurals.add(spec["names"]["plural"])
    assert plurals == readable


JUNCTORS = ("oneOf", "anyOf", "allOf", "not")
NOT_IN_JUNCTORS = ("type", "additionalProperties", "description", "default", "nullable")


def _structural_problems(node: Obj, path: str = "") -> list[str]:
    """Where a schema breaks Kubernetes' rules for structural schemas (the ones that matter here)."""
    problems = []
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "type" not in node and not preserve and not node.get("x-kubernetes-int-or-string"):
        problems.append(f"{path or '.'}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: both properties and additionalProperties")
    if node.get("type") == "array" and "items" not in node:
        problems.append(f"{path}: array without items")
    for key, sub in node.get("properties", {}).items():
        problems += _structural_problems(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        problems += _structural_problems(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        problems += _structural_problems(node["items"], f"{path}[]")
    for junctor in JUNCTORS:
        branches = node.get(junctor, [])
        for branch in [branches] if isinstance(branches, dict) else branches:
            for key in NOT_IN_JUNCTORS:
                if key in branch:
                    problems.append(f"{path}.{junctor}: {key} is not allowed in a junctor")
            for key in branch.get("properties", {}):
                if key not in node.get("properties", {}):
                    problems.append(f"{path}.{junctor}: {key} is not in the structural properties")
            for key in branch.get("required", []):
                if key not in node.get("properties", {}):
                    problems.append(f"{path}.{junctor}: required {key} is not a property")
    return problems


@pytest.mark.parametrize("kind", sorted(CILIUM_KINDS))
def test_crd_schemas_are_structural_and_rule_schemas_agree(kind: str) -> None:
    schema = _schema(kind)
    assert _structural_problems(schema) == []
    assert schema["type"] == "object"

    def undescribed(node: Obj) -> Obj:
        return {k: v for k, v in node.items() if k != "description"}

    # One rule schema: spec, each item of specs, in both kinds.
    rule = undescribed(schema["properties"]["spec"])
    assert undescribed(schema["properties"]["specs"]["items"]) == rule
    assert undescribed(_schema("CiliumNetworkPolicy")["properties"]["spec"]) == rule


def _prune_nulls(value: Any) -> Any:
    """What the API server stores: null values of non-nullable fields are dropped first."""
    if isinstance(value, dict):
        return {k: _prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_prune_nulls(v) for v in value]
    return value


def _errors(obj: Obj) -> list[str]:
    """Errors under the API server's strict field validation (see tests/deploy/test_crd_schemas.py)."""
    validator = jsonschema.Draft4Validator(strict(_schema(obj["kind"])))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(_prune_nulls(obj))]


# Every Cilium example against the CRDs: tests/deploy/test_crd_schemas.py.


GOOD = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  description: web from frontends, DNS out
  endpointSelector: {matchLabels: {app: web}}
  ingress:
    - fromEndpoints: [{matchLabels: {"k8s:role": frontend}}]
      toPorts: [{ports: [{port: "8080", endPort: 8090, protocol: TCP}]}]
  ingressDeny:
    - fromCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]
  egress:
    - toEntities: [kube-apiserver]
    - toFQDNs: [{matchName: example.com}]
      toPorts: [{ports: [{port: "53", protocol: ANY}], rules: {dns: [{matchPattern: "*"}]}}]
  enableDefaultDeny: {ingress: true, egress: false}
"""


def _policy(kind: str = "CiliumNetworkPolicy") -> Obj:
    doc: Obj = yaml.safe_load(GOOD)
    doc["kind"] = kind
    return doc


def test_crd_keeps_fields_it_does_not_type() -> None:
    for kind in CILIUM_KINDS:
        assert _errors(_policy(kind)) == []
    doc = _policy("CiliumClusterwideNetworkPolicy")
    doc["specs"] = [doc.pop("spec"), {"nodeSelector": {}, "egress": [{"toCIDR": ["0.0.0.0/0"]}]}]
    assert _errors(doc) == []


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda s: s.pop("endpointSelector"), "spec"),
        (lambda s: s.update(nodeSelector={}), "spec"),
        (lambda s: s.update(ingress={"fromEndpoints": []}), "spec.ingress"),
        (lambda s: s["ingress"][0]["toPorts"][0]["ports"][0].update(protocol="HTTP"), "protocol"),
        (lambda s: s["ingress"][0]["toPorts"][0]["ports"][0].update(port=[8080]), "port"),
        (lambda s: s["ingress"][0].update(fromEndpoint=[{}]), "fromEndpoint"),
        (lambda s: s["endpointSelector"].update(matchLabels={"app": ["web"]}), "matchLabels"),
        (lambda s: s["egress"].append({"toCIDR": "10.0.0.0/8"}), "toCIDR"),
    ],
)
def test_crd_rejects_malformed_policies(change: Any, where: str) -> None:
    doc = _policy()
    change(doc["spec"])
    errors = _errors(doc)
    assert errors, "accepted"
    assert any(where in e for e in errors), errors
