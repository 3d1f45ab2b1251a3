"""`make run --nodes 3`: a dev cluster of three node hosts, cross-node enforcement by identity.

Each node is a network namespace with its own datapath; pods are spread over them and
routed natively (the receiver sees the sender's pod address), so an ingress policy on one
node judges a packet from another node by the sender's identity, from the cluster-wide
ipcache, and an egress policy judges by the receiver's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from palisade.v1 import ipam_pb2, ipam_pb2_grpc
from services.datapath.netns import create_netns, delete_netns, in_netns
from services.datapath.routing import RTPROT_PALISADE
from services.devstack import __main__ as devstack
from testkit import tuplereuse
from testkit.harness import ROOT
from testkit.stack import Stack, Traffic, assert_clean, pod_server, probe, prober, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

NODES = ["dev-node-1", "dev-node-2", "dev-node-3"]
SUBNET = "172.31.254.0/24"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("nodes"), ROOT / "examples", "--nodes", "3", "--node-subnet", SUBNET
    ) as s:
        yield s


def test_pods_are_spread_over_the_nodes_with_each_node_its_own_cidr(stack: Stack) -> None:
    endpoints = stack.endpoints()
    assert set(endpoints) == {"shop/frontend", "shop/backend", "shop/db", "tools/debug"}
    nodes = {str(e["node"]) for e in endpoints.values()}
    assert len(nodes) >= 2 and nodes <= set(NODES)
    # One /24 of the pool per node: pods of different nodes never share one.
    prefixes: dict[str, set[str]] = {}
    for e in endpoints.values():
        prefixes.setdefault(str(e["node"]), set()).update(str(ip).rpartition(".")[0] for ip in e["ips"])
    for a in prefixes:
        for b in prefixes:
            assert a == b or not prefixes[a] & prefixes[b]
    listed = stack.palisade("endpoint", "list", "--node", "dev-node-1", "-o", "json")
    assert {e["node"] for e in json.loads(listed.stdout)["endpoints"]} <= {"dev-node-1"}


def test_a_pod_lands_on_the_node_its_manifest_names(stack: Stack) -> None:
    path = stack.manifests / "90-pinned.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "pinned", "namespace": "tools", "labels": {"app": "pinned"}},
                "spec": {"nodeName": "dev-node-3", "containers": [{"name": "c", "ports": [{"containerPort": 80}]}]},
            }
        )
    )
    try:
        assert wait_for(lambda: stack.endpoints().get("tools/pinned", {}).get("node") == "dev-node-3")
    finally:
        path.unlink()
    assert wait_for(lambda: "tools/pinned" not in stack.endpoints())


def test_policy_get_and_status_show_every_node(stack: Stack) -> None:
    """The shop's default deny selects pods on two or more nodes: realized on each, per node."""
    shop_nodes = {str(e["node"]) for k, e in stack.endpoints().items() if k.startswith("shop/")}
    out = stack.palisade("policy", "get", "networkpolicy", "default-deny-ingress", "-n", "shop", "-o", "json")
    assert out.returncode == 0, out.stderr
    (status,) = json.loads(out.stdout)["policies"]
    assert {n["node"] for n in status["nodes"]} == shop_nodes
    assert status["nodes_realized"] == status["nodes_total"] == len(shop_nodes) >= 2
    table = stack.palisade("policy", "get", "networkpolicy", "default-deny-ingress", "-n", "shop")
    assert all(node in table.stdout for node in shop_nodes), table.stdout
    rows = [r for r in stack.status()["services"] if r["service"] == "datapath"]
    assert sorted(r["node"] for r in rows) == NODES
    assert all(r["health"] == "SERVING" and int(r["revision"]) > 0 for r in rows), rows


def test_the_example_story_holds_across_nodes(stack: Stack) -> None:
    endpoints = stack.endpoints()
    assert endpoints["shop/frontend"]["node"] != endpoints["shop/backend"]["node"], "pick pods on two nodes"
    assert not stack.story_broken()


def test_the_story_through_cluster_ips_across_nodes(stack: Stack) -> None:
    # Every node serves every Service; the client's node translates, the backend's node judges ingress.
    def serving_nodes() -> set[str]:
        answers = json.loads(stack.palisade("service", "list", "-o", "json").stdout)["nodes"]
        return {
            a["node"]
            for a in answers
            if any((f["namespace"], f["name"]) == ("shop", "backend") for f in a.get("frontends", []))
        }

    assert wait_for(lambda: serving_nodes() == {"dev-node-1", "dev-node-2", "dev-node-3"})
    assert len({f["address"] for f in stack.frontends() if (f["namespace"], f["name"]) == ("shop", "backend")}) == 1
    assert stack.reach_service("shop/frontend", "shop/backend", 80)
    assert not stack.reach_service("tools/debug", "shop/backend", 80)
    assert stack.reach_service("shop/backend", "shop/db", 5432)
    assert not stack.reach_service("shop/frontend", "shop/db", 5432)


