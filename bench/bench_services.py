"""Services benchmark: a ClusterIP load-balanced in BPF vs. the pod IP directly vs. kube-proxy's iptables DNAT.

Run as root on a machine with bcc, iperf3 and iptables:

    .venv/bin/python -m bench.bench_services            # about 6 minutes
    .venv/bin/python -m bench.bench_services --quick    # about 1.5 minutes, a smoke run

Two pods (network namespaces routed through the host, as Palisade wires pods) with
Palisade's programs attached to both host veths (no policy enforced: what is measured is
the service translation). Variants, all measured in one run, interleaved (forward order
on even rounds, backward on odd ones, so a drift of the machine hits every variant alike):

- ``direct``: the client dials the server pod's address;
- ``clusterip-N``: the client dials a ClusterIP that Palisade's programs translate to the
  server pod (DNAT at the client's veth, reverse NAT of the replies), while the service
  maps hold N frontends in all;
- ``iptables-N``: the client dials the same ClusterIP, which kube-proxy-style iptables
  rules translate instead (nat PREROUTING -> a SERVICES chain with one rule per frontend
  -> the service's SVC chain -> its SEP chain -> DNAT; netfilter conntrack reverses the
  replies), with N frontends; the measured service's rule comes last in the SERVICES
  chain, the worst case of kube-proxy's linear match, paid by the first packet of every
  new connection. Palisade's service maps hold nothing then.

Metrics, medians over rounds, and ratios to ``direct`` and of ``clusterip-N`` to
``iptables-N``: new connections per second (a Python client that connects, waits for the
server's close and closes, every connection a fresh 4-tuple) and 64-byte UDP packets per
second received (iperf3 -u -l 64 -b 0). The targets: ClusterIP (BPF) / direct at least
``TARGET`` for both, at every level. After the rounds, a few more samples per Palisade variant run
with the kernel's BPF run-time accounting on (it costs a little per run, so never during the
rounds): the programs' own nanoseconds per 64-byte packet and per new connection, direct and through
each ClusterIP level, far less sensitive to the machine's load than the rates
(``bpf_run_time``; ``--bpf-stats-rounds 0`` skips it). Before the first sample of each variant the run
checks that the translation it claims happened (Palisade's service conntrack or the DNAT
rule's counter) and that the other did not.

Everything (namespaces, veths, iptables chains and the PREROUTING jump, BPF pins under
/sys/fs/bpf/palisade-bench-<run>) is removed at the end, on failure and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import roles
from bench.bpfstats import bpf_run_stats, runs_between, snapshot
from bench.output import logger, run_as_json
from bench.stats import round_to, summarize_bpf, target
from services.datapath.datapath import Datapath
from services.datapath.netns import PodLink
from services.datapath.types import Backend, EndpointSpec, Frontend, L4Proto, LbService
from testkit.traffic import tcp_connects

log = logger("services")

DEFAULT_LEVELS = (100, 1000, 10000)
METRICS = ("conn_rate", "udp_pps")
VIP = "10.96.255.254"
FILLER_BASE = int(ipaddress.IPv4Address("10.97.0.0"))
SRC_EP, DST_EP = 1, 2
#: ClusterIP (BPF) / direct, new connections and 64-byte UDP, at every level.
TARGET = 0.95


def measured_services(dst_ip: str) -> list[LbService]:
    """The frontends the client uses: iperf3's control (TCP) and data (UDP) port, and the connection ports."""
    out = [
        LbService(Frontend(VIP, roles.IPERF_PORT, L4Proto.TCP), (Backend(dst_ip, roles.IPERF_PORT),)),
        LbService(Frontend(VIP, roles.IPERF_PORT, L4Proto.UDP), (Backend(dst_ip, roles.IPERF_PORT),)),
    ]
    out += [
        LbService(Frontend(VIP, port, L4Proto.TCP), (Backend(dst_ip, port),))
        for port in range(roles.CONN_PORT, roles.CONN_PORT + roles.CONN_PORTS)
    ]
    return out


def filler_services(count: int, dst_ip: str) -> list[LbService]:
    return [
        LbService(Frontend(str(ipaddress.IPv4Address(FILLER_BASE + i)), 80, L4Proto.TCP), (Backend(dst_ip, 80),))
        for i in range(max(0, count))
    ]


