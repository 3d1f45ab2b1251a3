"""The four real services together, for endpoints created through the datapath API (root, bcc).

Real NATS and etcd; ``python -m services.watcher`` on an empty manifest folder (it only
publishes the synced marker), ipam, policy and datapath processes; pods created with
CreateEndpoint and explicit labels, as ``palisade connectivity probe`` and the dev node
create them. ipam joins each pod's identity reference and address into an ipcache entry
(with the pod's named ports), so the policy engine resolves named ports and ipBlocks of
these pods, and real TCP and UDP packets show exactly the allowed pairs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc, policy_pb2, policy_pb2_grpc
from services.common.labels import pod_identity_labels
from testkit.harness import ROOT, EtcdServer, NatsServer, ServiceProcess, channel, datapath_flags

pytestmark = [pytest.mark.root, pytest.mark.bcc]

NODE = "node-sys"
TCP = common_pb2.PROTOCOL_TCP
UDP = common_pb2.PROTOCOL_UDP
#: What every pod serves, and so what every probe tries: (port, protocol).
SERVED = ((80, "TCP"), (5432, "TCP"), (53, "UDP"))


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    """Two Kubernetes namespace names of this test; their pods' network namespaces are removed at the end."""
    tag = secrets.token_hex(3)
    names = (f"shop-{tag}", f"ops-{tag}")
    yield names
    for entry in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
        if any(entry.startswith(f"pal_{ns}_") for ns in names):
            subprocess.run(["ip", "netns", "del", entry], capture_output=True, check=False)


class Cluster:
    """gRPC stubs on the policy and datapath services, and the pods' servers."""

    def __init__(self, policy: str, datapath: str) -> None:
        self._channels = [
            channel(policy, "policy"),
            channel(datapath, "datapath"),
            channel(policy, "policy", "datapath"),
        ]
        self.policy = policy_pb2_grpc.PolicyServiceStub(self._channels[0])
        self.datapath = datapath_pb2_grpc.DatapathServiceStub(self._channels[1])
        #: The policy service as a datapath reaches it (Resync is theirs alone).
        self.node_policy = policy_pb2_grpc.PolicyServiceStub(self._channels[2])
        self.pods: dict[str, datapath_pb2.Endpoint] = {}
        self.servers: list[asyncio.subprocess.Process] = []

    async def close(self) -> None:
        for proc in self.servers:
            if proc.returncode is None:
                proc.terminate()
        for proc in self.servers:
            await asyncio.wait_for(proc.wait(), 10)
        for ch in self._channels:
            await ch.close()

    async def create(self, pod: dict[str, Any], namespace: dict[str, Any]) -> datapath_pb2.Endpoint:
        meta = pod["metadata"]
        labels = [
            common_pb2.Label(source=x.source, key=x.key, value=x.value) for x in pod_identity_labels(pod, namespace)
        ]
        ports = [
            datapath_pb2.ContainerPort(name=p["name"], port=p["containerPort"], protocol=_proto(p["protocol"]))
            for c in pod["spec"]["containers"]
            for p in c.get("ports", ())
        ]
        request = datapath_pb2.CreateEndpointRequest(
            namespace=meta["namespace"], pod=meta["name"], labels=labels, ports=ports
        )
        ep: datapath_pb2.Endpoint = await self.datapath.CreateEndpoint(request, timeout=60)
        self.pods[f"{ep.namespace}/{ep.pod}"] = ep
        return ep

    async def serve(self, key: str) -> None:
        """Run the dev node's pod server in the pod: TCP greets, UDP echoes."""
        ep = self.pods[key]
        cmd = [sys.executable, "-m", "services.devstack.podserver", "--netns", ep.netns, "--name", key]
        for port, proto in SERVED:
            cmd += [f"--{proto.lower()}", str(port)]
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        self.servers.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"ready", line

    async def matrix(self) -> set[tuple[str, str, int, str]]:
        """Every (source, destination, port, protocol) between different pods that gets through."""
        keys = sorted(self.pods)

        async def from_pod(src: str) -> set[tuple[str, str, int, str]]:
            targets = [
                {"id": f"{dst}|{port}|{proto}", "ip": self.pods[dst].ips[0], "port": port, "protocol": proto}
                for dst in keys
                if dst != src
                for port, proto in SERVED
            ]
            cmd = [sys.executable, "-m", "services.devstack.prober", "--netns", self.pods[src].netns]
            done = await asyncio.to_thread(
                subprocess.run,
                [*cmd, "--timeout", "1.5"],
                cwd=ROOT,
                input=json.dumps(targets),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            out = set()
            for ident, ok in json.loads(done.stdout).items():
                dst, port, proto = ident.split("|")
                if ok:
                    out.add((src, dst, int(port), proto))
            return out

        results = await asyncio.gather(*(from_pod(src) for src in keys))
        return set().union(*results)

    async def import_policies(self, *docs: dict[str, Any]) -> int:
        resp = await self.policy.ImportPolicies(
            policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump_all(docs), origin="test"), timeout=10
        )
        assert all(p.state != policy_pb2.POLICY_STATE_REJECTED for p in resp.policies), resp
        return int(resp.revision)

    async def wait(self, revision: int) -> policy_pb2.WaitForRevisionResponse:
        resp: policy_pb2.WaitForRevisionResponse = await self.policy.WaitForRevision(
            policy_pb2.WaitForRevisionRequest(revision=revision, timeout_seconds=30), timeout=40
        )
        return resp

    async def known_to_policy(self, key: str) -> bool:
        """Whether the policy service has the pod's ipcache entry (published by ipam) and its identity."""
        try:
            await self.policy.Trace(
                policy_pb2.TraceRequest(
                    source=policy_pb2.TracePeer(pod=key),
                    destination=policy_pb2.TracePeer(pod=key),
                    port=80,
                    protocol=TCP,
                ),
                timeout=5,
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True


def _proto(name: str) -> common_pb2.Protocol.ValueType:
    return {"TCP": TCP, "UDP": UDP}[name]


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {"team": name}}}


