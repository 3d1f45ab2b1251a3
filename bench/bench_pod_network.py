"""Pod network benchmark: CPU and wall time of one pod's network work (netns.create_pod, delete_pod)
and of one tc attach and detach, with nothing else running.

Run as root on a machine with bcc:

    .venv/bin/python -m bench.bench_pod_network --pods 40

Namespaces are made first (``ip netns add`` forks and execs: not what is measured), then each pod
gets its network in its own namespace (an IPv4 and an IPv6 address, as the service gives pods),
one after the other; the CPU of each call is ``time.process_time()`` (this process, every thread),
its wall time ``time.perf_counter()``. The programs are then attached to each host veth with tc
filters (a clsact qdisc and two bpf filters) and detached again, and the networks deleted. Prints
one JSON object; everything is removed afterwards.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.output import run_as_json
from bench.stats import stats_ms
from services.datapath import netns
from services.datapath.datapath import Datapath
from services.datapath.loader import Loader
from services.datapath.netns import PodLink


def timed(fn: Callable[[], Any], cpu: list[float], wall: list[float]) -> Any:
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    result = fn()
    cpu.append(time.process_time() - cpu_start)
    wall.append(time.perf_counter() - wall_start)
    return result


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    run = "pw" + secrets.token_hex(2)
    base = f"/sys/fs/bpf/palisade-{run}"
    o2 = 200 + secrets.randbelow(50)
    netns.enable_forwarding()
    names = [f"{run}{i:03d}" for i in range(args.pods)]
    pods: list[PodLink] = []
    dp: Datapath | None = None
    tc: Loader | None = None
    kinds = ("create", "delete", "attach", "detach")
    samples: dict[str, list[float]] = {f"{what}_{kind}": [] for what in kinds for kind in ("cpu", "wall")}
    result: dict[str, Any] = {"pods": args.pods, "kernel": os.uname().release, "cpus": os.cpu_count()}
    try:
        for name in names:
            netns.create_netns(name)
        for i, name in enumerate(names):
            ips = [f"10.{o2}.{i // 250}.{i % 250 + 1}", f"fd00:{o2:x}::{i + 1:x}"]
            create = functools.partial(netns.create_pod, name, name, ips, create=False)
            pods.append(timed(create, samples["create_cpu"], samples["create_wall"]))

        dp = Datapath.open(base)
        tc = Loader(base, "tc")
        template = dp.template
        for pod in pods:
            attach = functools.partial(tc.attach, template, pod.host_ifindex)
            timed(attach, samples["attach_cpu"], samples["attach_wall"])
        result["tc_attached"] = sum(1 for pod in pods if tc.attachment(pod.host_ifindex).programs == 2)
        for pod in pods:
            timed(functools.partial(tc.detach, pod.host_ifindex), samples["detach_cpu"], samples["detach_wall"])

        for pod in pods:
            timed(functools.partial(netns.delete_pod, pod), samples["delete_cpu"], samples["delete_wall"])
        result["left_alive"] = sum(1 for pod in pods if netns.pod_alive(pod))
        pods.clear()
    finally:
        if tc is not None:
            tc.close()
        if dp is not None:
            dp.teardown()
        for pod in pods:
            netns.delete_pod(pod)
        for name in names:
            netns.delete_netns(name)
    result |= {f"{key}_ms": stats_ms([v * 1e3 for v in values]) for key, values in samples.items()}
    result["summary"] = [
        {"metric": f"{what} {kind} per pod (mean)", "value": result[f"{what}_{kind}_ms"]["mean"], "unit": "ms"}
        for what in kinds
        for kind in ("cpu", "wall")
    ]
    return result


def missing() -> str | None:
    return None if os.geteuid() == 0 else "needs root (network namespaces, BPF)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=40)
    # The shared runner: the root check, and SIGTERM unwinding the run so its namespaces go too.
    return run_as_json(run_bench, parser.parse_args(argv), missing=missing)


if __name__ == "__main__":
    sys.exit(main())
