"""Cross-node cost: TCP throughput and 64-byte UDP rate between pods on two dev nodes, with Palisade's
programs and without, in both routing modes.

    sudo .venv/bin/python -m bench.bench_cross_node            # about 4 minutes
    sudo .venv/bin/python -m bench.bench_cross_node --quick    # about 1 minute, a smoke run

For each routing mode (``direct``: the nodes share a bridge and each datapath routes the other's
pod CIDR via its address; ``tunnel``: each node on a network of its own behind a router, joined by
the datapaths' kernel VXLAN device), a two-node `make run --nodes 2 --routing MODE` is started, and
two pairs of pods are made, a client on dev-node-1 and a server on dev-node-2 in each pair:

- ``palisade``: Palisade's pods (Pod manifests in the stack's folder, made by the dev nodes through
  their datapaths), their traffic judged by Palisade's programs at tc on both host veths: the
  client's egress and the server's ingress are enforced by policies that allow the measured port
  (and, checked before measuring, drop another one);
- ``bare``: the baseline, two namespaces made on the same two nodes with the same wiring
  (:func:`services.datapath.netns.create_pod`: veth, /32 route, static neighbours) at addresses
  ipam reserves in the same nodes' pod CIDRs, so their packets take the very same node routes,
  bridge or VXLAN device, masquerade rules and kernel paths, with no Palisade program on either veth.

Why this baseline: it differs from the measured path by the programs and nothing else. Detaching
the programs from Palisade's own pods would fight the running datapath (which keeps its endpoints
as it wants them), and a policy-free Palisade pod still runs every program (conntrack, ipcache),
which would hide the cost to be measured.

Every round measures each pair once, in forward order on even rounds and backward on odd ones, so
a drift of the machine hits both alike; metrics are medians over rounds, ratios ``palisade / bare``
of those medians, and per-round paired ratios. Samples are noisy on a small shared machine (other
processes use the CPU; the load average is in the output).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.output import logger, stdout_reserved_for_json
from bench.roles import IPERF_PORT, Server, iperf
from bench.stats import median, quartiles, round_to

MODES = ("direct", "tunnel")
#: Each mode's node subnet: its own, so the run shares no address with other dev clusters.
SUBNETS = {"direct": "172.31.236.0/24", "tunnel": "172.31.232.0/24"}
CLIENT_NODE, SERVER_NODE = "dev-node-1", "dev-node-2"
VARIANTS = ("palisade", "bare")
#: A port the server's pod serves and no policy allows: the enforcement check.
DENIED_PORT = 8080
METRICS: dict[str, dict[str, str]] = {
    "tcp_throughput": {"label": "TCP throughput", "unit": "Gbit/s"},
    "udp_64b_rate": {"label": "64-byte UDP rate", "unit": "packets/s"},
}


log = logger("cross-node")


def manifests() -> list[dict[str, Any]]:
    """Namespace ``bench``, its client and server pods (one per node), and the policies that enforce them."""

    def pod(name: str, node: str, ports: list[int]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "bench", "labels": {"app": name}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "ports": [{"containerPort": p} for p in ports]}]},
        }

    allowed = [{"port": str(IPERF_PORT), "protocol": proto} for proto in ("TCP", "UDP")]
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}},
        pod("client", CLIENT_NODE, []),
        pod("server", SERVER_NODE, [DENIED_PORT]),
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNetworkPolicy",
            "metadata": {"name": "server-from-client", "namespace": "bench"},
            "spec": {
                "endpointSelector": {"matchLabels": {"app": "server"}},
                "ingress": [{"fromEndpoints": [{"matchLabels": {"app": "client"}}], "toPorts": [{"ports": allowed}]}],
            },
        },
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNetworkPolicy",
            "metadata": {"name": "client-to-server", "namespace": "bench"},
            "spec": {
                "endpointSelector": {"matchLabels": {"app": "client"}},
                "egress": [{"toEndpoints": [{"matchLabels": {"app": "server"}}], "toPorts": [{"ports": allowed}]}],
            },
        },
    ]


def stack_args(mode: str) -> tuple[str, ...]:
    """`make run`'s arguments for a two-node cluster routed by ``mode``."""
    return ("--nodes", "2", "--node-subnet", SUBNETS[mode], "--routing", mode)


@dataclass(frozen=True)
class Pair:
    """A client namespace and the server address it measures against."""

    client_netns: str
    server_ip: str
    server: Server


def node_netns(stack: Any, mode: str) -> dict[str, str]:
    """Each dev node's network namespace (its host), as the stack named them."""
    from services.devstack import __main__ as devstack

    network = devstack.parse([*stack_args(mode), "--run-dir", str(stack.run_dir)]).network
    return {n.name: n.netns for n in network.nodes}