MATRIX_PODS = [(ns, pod) for ns in ("x", "y", "z") for pod in ("a", "b", "c")]


def _matrix_files(tmp: Path, policies: list[dict[str, object]], ips: dict[str, str] | None = None) -> Path:
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"ns": ns}}} for ns in "xyz"
    ]
    for ns, pod in MATRIX_PODS:
        doc: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": ns, "labels": {"pod": pod}},
            "spec": {"containers": [{"name": "c", "ports": [{"containerPort": 80}, {"containerPort": 81}]}]},
        }
        if ips and f"{ns}/{pod}" in ips:
            doc["status"] = {"podIP": ips[f"{ns}/{pod}"]}
        docs.append(doc)
    path = tmp / "matrix.yaml"
    path.write_text(yaml.safe_dump_all([*docs, *policies]))
    return path


MATRIX_CASES: dict[str, list[dict[str, object]]] = {
    "default deny and a pod selector": [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "deny-all", "namespace": "x"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "a-from-b", "namespace": "x"},
            "spec": {
                "podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}],
            },
        },
    ],
    "namespace selector and an egress rule": [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "from-y", "namespace": "x"},
            "spec": {
                "podSelector": {},
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 80}]}],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "z-to-x-only", "namespace": "z"},
            "spec": {
                "podSelector": {"matchLabels": {"pod": "c"}},
                "policyTypes": ["Egress"],
                "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}}]}],
            },
        },
    ],
}


def _probe_equals_analyze(stack: Stack, path: Path) -> dict[int, dict[str, dict[str, bool]]]:
    probes = ["--probe", "80/TCP", "--probe", "81/TCP"]
    measured = stack.palisade("connectivity", "probe", "-f", str(path), *probes, "--timeout", "1.5", "-o", "json")
    assert measured.returncode == 0, measured.stderr
    analyzed = stack.palisade("analyze", "-f", str(path), *probes, "-o", "json")
    assert analyzed.returncode == 0, analyzed.stderr
    got = {p["port"]: p["matrix"] for p in json.loads(measured.stdout)["probes"]}
    want = {p["port"]: p["matrix"] for p in json.loads(analyzed.stdout)["probes"]}
    assert got == want
    assert any(not allowed for row in got[80].values() for allowed in row.values()), "the case denies something"
    return got


@pytest.mark.parametrize("case", sorted(MATRIX_CASES))
def test_connectivity_probe_across_nodes_equals_analyze(stack: Stack, tmp_path: Path, case: str) -> None:
    _probe_equals_analyze(stack, _matrix_files(tmp_path, MATRIX_CASES[case]))


def test_an_ipblock_naming_pods_on_other_nodes(stack: Stack, tmp_path: Path) -> None:
    """Pods at addresses of their own nodes' pod CIDRs (the probe puts each where its address is
    routed); an ipBlock admitting two of them, both on other nodes than the pod it guards."""
    with stack.channel("ipam") as ch:
        stub = ipam_pb2_grpc.IPAMServiceStub(ch)
        cidrs = [ipaddress.ip_network(stub.GetNodeCIDR(ipam_pb2.GetNodeCIDRRequest(node=n), timeout=10).cidrs[0])
                 for n in NODES]  # fmt: skip
    # Pod i on node i mod 3, far above what IPAM hands out first.
    ips = {f"{ns}/{pod}": str(cidrs[i % 3].network_address + 200 + i) for i, (ns, pod) in enumerate(MATRIX_PODS)}
    guarded, admitted = "x/a", ["y/b", "z/c"]  # nodes 0, 1 and 2
    policy: dict[str, object] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "a-from-blocks", "namespace": "x"},
        "spec": {
            "podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [{"ipBlock": {"cidr": f"{ips[p]}/32"}} for p in admitted]}],
        },
    }
    got = _probe_equals_analyze(stack, _matrix_files(tmp_path, [policy], ips))
    assert {src for src, row in got[80].items() if row[guarded]} == {guarded, *admitted}