def pod(ns: str, name: str, app: str, **ports: tuple[int, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": NODE,
            "containers": [
                {
                    "name": "main",
                    "ports": [{"name": n, "containerPort": p, "protocol": proto} for n, (p, proto) in ports.items()],
                }
            ],
        },
    }


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():  # noqa: ASYNC110 - polling another process, no event to wait on
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{what} within {timeout}s") from None


@pytest.fixture
async def cluster(
    bpffs: str,
    namespaces: tuple[str, str],
    nats_server: NatsServer,
    etcd_server: EtcdServer,
    service: Callable[..., ServiceProcess],
    tmp_path: Path,
) -> AsyncIterator[Cluster]:
    common = ["--nats-url", nats_server.url, "--etcd-endpoints", etcd_server.endpoint, "--node-name", NODE]
    common += ["--log-format", "text"]
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    # A cluster CIDR of its own, so host routes never meet those of a concurrent test run.
    cidr = f"10.{random.randint(200, 249)}.0.0/16"

    def start() -> dict[str, ServiceProcess]:
        procs = {"watcher": service("watcher", *common, "--manifests", str(manifests))}
        procs["ipam"] = service("ipam", *common, "--cluster-cidrs", cidr)
        procs["policy"] = service("policy", *common)
        procs["datapath"] = service(
            "datapath",
            *common,
            *datapath_flags(procs["policy"].address, procs["ipam"].address, tmp_path / "state", bpffs),
            "--retry-backoff-max",
            "0.5",
        )
        return procs

    procs = await asyncio.to_thread(start)
    c = Cluster(procs["policy"].address, procs["datapath"].address)
    yield c
    await c.close()
    # The datapath goes first (its endpoints' namespaces are cleaned up by the namespaces fixture).
    for name in ("datapath", "policy", "ipam", "watcher"):
        assert procs[name].terminate() == 0, f"{name}:\n{procs[name].logs()[-3000:]}"