@contextmanager
def bare_pair(stack: Any, mode: str, run_id: str) -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces wired as Palisade wires pods, on the client's and the server's nodes, at addresses
    ipam reserves in their pod CIDRs; no program on their veths. Yields (client ns, client ip, server
    ns, server ip); removed (and the addresses released) at the end."""
    from palisade.v1 import ipam_pb2, ipam_pb2_grpc
    from services.cli.client import dial_target
    from services.common.grpcserver import open_sync_channel
    from services.common.trust import Credentials
    from services.datapath import netns

    hosts = node_netns(stack, mode)
    made: list[tuple[str, Any]] = []
    reserved: list[tuple[str, str]] = []
    # Reserving addresses is a node agent's call: the bench makes it as the datapaths do, with their certificate.
    creds = Credentials.load(stack.tls_dir, "datapath")
    with open_sync_channel(dial_target(stack.address("ipam")), "ipam", creds) as ch:
        ipam = ipam_pb2_grpc.IPAMServiceStub(ch)
        try:
            ends: list[tuple[str, str]] = []
            for role, node in (("c", CLIENT_NODE), ("s", SERVER_NODE)):
                owner = f"bench/bare-{role}-{run_id}"
                req = ipam_pb2.AllocateIPRequest(node=node, owner=owner, family=ipam_pb2.FAMILY_IPV4)
                ip = ipam.AllocateIP(req, timeout=30).ip
                reserved.append((node, ip))
                name = f"pal_bxn{role}{run_id}"
                link = netns.in_netns(hosts[node], netns.create_pod, name, name, [ip])
                made.append((hosts[node], link))
                ends.append((name, ip))
            yield ends[0][0], ends[0][1], ends[1][0], ends[1][1]
        finally:
            for host, link in reversed(made):
                netns.in_netns(host, netns.delete_pod, link)
            for node, ip in reserved:
                ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node=node, ip=ip), timeout=30)


def _programs_on(ifname: str) -> int:
    """How many Palisade programs run on the hooks of ``ifname`` (in the calling thread's namespace)."""
    import socket

    from services.datapath.loader import Loader

    return Loader("/nonexistent").attachment(socket.if_nametoindex(ifname)).programs


def programs(host_netns: str, ifname: str) -> int:
    """Palisade programs on interface ``ifname`` of node namespace ``host_netns``, as the kernel lists them."""
    from services.datapath import netns

    return netns.in_netns(host_netns, _programs_on, ifname)


def _realized(stack: Any, name: str) -> bool:
    out = stack.palisade("policy", "get", "ciliumnetworkpolicy", name, "-n", "bench", "-o", "json")
    if out.returncode != 0:
        return False
    rows = json.loads(out.stdout).get("policies") or []
    return bool(rows) and all(r.get("nodes_total") and r.get("nodes_realized") == r.get("nodes_total") for r in rows)


def measure_mode(mode: str, args: argparse.Namespace, run_id: str) -> dict[str, Any]:
    from testkit.stack import probe, running_stack, wait_for

    with tempfile.TemporaryDirectory(prefix=f"palisade-bench-cross-{mode}-") as tmp:
        folder = Path(tmp) / "examples"
        folder.mkdir()
        (folder / "bench.yaml").write_text(yaml.safe_dump_all(manifests()))
        with running_stack(Path(tmp), folder, *stack_args(mode)) as stack, ExitStack() as cleanup:
            log(f"{mode}: 2 nodes up")
            policies = ("server-from-client", "client-to-server")
            if not wait_for(lambda: all(_realized(stack, p) for p in policies), 60):
                raise RuntimeError(f"{mode}: the policies were not realized on their nodes")
            endpoints = {
                f"{e['namespace']}/{e['pod']}": e
                for e in json.loads(stack.palisade("endpoint", "list", "-o", "json").stdout)["endpoints"]
            }
            client, server = endpoints["bench/client"], endpoints["bench/server"]
            assert (client["node"], server["node"]) == (CLIENT_NODE, SERVER_NODE), (client["node"], server["node"])
            bare_client, _, bare_server, bare_server_ip = cleanup.enter_context(bare_pair(stack, mode, run_id))
            iperf_server = ["iperf3", "-s", "-p", str(IPERF_PORT)]
            servers = {
                "palisade": Server("iperf3 server", os.path.basename(server["netns"]), iperf_server),
                "bare": Server("iperf3 server", bare_server, iperf_server),
            }
            for srv in servers.values():
                cleanup.callback(srv.stop)
                srv.start()
            pairs = {
                "palisade": Pair(os.path.basename(client["netns"]), str(server["ips"][0]), servers["palisade"]),
                "bare": Pair(bare_client, bare_server_ip, servers["bare"]),
            }
            # Enforcement is on: the server's other port (its pod serves it, no policy allows it) is
            # dropped on this path. The measured port works on both: every sample is a completed iperf3 run.
            # And the two paths differ by the programs only: two on each Palisade veth, none on the bare ones.
            hosts = node_netns(stack, mode)
            veths = {
                "palisade": [(hosts[e["node"]], str(e["host_ifname"])) for e in (client, server)],
                "bare": [(hosts[CLIENT_NODE], bare_client), (hosts[SERVER_NODE], bare_server)],
            }
            counts = {v: [programs(h, i) for h, i in veths[v]] for v in VARIANTS}
            checks = {
                "palisade-denied-port-dropped": not probe(client["netns"], str(server["ips"][0]), DENIED_PORT),
                "palisade-veths-run-both-programs": counts["palisade"] == [2, 2],
                "bare-veths-run-none": counts["bare"] == [0, 0],
            }
            samples: dict[str, dict[str, list[float]]] = {v: {m: [] for m in METRICS} for v in VARIANTS}
            for r in range(args.rounds):
                order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
                for variant in order:
                    pair = pairs[variant]
                    for metric in METRICS:
                        got = iperf(
                            pair.client_netns,
                            pair.server_ip,
                            args.seconds,
                            udp=metric == "udp_64b_rate",
                            server=pair.server,
                        )
                        samples[variant][metric].append(got["value"])
                log(f"{mode}: round {r + 1}/{args.rounds} done")
    return {"samples": samples, "checks": checks}


def analyse(mode: str, data: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    samples = data["samples"]
    medians = {v: {m: round_to(median(samples[v][m])) for m in METRICS} for v in VARIANTS}
    ratios = {
        m: round_to(medians["palisade"][m] / medians["bare"][m], 3) if medians["bare"][m] else 0.0 for m in METRICS
    }
    paired = {
        m: [round_to(p / b, 3) for p, b in zip(samples["palisade"][m], samples["bare"][m], strict=True) if b]
        for m in METRICS
    }
    label = "direct routing" if mode == "direct" else "VXLAN tunnel"
    rows: list[dict[str, Any]] = []
    for m, info in METRICS.items():
        rows.append({"metric": f"cross-node {info['label']}, {label}, Palisade / no program", "value": ratios[m],
                     "unit": "ratio"})  # fmt: skip
        for variant, what in (("palisade", "Palisade"), ("bare", "no program")):
            rows.append({"metric": f"cross-node {info['label']}, {label}, {what}", "value": medians[variant][m],
                         "unit": info["unit"]})  # fmt: skip
    out = {
        "medians": medians,
        "ratios": ratios,
        "paired_ratios": paired,
        "paired_ratio_quartiles": {m: quartiles(paired[m]) for m in METRICS},
        "samples": samples,
        "checks": data["checks"],
    }
    return out, rows


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    run_id = os.urandom(2).hex()
    result: dict[str, Any] = {
        "config": {
            "rounds": args.rounds,
            "seconds": args.seconds,
            "modes": list(args.modes),
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "baseline": "bare namespaces on the same nodes, same wiring and routes, no Palisade program",
        },
        "modes": {},
        "summary": [],
        "plots": [],
    }
    for mode in args.modes:
        out, rows = analyse(mode, measure_mode(mode, args, run_id))
        result["modes"][mode] = out
        result["summary"] += rows
    checks = {f"{mode}/{k}": v for mode, out in result["modes"].items() for k, v in out["checks"].items()}
    result["checks_passed"] = all(checks.values())
    result["summary"].append({"metric": "enforcement checks passed", "value": sum(checks.values()),
                              "unit": f"of {len(checks)}"})  # fmt: skip
    if not result["checks_passed"]:
        result["error"] = "checks failed: " + ", ".join(k for k, v in checks.items() if not v)
    result["config"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["run_seconds"] = round(time.monotonic() - started, 1)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 1-second samples")
    p.add_argument("--rounds", type=int, default=None, help="rounds per mode (default 8; even balances the order)")
    p.add_argument("--seconds", type=int, default=None, help="seconds per sample (iperf3 -t) (default 3)")
    p.add_argument("--modes", type=lambda s: tuple(s.split(",")), default=MODES, help="comma-separated (default both)")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 8
    if args.seconds is None:
        args.seconds = 1 if args.quick else 3
    if args.rounds < 1 or args.seconds < 1:
        p.error("--rounds and --seconds must be positive")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = None
    if os.geteuid() != 0:
        problem = "needs root (network namespaces, BPF)"
    elif shutil.which("iperf3") is None:
        problem = "iperf3 is not installed"
    if problem:
        print(json.dumps({"error": problem}))
        return 2
    with stdout_reserved_for_json() as out_fd:
        result = run_bench(args)
        with os.fdopen(os.dup(out_fd), "w") as out:
            out.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