def check_pods_outside_every_pod_cidr_reach_across_nodes(stack: Stack, tmp: Path, hosts: list[str]) -> None:
    """Pods at addresses no node's pod CIDR holds (a manifest's status.podIP), spread over the nodes:
    each datapath routes the others' such addresses to their node (a host route per address, from
    the ipcache), so every pair answers as analyze says, and the routes go with the pods.
    ``hosts``: the nodes' network namespaces."""
    ips = {f"{ns}/{pod}": f"10.0.{i + 1}.{j + 1}" for i, ns in enumerate("xyz") for j, pod in enumerate("abc")}
    got = _probe_equals_analyze(stack, _matrix_files(tmp, MATRIX_CASES["default deny and a pod selector"], ips))
    assert got[80]["x/b"]["x/a"] and got[80]["y/a"]["z/b"], "pairs on different nodes connect"

    def host_routes() -> list[str]:
        out = []
        for host in hosts:
            cmd = ["ip", "-n", host, "-j", "route", "show", "proto", str(RTPROT_PALISADE)]
            routes = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            out += [str(r["dst"]) for r in routes if str(r["dst"]).startswith("10.0.")]
        return out

    assert wait_for(lambda: not host_routes()), host_routes()


def test_pods_outside_every_pod_cidr_reach_across_nodes(stack: Stack, tmp_path: Path) -> None:
    check_pods_outside_every_pod_cidr_reach_across_nodes(stack, tmp_path, list(_node_netns(stack).values()))


def test_a_killed_node_leaves_the_others_enforcing_and_catches_up(stack: Stack) -> None:
    endpoints = stack.endpoints()
    backend, frontend = str(endpoints["shop/backend"]["node"]), str(endpoints["shop/frontend"]["node"])
    victim = next(n for n in NODES if n not in (backend, frontend))
    child = f"datapath-{NODES.index(victim) + 1}"
    with Traffic(stack, "shop/frontend", [("shop/backend", 8080)], [("shop/db", 5432)]) as traffic:
        time.sleep(0.5)
        old = stack.kill(child)
        # Made while the node is down (or coming back): enforced on every node afterwards.
        stack.check_policy_edit()
        stack.serving_again(child, old)
        time.sleep(0.5)
    assert_clean(traffic.counts)

    # The restarted node caught up: its datapath is at the revision every other node is at.
    def caught_up() -> bool:
        status = stack.status()
        policy = stack.policy_revision(status)
        rows = [r for r in status["services"] if r["service"] == "datapath"]
        return all(r.get("synced") and int(r.get("revision") or 0) == policy for r in rows)

    assert wait_for(caught_up), stack.status()
    # It restored its endpoints, where they were.
    after = stack.endpoints()
    assert {k: (e["node"], e["ips"]) for k, e in after.items()} == {
        k: (e["node"], e["ips"]) for k, e in endpoints.items()
    }
    assert not stack.reach("tools/debug", "shop/db", 5432)


def _node_netns(stack: Stack) -> dict[str, str]:
    """Each dev node's network namespace (its "host"), as the stack named them."""
    args = devstack.parse(["--nodes", "3", "--node-subnet", SUBNET, "--run-dir", str(stack.run_dir)])
    return {host.name: host.netns for host in args.network.nodes}


def test_node_addresses_are_remote_node_elsewhere_and_host_at_home(stack: Stack) -> None:
    """Behind the shop's default deny, the pod's own node (its host: kubelet's probes) reaches it
    (allow-localhost=always); another node's host is `remote-node`, admitted only by a policy
    naming it (node addresses come from the Node objects, judged per node)."""
    backend = str(stack.endpoints()["shop/backend"]["node"])
    other = next(n for n in NODES if n != backend)
    netns = _node_netns(stack)
    ip = stack.ip("shop/backend")
    path = stack.manifests / "80-backend-from-nodes.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "cilium.io/v2",
                "kind": "CiliumClusterwideNetworkPolicy",
                "metadata": {"name": "backend-from-nodes"},
                "spec": {
                    "endpointSelector": {"matchLabels": {"app": "backend"}},
                    "ingress": [{"fromEntities": ["remote-node"], "toPorts": [{"ports": [{"port": "8080"}]}]}],
                },
            }
        )
    )
    try:
        assert probe(netns[backend], ip, 8080), "its own node's host, whatever the policy"
        assert wait_for(lambda: probe(netns[other], ip, 8080)), "another node's host is remote-node"
        assert not stack.reach("tools/debug", "shop/backend", 8080), "pods stay denied"
    finally:
        path.unlink(missing_ok=True)
    assert wait_for(lambda: not probe(netns[other], ip, 8080))
    assert probe(netns[backend], ip, 8080)