async def test_api_endpoints_enforce_named_ports_deny_rules_and_ip_blocks_with_real_packets(
    cluster: Cluster, namespaces: tuple[str, str]
) -> None:
    shop, ops = namespaces
    ns = {shop: namespace(shop), ops: namespace(ops)}
    web = f"{shop}/web"
    db = f"{shop}/db"
    probe = f"{ops}/probe"
    await cluster.create(pod(shop, "web", "web", http=(80, "TCP")), ns[shop])
    await cluster.create(pod(shop, "db", "db", pg=(5432, "TCP"), dns=(53, "UDP")), ns[shop])
    await cluster.create(pod(ops, "probe", "probe"), ns[ops])
    for key in cluster.pods:
        await cluster.serve(key)
        await eventually(functools.partial(cluster.known_to_policy, key), f"the policy service did not learn {key}")

    # shop: default deny, and db admits web on its named port "pg" only (TCP 5432).
    # ops: probe admits the whole cluster, but web is denied on UDP 53 (deny wins).
    revision = await cluster.import_policies(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny", "namespace": shop},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "db-from-web", "namespace": shop},
            "spec": {
                "podSelector": {"matchLabels": {"app": "db"}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": "pg"}]}],
            },
        },
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNetworkPolicy",
            "metadata": {"name": "probe", "namespace": ops},
            "spec": {
                "endpointSelector": {"matchLabels": {"app": "probe"}},
                "ingress": [{"fromEntities": ["cluster"]}],
                "ingressDeny": [
                    {
                        "fromEndpoints": [{"matchLabels": {"app": "web", "k8s:io.kubernetes.pod.namespace": shop}}],
                        "toPorts": [{"ports": [{"port": "53", "protocol": "UDP"}]}],
                    }
                ],
            },
        },
    )
    waited = await cluster.wait(revision)
    assert waited.realized, waited
    allowed = {
        (web, db, 5432, "TCP"),
        (web, probe, 80, "TCP"),
        (web, probe, 5432, "TCP"),
        (db, probe, 80, "TCP"),
        (db, probe, 5432, "TCP"),
        (db, probe, 53, "UDP"),
    }
    assert await cluster.matrix() == allowed

    # An ipBlock of probe's /32 selects probe by its address: web now admits it on TCP 80.
    probe_ip = cluster.pods[probe].ips[0]
    revision = await cluster.import_policies(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "web-from-probe-ip", "namespace": shop},
            "spec": {
                "podSelector": {"matchLabels": {"app": "web"}},
                "ingress": [{"from": [{"ipBlock": {"cidr": f"{probe_ip}/32"}}], "ports": [{"port": 80}]}],
            },
        }
    )
    assert (await cluster.wait(revision)).realized
    assert await cluster.matrix() == allowed | {(probe, web, 80, "TCP")}

    # What the kernel map holds is what PolicyService says the identity's policy is.
    web_ep = cluster.pods[web]
    got = await cluster.datapath.GetPolicyMap(
        datapath_pb2.GetPolicyMapRequest(endpoint=datapath_pb2.GetEndpointRequest(id=web_ep.id)), timeout=10
    )
    resync = await cluster.node_policy.Resync(
        policy_pb2.ResyncRequest(node=NODE, identities=[web_ep.identity]), timeout=10
    )
    (want,) = [p for p in resync.policies if p.identity == web_ep.identity]
    assert _entries(got.entries) == _entries(want.entries)
    assert (got.enforcement.ingress, got.enforcement.egress) == (want.enforcement.ingress, want.enforcement.egress)
    assert got.revision >= revision and (probe_entry := _peer_entries(got.entries, cluster.pods[probe].identity))
    assert {(e.key.protocol, e.key.port_low) for e in probe_entry} == {(TCP, 80)}

    # A deleted endpoint never holds up a later revision, even one that changes its identity's policy.
    await cluster.datapath.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=cluster.pods[probe].id), timeout=30)
    del cluster.pods[probe]
    deleted = await cluster.policy.DeletePolicy(
        policy_pb2.DeletePolicyRequest(
            ref=common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace=ops, name="probe"),
            source=policy_pb2.POLICY_SOURCE_API,
        ),
        timeout=10,
    )
    waited = await cluster.wait(deleted.revision)
    assert waited.realized and not waited.behind, waited
    listed = await cluster.datapath.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10)
    assert sorted(f"{e.namespace}/{e.pod}" for e in listed.endpoints) == [db, web]
    assert all(e.realized_revision >= deleted.revision for e in listed.endpoints)


def _entries(entries: Any) -> set[bytes]:
    return {e.SerializeToString(deterministic=True) for e in entries}


def _peer_entries(entries: Any, identity: int) -> list[common_pb2.PolicyEntry]:
    return [e for e in entries if e.key.remote_identity == identity]
