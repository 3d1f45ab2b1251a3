"""`palisade connectivity probe`: the analyze matrix, measured with real packets.

Creates the pods of the given manifests as network namespaces on the dev nodes (through
each node's datapath: a pod goes to the node its spec.nodeName names, the others in turn,
so that most pairs cross nodes; at the addresses their status.podIP/podIPs give, so that
ipBlocks naming them judge what `palisade analyze` judges: an address inside a node's pod
CIDR puts the pod on that node, where the cluster routes it; one outside every pod CIDR is
reserved anyway, and the datapaths route it to its node with a host route), imports the
policies through the policy service, waits until their revision is realized, probes
every pod pair on each port/protocol, prints the matrix, and cleans up. Policies that
are already in the running system apply as well; run it on a stack without other
policies to compare it with `palisade analyze` on the same files.

With --via-services every pod also gets a ClusterIP Service on the probed ports (applied to
the dev cluster's manifest folder, its API server, with an EndpointSlice naming exactly that
pod, as the slice controller keeps for a selector that matches it alone; a label added to
select it would change its identity), and every pair is probed through the destination's
ClusterIP, as upstream's NetworkPolicy e2e tests do: policy judges the backend pod.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml

from palisade.v1 import (
    common_pb2,
    datapath_pb2,
    datapath_pb2_grpc,
    ipam_pb2,
    ipam_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from services.cli.analyze import load_documents
from services.cli.client import (
    CLIError,
    add_address_flags,
    call,
    channel,
    manifest_folder,
    node_channels,
    print_json,
    progress,
    run,
)
from services.common.labels import pod_identity_labels
from services.common.manifests import Document
from services.policy.engine.analyze import AnalyzeError, Probe, build_model
from services.policy.engine.parse import POLICY_KINDS

PROTOCOLS = {"TCP": common_pb2.PROTOCOL_TCP, "UDP": common_pb2.PROTOCOL_UDP, "SCTP": common_pb2.PROTOCOL_SCTP}


def _pods(docs: list[Document]) -> tuple[list[Document], dict[str, Any]]:
    namespaces = {str(d.body["metadata"]["name"]): d.body for d in docs if d.body.get("kind") == "Namespace"}
    return [d for d in docs if d.body.get("kind") == "Pod"], namespaces


def _ports(body: Mapping[str, Any], probes: list[Probe]) -> list[datapath_pb2.ContainerPort]:
    out = []
    for c in (body.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            proto = PROTOCOLS.get(str(p.get("protocol") or "TCP").upper(), common_pb2.PROTOCOL_TCP)
            out.append(
                datapath_pb2.ContainerPort(name=str(p.get("name") or ""), port=int(p["containerPort"]), protocol=proto)
            )
    return out


def _given_ips(body: Mapping[str, Any]) -> list[str]:
    status = body.get("status") or {}
    ips = [str(status["podIP"])] if status.get("podIP") else []
    ips += [str(p["ip"]) for p in status.get("podIPs") or [] if p.get("ip") and str(p["ip"]) not in ips]
    return ips


@contextmanager
def _servers(endpoints: dict[str, datapath_pb2.Endpoint], probes: list[Probe]) -> Iterator[None]:
    """A server on every probed port in every pod, so a failed probe means policy, not a closed port."""
    procs = []
    try:
        for key, ep in endpoints.items():
            cmd = [sys.executable, "-m", "services.devstack.podserver", "--netns", ep.netns, "--name", key]
            for pr in probes:
                cmd += [f"--{pr.protocol.name.lower()}", str(pr.port)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise CLIError("a pod server did not start; see the messages above")
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(5)


def _probe_all(
    endpoints: dict[str, datapath_pb2.Endpoint],
    probes: list[Probe],
    timeout: float,
    targets_by_pod: Mapping[str, str] | None = None,
) -> list[dict[str, dict[str, bool]]]:
    """Every pair on every probe; ``targets_by_pod`` gives the address to dial per destination
    (its ClusterIP), else its first pod address."""
    keys = sorted(endpoints)
    results: dict[tuple[int, str, str], bool] = {}
    procs = []
    for src in keys:
        targets = []
        for i, pr in enumerate(probes):
            for dst in keys:
                if dst == src:
                    continue  # a pod reaching itself never leaves its namespace: always allowed
                ip = targets_by_pod[dst] if targets_by_pod else endpoints[dst].ips[0]
                targets.append({"id": f"{i}|{dst}", "ip": ip, "port": pr.port, "protocol": pr.protocol.name})
        cmd = [
            sys.executable,
            "-m",
            "services.devstack.prober",
            "--netns",
            endpoints[src].netns,
            "--timeout",
            str(timeout),
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(targets))
        proc.stdin.close()
        procs.append((src, proc))
    for src, proc in procs:
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.read(), proc.stderr.read()
        if proc.wait() != 0:
            raise CLIError(f"probing from {src} failed: {err.strip()}")
        for ident, ok in json.loads(out).items():
            i, dst = ident.split("|", 1)
            results[(int(i), src, dst)] = bool(ok)
    return [{s: {d: True if s == d else results[(i, s, d)] for d in keys} for s in keys} for i in range(len(probes))]


class ProbeRun:
    """Pods of the files on the local node, their policies enforced, every pair probed; undone at close.

    The command does one round; a caller may enforce several policy sets in turn on the same pods
    (:meth:`enforce`, :meth:`probe`, :meth:`withdraw`), as the conformance tests do.
    """

    def __init__(
        self,
        datapath: datapath_pb2_grpc.DatapathServiceStub | Mapping[str, datapath_pb2_grpc.DatapathServiceStub],
        policy: policy_pb2_grpc.PolicyServiceStub,
        *,
        timeout: float = 2.0,
        wait_timeout: float = 60.0,
        cidrs: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        #: Each node's datapath, by node name (one unnamed node when given a single datapath).
        self.datapaths = dict(datapath) if isinstance(datapath, Mapping) else {"": datapath}
        #: Each node's pod CIDRs: a pod whose given addresses lie in one goes to that node.
        self.cidrs = {node: [ipaddress.ip_network(c) for c in nets] for node, nets in (cidrs or {}).items()}
        self.policy = policy
        self.timeout = timeout
        self.wait_timeout = wait_timeout
        self.endpoints: dict[str, datapath_pb2.Endpoint] = {}
        self._nodes: dict[str, str] = {}
        self.imported: list[common_pb2.ObjectRef] = []
        #: pod -> its Service's ClusterIP, once :meth:`expose` made them.
        self.cluster_ips: dict[str, str] = {}
        self._services_file: Path | None = None

    def create_pods(self, docs: list[Document], probes: list[Probe]) -> None:
        """Each Pod of ``docs`` as an endpoint, at the addresses its status gives."""
        pods, namespaces = _pods(docs)
        nodes = sorted(self.datapaths)
        for i, doc in enumerate(pods):
            body = doc.body
            ns = str(body["metadata"].get("namespace") or "default")
            key = f"{ns}/{body['metadata']['name']}"
            # The node whose pod CIDR holds the pod's given addresses (in the pool: routed there),
            # else the node the pod names, else the next in turn: most pairs then cross nodes.
            given = _given_ips(body)
            home = self._home(given)
            named = str((body.get("spec") or {}).get("nodeName") or "")
            node = home or (named if named in self.datapaths else nodes[i % len(nodes)])
            labels = [
                common_pb2.Label(source=lb.source, key=lb.key, value=lb.value)
                for lb in pod_identity_labels(body, namespaces.get(ns))
            ]
            req = datapath_pb2.CreateEndpointRequest(
                namespace=ns,
                pod=str(body["metadata"]["name"]),
                labels=labels,
                ports=_ports(body, probes),
                # The addresses the files give (status.podIP/podIPs), wherever they lie, so that
                # ipBlocks naming them judge the same packets analyze judges; IPAM picks the rest.
                ips=given,
                outside_pool=bool(given) and home is None,
            )
            self.endpoints[key] = call("datapath", self.datapaths[node].CreateEndpoint, req, timeout=60)
            self._nodes[key] = node

    def _home(self, ips: list[str]) -> str | None:
        """The node whose pod CIDRs hold every address of ``ips`` (None: none does, or no addresses)."""
        if not ips:
            return None
        for node, nets in self.cidrs.items():
            if node in self.datapaths and all(any(ipaddress.ip_address(ip) in n for n in nets) for ip in ips):
                return node
        return None

    def enforce(self, policy_docs: list[Mapping[str, Any]], origin: str = "connectivity probe") -> None:
        """Import ``policy_docs`` through the API and wait until every endpoint enforces them."""
        if not policy_docs:
            return
        req = policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump_all(policy_docs), origin=origin)
        resp = call("policy", self.policy.ImportPolicies, req)
        self.imported += [s.ref for s in resp.policies if s.state != policy_pb2.POLICY_STATE_REJECTED]
        rejected = [s for s in resp.policies if s.state == policy_pb2.POLICY_STATE_REJECTED]
        if rejected:
            raise CLIError("; ".join(s.error for s in rejected), 2)
        self._wait(resp.revision)

    def withdraw(self, *, wait: bool = True) -> None:
        """Delete the imported policies (and, with ``wait``, until no endpoint enforces them)."""
        revision = 0
        for ref in self.imported:
            req = policy_pb2.DeletePolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API)
            try:
                revision = max(revision, self.policy.DeletePolicy(req, timeout=30).revision)
            except grpc.RpcError as err:
                print(f"warning: policy {ref.name} not deleted: {err.details()}", file=sys.stderr)
        self.imported = []
        if wait:
            self._wait(revision)

    def _wait(self, revision: int) -> None:
        if not revision:
            return
        request = policy_pb2.WaitForRevisionRequest(revision=revision, timeout_seconds=self.wait_timeout)
        with progress(f"waiting for revision {revision} to be enforced"):
            wait = call("policy", self.policy.WaitForRevision, request, timeout=self.wait_timeout + 10)
        if not wait.realized:
            behind = ", ".join(f"{e.node}/{e.pod or e.endpoint_id}" for e in wait.behind[:5])
            raise CLIError(f"revision {revision} not realized after {self.wait_timeout:g}s; behind: {behind}")

    def probe(self, probes: list[Probe]) -> list[dict[str, dict[str, bool]]]:
        """One matrix per probe: row = source, column = destination (through ClusterIPs once exposed)."""
        return _probe_all(self.endpoints, probes, self.timeout, self.cluster_ips or None)

    def expose(self, folder: Path, probes: list[Probe]) -> dict[str, str]:
        """A ClusterIP Service per pod on the probed ports; returns pod -> ClusterIP once every node serves them."""
        docs: list[dict[str, Any]] = []
        names: dict[tuple[str, str], str] = {}
        ports = [
            {"name": f"p{pr.port}-{pr.protocol.name.lower()}", "port": pr.port, "protocol": pr.protocol.name}
            for pr in probes
        ]
        for key, ep in sorted(self.endpoints.items()):
            ns, pod = key.split("/", 1)
            name = f"probe-{pod}"[:63].rstrip("-")
            names[(ns, name)] = key
            service_ports = [{**p, "targetPort": p["port"]} for p in ports]
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": name, "namespace": ns, "labels": {"palisade.io/probe": "true"}},
                    "spec": {"type": "ClusterIP", "ports": service_ports},
                }
            )
            v4 = [ip for ip in ep.ips if ipaddress.ip_address(ip).version == 4]
            docs.append(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"{name}-probe",
                        "namespace": ns,
                        "labels": {"kubernetes.io/service-name": name},
                    },
                    "addressType": "IPv4",
                    "ports": ports,
                    "endpoints": [
                        {
                            "addresses": v4[:1],
                            "conditions": {"ready": True},
                            "nodeName": self._nodes[key],
                            "targetRef": {"kind": "Pod", "namespace": ns, "name": pod},
                        }
                    ],
                }
            )
        self._services_file = folder / f"zz-connectivity-probe-{secrets.token_hex(3)}.yaml"
        self._services_file.write_text(yaml.safe_dump_all(docs))
        deadline = time.monotonic() + self.wait_timeout
        with progress(f"waiting for {len(names)} Services on every node"):
            while True:
                found = self._served(names, len(ports))
                if found is not None:
                    self.cluster_ips = found
                    return found
                if time.monotonic() > deadline:
                    raise CLIError(
                        f"the probe's Services were not served on every node within {self.wait_timeout:g}s: "
                        "does the stack's watcher read this manifest folder and give Services ClusterIPs "
                        "(`make run` does)?"
                    )
                time.sleep(0.1)

    def _served(self, names: Mapping[tuple[str, str], str], port_count: int) -> dict[str, str] | None:
        """pod -> ClusterIP if every node serves every probe Service with its backend, else None."""
        ips: dict[str, str] = {}
        for stub in self.datapaths.values():
            answer = call("datapath", stub.ListServices, datapath_pb2.ListServicesRequest())
            ready: dict[tuple[str, str], list[str]] = {}
            for f in answer.frontends:
                if (f.namespace, f.name) in names and len(f.backends) == 1:
                    ready.setdefault((f.namespace, f.name), []).append(f.address)
            for ref, pod in names.items():
                addresses = ready.get(ref, [])
                if len(addresses) != port_count or len(set(addresses)) != 1:
                    return None
                ips[pod] = addresses[0]
        return ips

    def servers(self, probes: list[Probe]) -> AbstractContextManager[None]:
        return _servers(self.endpoints, probes)

    def close(self) -> None:
        self.withdraw(wait=False)
        if self._services_file is not None:
            self._services_file.unlink(missing_ok=True)
            self._services_file = None
            self.cluster_ips = {}
        for key, ep in self.endpoints.items():
            try:
                self.datapaths[self._nodes[key]].DeleteEndpoint(
                    datapath_pb2.DeleteEndpointRequest(id=ep.id), timeout=30
                )
            except grpc.RpcError as err:
                print(f"warning: pod {key} not deleted: {err.details()}", file=sys.stderr)
        self.endpoints = {}
        self._nodes = {}


@run
def cmd_probe(args: argparse.Namespace) -> int:
    try:
        probes = [Probe.parse(p) for p in args.probes]
        docs = load_documents(args.paths)
        model = build_model(docs)  # refuses what analyze refuses, before anything is created
    except AnalyzeError as err:
        raise CLIError(str(err), 2) from None
    host_network = sorted(key for key, pod in model.pods.items() if pod.host_network)
    if host_network:
        raise CLIError(
            f"pods {', '.join(host_network)}: spec.hostNetwork: a probe makes every pod an endpoint of its own, "
            "which a host-network pod is not; leave them out (`palisade analyze` models them as their node)",
            2,
        )
    pods, _ = _pods(docs)
    policy_docs = [d.body for d in docs if d.body.get("kind") in POLICY_KINDS]
    started = time.monotonic()
    with ExitStack() as stack:
        datapaths = {
            node: datapath_pb2_grpc.DatapathServiceStub(ch)
            for node, ch in stack.enter_context(node_channels(args)).items()
        }
        policy = policy_pb2_grpc.PolicyServiceStub(stack.enter_context(channel(args, "policy")))
        cidrs: dict[str, list[str]] = {}
        if len(datapaths) > 1:
            ipam = ipam_pb2_grpc.IPAMServiceStub(stack.enter_context(channel(args, "ipam")))
            for node in datapaths:
                cidrs[node] = list(call("ipam", ipam.GetNodeCIDR, ipam_pb2.GetNodeCIDRRequest(node=node)).cidrs)
        probe_run = ProbeRun(datapaths, policy, timeout=args.timeout, wait_timeout=args.wait_timeout, cidrs=cidrs)
        try:
            with progress(f"creating {len(pods)} pods"):
                probe_run.create_pods(docs, probes)
            if args.via_services:
                probe_run.expose(manifest_folder(args), probes)
            probe_run.enforce(policy_docs)
            with probe_run.servers(probes), progress("probing every pod pair"):
                matrices = probe_run.probe(probes)
            pod_count = len(probe_run.endpoints)
        finally:
            probe_run.close()
    payload = {
        "probes": [
            {"port": pr.port, "protocol": pr.protocol.name, "matrix": m} for pr, m in zip(probes, matrices, strict=True)
        ]
    }
    if args.output == "json":
        print_json(payload)
    else:
        for entry in payload["probes"]:
            matrix = entry["matrix"]
            assert isinstance(matrix, dict)
            print(f"Probe {entry['port']}/{entry['protocol']} (row = source, column = destination)")
            keys = list(matrix)
            width = max([len(k) for k in keys] + [4])
            print(" " * width + " | " + " ".join(k.ljust(width) for k in keys))
            for s in keys:
                print(s.ljust(width) + " | " + " ".join(("yes" if matrix[s][d] else "-").ljust(width) for d in keys))
            print()
        print(f"{pod_count} pods, {len(probes)} probes, {time.monotonic() - started:.1f}s")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("connectivity", help="measure connectivity with real packets")
    csub = p.add_subparsers(dest="connectivity_command", metavar="COMMAND", required=True)
    probe = csub.add_parser(
        "probe",
        help="create the manifests' pods on the dev nodes, enforce their policies, probe every pair",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    probe.add_argument("-f", "--filename", dest="paths", action="append", required=True, metavar="PATH")
    probe.add_argument("--probe", dest="probes", action="append", required=True, metavar="PORT/PROTO")
    probe.add_argument("-o", "--output", choices=("table", "json"), default="table")
    probe.add_argument("--timeout", type=float, default=2.0, help="seconds before a probe counts as denied")
    probe.add_argument("--wait-timeout", type=float, default=60.0, help="seconds to wait for enforcement")
    probe.add_argument(
        "--via-services",
        action="store_true",
        help="give every pod a ClusterIP Service on the probed ports and probe through the ClusterIPs",
    )
    probe.add_argument(
        "--manifests",
        default=None,
        metavar="DIR",
        help="with --via-services: the manifest folder the stack's watcher reads (env PALISADE_MANIFESTS; "
        "default the one `make run` reads)",
    )
    add_address_flags(probe, "datapath", "policy", "ipam")
    probe.set_defaults(func=cmd_probe)