def test_each_node_routes_the_others_pod_cidrs_itself(stack: Stack) -> None:
    """The routes come from the datapaths (proto 199, via each node's address); the dev cluster
    routes nothing: the root namespace has no route to any pod CIDR."""
    args = devstack.parse(["--nodes", "3", "--node-subnet", SUBNET, "--run-dir", str(stack.run_dir)])
    with stack.channel("ipam") as ch:
        stub = ipam_pb2_grpc.IPAMServiceStub(ch)
        cidrs = {n: stub.GetNodeCIDR(ipam_pb2.GetNodeCIDRRequest(node=n), timeout=10).cidrs[0] for n in NODES}
    for host in args.network.nodes:
        out = subprocess.run(["ip", "-n", host.netns, "-j", "route", "show", "proto", str(RTPROT_PALISADE)],
                             capture_output=True, text=True, check=True)  # fmt: skip
        routes = {r["dst"]: r["gateway"] for r in json.loads(out.stdout)}
        assert routes == {cidrs[n.name]: n.address for n in args.network.nodes if n.name != host.name}
    root = subprocess.run(["ip", "-j", "route", "show"], capture_output=True, text=True, check=True)
    assert not {r["dst"] for r in json.loads(root.stdout)} & set(cidrs.values())


@contextlib.contextmanager
def _outside_world(stack: Stack, *addresses: str) -> Iterator[str]:
    """ "The internet": a namespace made here holding ``addresses`` (of 198.51.100.0/24), joined to
    tools/debug's node by a link of its own (the node at 198.51.100.1) and knowing no way back to
    any pod CIDR; yields its name."""
    node = str(stack.endpoints()["tools/debug"]["node"])
    host = _node_netns(stack)[node]
    internet = f"pal-inet-{secrets.token_hex(3)}"
    create_netns(internet)
    try:
        for args in (
            ["-n", host, "link", "add", "inet0", "type", "veth", "peer", "name", "eth0", "netns", internet],
            ["-n", host, "addr", "add", "198.51.100.1/24", "dev", "inet0"],
            ["-n", host, "link", "set", "inet0", "up"],
            *(["-n", internet, "addr", "add", f"{a}/24", "dev", "eth0"] for a in addresses),
            ["-n", internet, "link", "set", "eth0", "up"],
        ):
            subprocess.run(["ip", *args], check=True, capture_output=True)
        yield internet
    finally:
        delete_netns(internet)


def test_pods_reach_a_server_outside_the_cluster_with_their_nodes_address(stack: Stack) -> None:
    """A pod's connection to a server outside the cluster is masqueraded by its node's datapath (the
    server sees the node's address) and its replies find it."""
    with _outside_world(stack, "198.51.100.10") as internet:
        peers: list[str] = []
        with in_netns(internet, socket.socket, socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("198.51.100.10", 8443))
            server.listen(8)
            server.settimeout(15)

            def answer() -> None:
                # As a pod server does: the prober counts a connection once it reads a line.
                conn, (peer, _) = server.accept()
                with conn:
                    peers.append(peer)
                    conn.sendall(b"hello from the internet\n")

            thread = threading.Thread(target=answer)
            thread.start()
            reached = probe(stack.netns("tools/debug"), "198.51.100.10", 8443)
            thread.join(20)
            assert reached, "the handshake and the answer came back: replies found the pod"
        (peer,) = peers
        assert peer == "198.51.100.1", "the node's address, not the pod's"


#: tools/debug's egress to the outside world: a toCIDR /32 on one port, a /24 less one address on another.
CIDR_POLICY = """\
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: debug-to-outside, namespace: tools}
spec:
  endpointSelector: {matchLabels: {app: debug}}
  egress:
    - toCIDR: [198.51.100.10/32]
      toPorts: [{ports: [{port: "8443", protocol: TCP}]}]
    - toCIDRSet: [{cidr: 198.51.100.0/24, except: [198.51.100.11/32]}]
      toPorts: [{ports: [{port: "8444", protocol: TCP}]}]
"""
OUTSIDE = {"ten": "198.51.100.10", "eleven": "198.51.100.11", "twelve": "198.51.100.12"}
#: (name, port) -> allowed, by the policy above.
OUTSIDE_VERDICTS = {
    ("ten", 8443): True,  # the toCIDR /32
    ("eleven", 8443): False,
    ("twelve", 8443): False,
    ("ten", 8444): True,  # inside the /24 (its own /32 identity, selected by the /24 rule)
    ("eleven", 8444): False,  # the except
    ("twelve", 8444): True,  # the /24's own identity
}