class KubeProxy:
    """kube-proxy's iptables mode in small: nat chains per service and endpoint, built with iptables-restore."""

    def __init__(self, run: str) -> None:
        self.prefix = f"PALS-{run}"
        self.services = f"{self.prefix}-SERVICES"

    def ruleset(self, services: Sequence[LbService]) -> str:
        lines = ["*nat", f":{self.services} - [0:0]"]
        rules = []
        for i, svc in enumerate(services):
            f, (b,) = svc.frontend, svc.backends
            proto = f.protocol.value
            chain_svc, chain_sep = f"{self.prefix}-SVC-{i}", f"{self.prefix}-SEP-{i}"
            lines += [f":{chain_svc} - [0:0]", f":{chain_sep} - [0:0]"]
            rules.append(f"-A {self.services} -d {f.address}/32 -p {proto} -m {proto} --dport {f.port} -j {chain_svc}")
            rules.append(f"-A {chain_svc} -j {chain_sep}")
            rules.append(f"-A {chain_sep} -p {proto} -m {proto} -j DNAT --to-destination {b.address}:{b.port}")
        lines += rules
        lines.append(f"-I PREROUTING 1 -j {self.services}")
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def install(self, services: Sequence[LbService]) -> None:
        self.uninstall()
        roles.run_cmd(["iptables-restore", "-w", "30", "--noflush"], stdin=self.ruleset(services))

    def uninstall(self) -> None:
        while (
            roles.run_cmd(
                ["iptables", "-w", "30", "-t", "nat", "-D", "PREROUTING", "-j", self.services], check=False
            ).returncode
            == 0
        ):
            pass
        chains = self.our_chains()
        if not chains:
            return
        lines = ["*nat", *(f":{c} - [0:0]" for c in sorted(chains)), *(f"-X {c}" for c in sorted(chains)), "COMMIT"]
        roles.run_cmd(["iptables-restore", "-w", "30", "--noflush"], stdin="\n".join(lines) + "\n")

    def our_chains(self) -> set[str]:
        out = roles.run_cmd(["iptables-save", "-t", "nat"], check=False).stdout
        return set(re.findall(rf"^:({re.escape(self.prefix)}-\S+)", out, re.M))

    def dnat_packets(self, chain: str) -> int:
        out = roles.run_cmd(["iptables", "-w", "30", "-t", "nat", "-L", chain, "-n", "-v", "-x"]).stdout
        rows = [line.split() for line in out.splitlines()[2:] if line.strip()]
        return int(rows[0][0]) if rows else 0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = secrets.token_hex(2)
        self.prefix = f"pbs{self.run}"
        self.base = f"/sys/fs/bpf/palisade-bench-{self.run}"
        self.pods: list[PodLink] = []
        self.servers: list[roles.Server] = []
        self.dp: Datapath | None = None
        self.kp = KubeProxy(self.run)
        self.current = ""
        self.next_conn = 0
        self.checks: list[dict[str, Any]] = []

    def setup(self) -> None:
        self.src, self.dst = roles.create_pod_pair(self.prefix, self.pods)
        self.dst_ip = self.dst.ips[0]
        self.iperf_server, _ = roles.start_servers(self.dst, (), self.servers)
        self.dp = Datapath.open(self.base)
        for ep, pod in ((SRC_EP, self.src), (DST_EP, self.dst)):
            self.dp.attach_endpoint(EndpointSpec(ep, pod.host_ifindex, pod.host_ifname, pod.ips, 1000 + ep))
        self.measured = measured_services(self.dst_ip)

    def cleanup(self) -> dict[str, Any]:
        steps: list[tuple[str, Callable[[], object]]] = [("iptables", self.kp.uninstall)]
        if self.dp is not None:
            steps.append(("datapath teardown", self.dp.teardown))
        out = roles.clean_up(self.prefix, self.base, self.servers, self.pods, steps)
        out["iptables_chains_left"] = sorted(self.kp.our_chains())
        return out

    def lb_hold(self, services: Sequence[LbService]) -> None:
        """Make Palisade's service maps hold exactly ``services``."""
        assert self.dp is not None
        wanted = {s.frontend: s for s in services}
        for state in self.dp.lb_services():
            if state.frontend not in wanted:
                self.dp.lb_delete(state.frontend)
        held = {s.frontend for s in self.dp.lb_services()}
        for frontend, svc in wanted.items():
            if frontend not in held:
                self.dp.lb_upsert(svc)

    def switch(self, variant: str) -> float:
        started = time.perf_counter()
        kind, _, level = variant.partition("-")
        if self.current.startswith("iptables") and kind != "iptables":
            self.kp.uninstall()
        fillers = filler_services(int(level or 0) - len(self.measured), self.dst_ip)
        if kind == "clusterip":
            self.lb_hold([*fillers, *self.measured])
        elif kind == "iptables":
            self.lb_hold([])
            self.kp.install([*fillers, *self.measured])
        self.current = variant
        return time.perf_counter() - started

    def target(self, variant: str) -> str:
        return self.dst_ip if variant == "direct" else VIP

    def check(self, variant: str) -> None:
        assert self.dp is not None
        self.dp.flush_conntrack()  # only this check's connection counts
        ok = tcp_connects(self.src.name, self.target(variant), roles.CONN_PORT, 3.0)
        bpf = sum(1 for e in self.dp.conntrack(SRC_EP) if e.service_id)
        if variant.startswith("iptables"):
            i = len(filler_services(int(variant.partition("-")[2]) - len(self.measured), self.dst_ip)) + 2
            dnat = self.kp.dnat_packets(f"{self.kp.prefix}-SEP-{i}")
            passed, detail = ok and dnat > 0 and bpf == 0, f"connects={ok} dnat_packets={dnat} bpf_service_flows={bpf}"
        elif variant.startswith("clusterip"):
            passed, detail = ok and bpf > 0, f"connects={ok} bpf_service_flows={bpf}"
        else:
            passed, detail = ok, f"connects={ok}"
        self.checks.append({"variant": variant, "passed": passed, "detail": detail})
        if not passed:
            log(f"CHECK FAILED: {variant}: {detail}")

    def measure(self, variant: str) -> dict[str, float]:
        assert self.dp is not None
        self.dp.flush_conntrack()
        conn = roles.connection_rate(self.src, self.target(variant), self.args.seconds, self.next_conn)
        self.next_conn = int(conn["next"])
        udp = roles.iperf(self.src.name, self.target(variant), self.args.seconds, udp=True, server=self.iperf_server)
        self.dp.read_flows(0)
        return {"conn_rate": conn["value"], "udp_pps": udp["value"]}

    def bpf_cost(self, variant: str) -> dict[str, dict[str, float]]:
        """Kernel-measured run time of Palisade's programs (both pods' hooks; local delivery's
        "deliver" is tail-called, so its time is in from_container's runs) per 64-byte datagram and
        per new connection through ``variant``'s address."""
        assert self.dp is not None
        fds = {"from_container": self.dp.template.from_container_fd, "to_container": self.dp.template.to_container_fd}
        seconds = self.args.seconds
        out: dict[str, dict[str, float]] = {}
        self.dp.flush_conntrack()
        with bpf_run_stats():
            before = snapshot(fds)
            udp = roles.iperf(self.src.name, self.target(variant), seconds, udp=True, server=self.iperf_server)
            row, total_ns = runs_between(before, snapshot(fds))
            # Every datagram crosses from_container at the client (iperf3's control connection adds a handful).
            sent = row["from_container_runs"]
            row["ns_per_packet"] = round(total_ns / sent, 1) if sent else 0.0
            row["packets_received"] = round(udp["value"] * seconds)
            out["udp_64b"] = row
            before = snapshot(fds)
            conn = roles.connection_rate(self.src, self.target(variant), seconds, self.next_conn)
            row, total_ns = runs_between(before, snapshot(fds))
            self.next_conn = int(conn["next"])
            row["ns_per_connection"] = round(total_ns / conn["connections"], 1) if conn["connections"] else 0.0
            row["connections"] = conn["connections"]
            out["connections"] = row
        self.dp.read_flows(0)
        return out


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    variants = ["direct", *(f"{k}-{n}" for n in args.levels for k in ("clusterip", "iptables"))]
    samples: dict[str, dict[str, list[float]]] = {v: {m: [] for m in METRICS} for v in variants}
    switch_seconds: dict[str, list[float]] = {v: [] for v in variants}
    bpf_samples: dict[str, list[dict[str, dict[str, float]]]] = {}
    bench = Bench(args)
    cleanup: dict[str, Any] = {}
    try:
        bench.setup()
        checked: set[str] = set()
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else list(reversed(variants))
            for variant in order:
                switch_seconds[variant].append(bench.switch(variant))
                if variant not in checked:
                    bench.check(variant)
                    checked.add(variant)
                for metric, value in bench.measure(variant).items():
                    samples[variant][metric].append(value)
            log(f"round {r + 1}/{args.rounds} done")
        palisade = [v for v in variants if not v.startswith("iptables")]
        for r in range(args.bpf_stats_rounds):
            for variant in palisade if r % 2 == 0 else palisade[::-1]:
                bench.switch(variant)
                bpf_samples.setdefault(variant, []).append(bench.bpf_cost(variant))
            log(f"bpf run time {r + 1}/{args.bpf_stats_rounds} done")
    finally:
        cleanup = bench.cleanup()
    medians = {v: {m: round_to(statistics.median(samples[v][m])) for m in METRICS} for v in variants}
    direct = medians["direct"]
    ratios: dict[str, dict[str, float]] = {}
    summary = []
    for n in args.levels:
        cip, ipt = medians[f"clusterip-{n}"], medians[f"iptables-{n}"]
        ratios[str(n)] = {}
        for m in METRICS:
            ratios[str(n)][f"{m}_clusterip_vs_direct"] = round_to(cip[m] / direct[m]) if direct[m] else 0.0
            ratios[str(n)][f"{m}_iptables_vs_direct"] = round_to(ipt[m] / direct[m]) if direct[m] else 0.0
            ratios[str(n)][f"{m}_clusterip_vs_iptables"] = round_to(cip[m] / ipt[m]) if ipt[m] else 0.0
        what = {"conn_rate": "new connections", "udp_pps": "64-byte UDP"}
        for m in METRICS:
            summary.append(
                {
                    "metric": f"{what[m]}, {n} services: ClusterIP (BPF) / direct",
                    "value": ratios[str(n)][f"{m}_clusterip_vs_direct"],
                    "unit": "x",
                    "target": target(">=", TARGET),
                }
            )
            summary.append(
                {
                    "metric": f"{what[m]}, {n} services: iptables DNAT / direct",
                    "value": ratios[str(n)][f"{m}_iptables_vs_direct"],
                    "unit": "x",
                }
            )
    bpf_cost = summarize_bpf(bpf_samples)
    for variant, cost in bpf_cost.items():
        where = "direct" if variant == "direct" else f"ClusterIP (BPF), {variant.partition('-')[2]} services"
        summary.append(
            {
                "metric": f"BPF run time per 64-byte packet (both pods), {where}",
                "value": cost["udp_64b"]["ns_per_packet"],
                "unit": "ns",
            }
        )
        summary.append(
            {
                "metric": f"BPF run time per new connection (all packets, both pods), {where}",
                "value": cost["connections"]["ns_per_connection"],
                "unit": "ns",
            }
        )
    passed = sum(c["passed"] for c in bench.checks)
    summary.append({"metric": "checks passed", "value": passed, "unit": f"of {len(bench.checks)}"})
    return {
        "summary": summary,
        "medians": medians,
        "ratios": ratios,
        "samples": samples,
        "bpf_run_time": bpf_cost,
        "bpf_run_time_samples": bpf_samples,
        "switch_seconds_median": {v: round_to(statistics.median(s)) for v, s in switch_seconds.items() if s},
        "checks": bench.checks,
        "checks_passed": all(c["passed"] for c in bench.checks),
        "config": {
            "rounds": args.rounds,
            "seconds": args.seconds,
            "levels": args.levels,
            "bpf_stats_rounds": args.bpf_stats_rounds,
        },
        "cleanup": cleanup,
        "cleanup_ok": not any(
            cleanup.get(k) for k in ("problems", "netns_left", "iptables_chains_left", "bpf_dir_left")
        ),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 1-second samples")
    p.add_argument("--rounds", type=int, default=None, help="rounds, each running every variant once (default 6)")
    p.add_argument("--seconds", type=int, default=None, help="seconds per sample (default 2)")
    p.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(DEFAULT_LEVELS),
        help="comma-separated service counts (default 100,1000,10000)",
    )
    p.add_argument(
        "--bpf-stats-rounds",
        type=int,
        default=None,
        help="repetitions of the final kernel BPF run-time measurement of direct and ClusterIP "
        "(default 3, --quick 1; 0 skips it)",
    )
    args = p.parse_args(argv)
    if args.bpf_stats_rounds is None:
        args.bpf_stats_rounds = 1 if args.quick else 3
    args.rounds = args.rounds or (2 if args.quick else 6)
    args.seconds = args.seconds or (1 if args.quick else 2)
    if min(args.levels) <= len(measured_services("10.0.0.1")):
        p.error(f"--levels must each exceed the {len(measured_services('10.0.0.1'))} measured frontends")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_as_json(run_bench, parse_args(argv), missing=roles.missing_prerequisites)


if __name__ == "__main__":
    sys.exit(main())
