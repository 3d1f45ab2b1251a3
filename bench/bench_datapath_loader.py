"""Datapath loader benchmark: compile once vs. attach per endpoint with the template cache.

Run as root on a machine with bcc:

    .venv/bin/python bench/bench_datapath_loader.py --endpoints 50

Creates N pod namespaces with veths, opens a fresh datapath (one compile),
attaches every endpoint (no compile: the template is reused), writes a small
policy per endpoint (a full sync), then adds and removes one entry per endpoint
(a delta, which encodes only that entry), checks that enforcement works on real packets, reopens
the datapath as a restarted agent would (pinned programs, no compile) and
prints one JSON object. Everything is removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import sys
import time

from bench.output import run_as_json
from bench.stats import stats_ms
from services.datapath import netns
from services.datapath.datapath import Datapath
from services.datapath.netns import PodLink
from services.datapath.types import (
    Direction,
    EndpointSpec,
    Enforcement,
    L4Proto,
    PolicyEntry,
    PolicyKey,
    Verdict,
)
from testkit.traffic import tcp_connects


def summary(samples: list[float]) -> dict[str, float]:
    """Milliseconds (:func:`bench.stats.stats_ms`) and the total in seconds."""
    return {**stats_ms([x * 1e3 for x in samples]), "count": len(samples), "total_s": round(sum(samples), 4)}


def policy_for(identity_base: int) -> list[PolicyEntry]:
    return [
        PolicyEntry(PolicyKey(Direction.INGRESS, identity_base, L4Proto.TCP, 8080)),
        PolicyEntry(PolicyKey(Direction.INGRESS, identity_base, L4Proto.TCP, 9000, 9999)),
        PolicyEntry(PolicyKey(Direction.INGRESS, 0, L4Proto.UDP, 53)),
        PolicyEntry(PolicyKey(Direction.INGRESS, 0, L4Proto.TCP, 22), Verdict.DENY),
        PolicyEntry(PolicyKey(Direction.EGRESS, 0, L4Proto.ANY)),
    ]


def check_enforcement(first: PodLink, last: PodLink) -> dict[str, bool]:
    """first may reach last on 8080 (allowed), not on 8081 (default deny)."""
    ip = last.ips[0]
    servers = [netns.in_netns(last.name, socket.create_server, (ip, port)) for port in (8080, 8081)]
    try:
        return {
            "allowed_port_connects": tcp_connects(first.name, ip, 8080, 5.0),
            "denied_port_blocked": not tcp_connects(first.name, ip, 8081, 1.0),
        }
    finally:
        for s in servers:
            s.close()


def missing() -> str | None:
    return None if os.geteuid() == 0 else "needs root (network namespaces, BPF)"


def run_bench(args: argparse.Namespace) -> dict[str, object]:
    run = "pb" + secrets.token_hex(2)
    base = f"/sys/fs/bpf/palisade-{run}"
    o2 = 200 + secrets.randbelow(50)
    netns.enable_forwarding()
    pods: list[PodLink] = []
    dp: Datapath | None = None
    result: dict[str, object] = {"endpoints": args.endpoints, "kernel": os.uname().release, "cpus": os.cpu_count()}
    try:
        setup = []
        for i in range(args.endpoints):
            name = f"{run}{i:03d}"
            start = time.perf_counter()
            pods.append(netns.create_pod(name, name, [f"10.{o2}.{i // 250}.{i % 250 + 1}"]))
            setup.append(time.perf_counter() - start)

        start = time.perf_counter()
        dp = Datapath.open(base)
        open_cold = time.perf_counter() - start
        template = dp.template
        result["compile_seconds"] = round(template.compile_seconds, 4)
        result["open_cold_seconds"] = round(open_cold, 4)
        result["template"] = {"hash": template.short, "origin": template.origin}

        attach, policy = [], []
        for i, pod in enumerate(pods):
            spec = EndpointSpec(i + 1, pod.host_ifindex, pod.host_ifname, pod.ips, 1000 + i)
            start = time.perf_counter()
            dp.attach_endpoint(spec)
            attach.append(time.perf_counter() - start)
            start = time.perf_counter()
            dp.sync_policy(spec.id, Enforcement(ingress=True), policy_for(1000))
            policy.append(time.perf_counter() - start)

        delta = []
        for i in range(len(pods)):
            extra = PolicyEntry(PolicyKey(Direction.INGRESS, 1000, L4Proto.TCP, 7070))
            start = time.perf_counter()
            dp.apply_policy(i + 1, Enforcement(ingress=True), add=[extra])
            delta.append(time.perf_counter() - start)
            dp.apply_policy(i + 1, Enforcement(ingress=True), remove=[extra])

        result["attach_per_endpoint"] = summary(attach)
        result["policy_sync_per_endpoint"] = summary(policy)
        result["policy_delta_one_entry_per_endpoint"] = summary(delta)
        result["netns_veth_setup_per_endpoint"] = summary(setup)
        distinct = {dp._loader.attachment(p.host_ifindex).template() for p in pods}
        result["distinct_templates_attached"] = len(distinct)
        result["compiles"] = 1 if template.origin == "compiled" else 0
        mean_attach = statistics.fmean(attach)
        result["compile_to_attach_ratio"] = round(template.compile_seconds / mean_attach, 1) if mean_attach else None
        result["compile_seconds_saved_vs_per_endpoint_compile"] = round(
            template.compile_seconds * (args.endpoints - 1), 2
        )
        result["enforcement"] = check_enforcement(pods[0], pods[-1])

        # A restarted agent: pinned programs and maps, no compile.
        dp.close()
        start = time.perf_counter()
        dp = Datapath.open(base)
        reopen_seconds = time.perf_counter() - start
        result["reopen_seconds"] = round(reopen_seconds, 4)
        result["reopen_template_origin"] = dp.template.origin
        start = time.perf_counter()
        restored = dp.pinned_endpoints()
        result["pinned_endpoints_seconds"] = round(time.perf_counter() - start, 4)
        result["pinned_endpoints_attached"] = sum(1 for e in restored if e.attached)
        result["summary"] = [
            {"metric": "compile (once)", "value": round(template.compile_seconds * 1e3, 1), "unit": "ms"},
            {"metric": "attach per endpoint (mean)", "value": round(mean_attach * 1e3, 3), "unit": "ms"},
            {"metric": "attach per endpoint (p90)", "value": summary(attach)["p90"], "unit": "ms"},
            {"metric": "policy sync per endpoint (mean)", "value": summary(policy)["mean"], "unit": "ms"},
            {"metric": "policy delta, one entry, per endpoint (mean)", "value": summary(delta)["mean"], "unit": "ms"},
            {"metric": f"compiles for {args.endpoints} endpoints", "value": result["compiles"], "unit": ""},
            {
                "metric": "reopen after restart (pinned, no compile)",
                "value": round(reopen_seconds * 1e3, 1),
                "unit": "ms",
            },
        ]
        result["plots"] = [
            {
                "name": "datapath_attach",
                "title": f"Per-endpoint attach time, {args.endpoints} endpoints, one template",
                "xlabel": "ms",
                "ylabel": "endpoints",
                "kind": "hist",
                "series": {"attach": [round(x * 1e3, 3) for x in attach]},
            }
        ]
    finally:
        if dp is not None:
            dp.teardown()
        for pod in pods:
            netns.delete_pod(pod)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=50)
    # The shared runner: the root check, and SIGTERM unwinding the run so its namespaces go too.
    return run_as_json(run_bench, parser.parse_args(argv), missing=missing)


if __name__ == "__main__":
    sys.exit(main())