def test_cidr_rules_to_outside_addresses_are_enforced_as_analyze_says(stack: Stack, tmp_path: Path) -> None:
    """toCIDR and toCIDRSet with an except naming addresses outside the cluster: each prefix gets a
    CIDR identity and an ipcache entry, so real packets get what `palisade analyze` says."""
    netns = stack.netns("tools/debug")
    with (
        _outside_world(stack, *OUTSIDE.values()) as internet,
        pod_server(internet, "internet", "--tcp", "8443", "--tcp", "8444"),
    ):
        targets = [
            {"id": f"{name}:{port}", "ip": OUTSIDE[name], "port": port, "protocol": "TCP"}
            for name, port in OUTSIDE_VERDICTS
        ]
        want = {f"{name}:{port}": allowed for (name, port), allowed in OUTSIDE_VERDICTS.items()}
        assert all(prober(netns, targets).values()), "without an egress policy every address is reachable"
        policy = stack.manifests / "75-debug-to-outside.yaml"
        policy.write_text(CIDR_POLICY)
        try:
            got: dict[str, bool] = {}

            def enforced() -> bool:
                got.update(prober(netns, targets))
                return got == want

            assert wait_for(enforced, 60), f"measured {got}, the policy says {want}"
            listed = stack.palisade("identity", "list", "--ipam-address", stack.address("ipam"), "-o", "json")
            assert listed.returncode == 0, listed.stderr
            for prefix in ("198.51.100.10/32", "198.51.100.11/32", "198.51.100.0/24"):
                assert prefix in listed.stdout, f"no CIDR identity of {prefix} in `palisade identity list`"
            dns = [f for name, ip in OUTSIDE.items() for f in ("--dns", f"{name}={ip}")]
            analyzed = stack.palisade(
                "analyze", "-f", str(stack.manifests), "--probe", "8443/TCP", "--probe", "8444/TCP", *dns, "-o", "json"
            )
            assert analyzed.returncode == 0, analyzed.stderr
            said = {
                f"{name}:{p['port']}": allowed
                for p in json.loads(analyzed.stdout)["probes"]
                for name, allowed in p["names"]["tools/debug"].items()
            }
            assert said == want == got
        finally:
            policy.unlink()
        assert wait_for(lambda: all(prober(netns, targets).values()), 60), "the policy's removal was not enforced"


def test_one_client_port_reaches_a_backend_on_another_node_by_cluster_ip_and_by_pod_address(stack: Stack) -> None:
    """A client on one node, its backend on another: the two paths from one bound client port, one
    after the other and side by side, TCP and UDP, lose no exchange."""
    stack.manifests.joinpath("80-reuse.yaml").write_text(tuplereuse.manifest("dev-node-1", "dev-node-2"))
    try:
        assert wait_for(lambda: stack.endpoints().get("reuse/backend", {}).get("node") == "dev-node-2", 60)
        assert wait_for(lambda: stack.endpoints().get("reuse/client", {}).get("node") == "dev-node-1", 60)
        cluster_ip = stack.cluster_ip("reuse/backend", tuplereuse.FRONT_UDP)
        counts = tuplereuse.alternate(stack.netns("reuse/client"), stack.ip("reuse/backend"), cluster_ip)
        assert counts["failed"] == 0 and counts["ok"] > 0, counts
    finally:
        stack.manifests.joinpath("80-reuse.yaml").unlink()
    assert wait_for(lambda: "reuse/client" not in stack.endpoints(), 60)


def test_zz_ctrl_c_removes_the_hosts_and_leaves_nothing_behind(stack: Stack) -> None:
    netns = _node_netns(stack)
    stack.interrupt()
    assert not [n for n in netns.values() if os.path.exists(f"/run/netns/{n}")]
    assert not [n for n in NODES if os.path.exists(f"{stack.bpffs}-{n}")]
    pods = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert not [n for n in pods if n.startswith(("pal_shop_", "pal_tools_"))]
    # Only the logs stay, to read after a crash; the next start removes them.
    assert [p.name for p in stack.run_dir.iterdir()] == ["logs"]
    assert '"service started"' in (stack.run_dir / "logs" / "policy.log").read_text()
