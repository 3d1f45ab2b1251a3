"""Soak: one client reaching one backend both by its ClusterIP and by its pod address, under load.

A black-box run once lost allowed connections this way: a connection to the pod address
whose client port a ClusterIP connection to the same backend had used seconds before
inherited that connection's translation. This keeps the load that found it running against
a dev cluster (`make run`), with one node and with three (client and backend on different
nodes): new TCP connections at ``--rate`` a second per path on ports the kernel picks, one
long-lived connection through the ClusterIP, and denied traffic beside it (tools/debug to
shop/db:5432, dropped by the clusterwide ingressDeny). Target: no allowed connection fails.

    sudo .venv/bin/python -m bench.bench_tuple_reuse [--seconds 600] [--rate 100] [--nodes 1 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.output import logger
from services.datapath.maps import snatmap
from services.datapath.maps.bpf import PinnedMap
from services.datapath.maps.snatmap import SnatMap

ROOT = Path(__file__).resolve().parent.parent


log = logger("tuple_reuse")


def soak(nodes: int, seconds: float, rate: float) -> dict[str, Any]:
    """One run's counts, the drops the datapath counted at both ends, and the failures in bursts."""
    from testkit import tuplereuse
    from testkit.stack import running_stack, wait_for  # needs root: the stack makes namespaces

    with tempfile.TemporaryDirectory(prefix="palisade-bench-reuse-") as tmp:
        folder = Path(tmp) / "examples"
        shutil.copytree(ROOT / "examples", folder)
        names = ("dev-node", "dev-node") if nodes == 1 else ("dev-node-1", "dev-node-2")
        (folder / "80-reuse.yaml").write_text(tuplereuse.manifest(*names))
        extra = [] if nodes == 1 else ["--nodes", str(nodes), "--node-subnet", "172.31.252.0/24"]
        with running_stack(Path(tmp), folder, *extra) as stack:
            for pod in ("reuse/client", "reuse/backend", "tools/debug", "shop/db"):

                def known(pod: str = pod) -> bool:
                    return stack.palisade("endpoint", "get", pod).returncode == 0

                assert wait_for(known, 60), f"{pod} never got an endpoint"
            cluster_ip = stack.cluster_ip("reuse/backend", tuplereuse.FRONT_TCP)
            backend = f"{stack.ip('reuse/backend')}:{tuplereuse.TCP_PORT}"
            common = ["--seconds", str(seconds), "--rate", str(rate)]
            load = [sys.executable, "-m", "bench.reuse_load"]
            log(f"{nodes} node(s) up; {seconds:.0f}s of load")
            started = time.monotonic()
            procs = [
                subprocess.Popen(
                    [*load, "--netns", stack.netns("reuse/client"), "--direct", backend,
                     "--service", f"{cluster_ip}:{tuplereuse.FRONT_TCP}", *common],
                    cwd=ROOT, stdout=subprocess.PIPE, text=True,
                ),
                subprocess.Popen(
                    [*load, "--netns", stack.netns("tools/debug"), "--denied", f"{stack.ip('shop/db')}:5432", *common],
                    cwd=ROOT, stdout=subprocess.PIPE, text=True,
                ),
            ]  # fmt: skip
            keys = ("direct", "service", "long")
            counts = {f"{k}_{r}": 0 for k in keys for r in ("ok", "failed")} | {
                "denied_blocked": 0,
                "denied_admitted": 0,
            }
            failures: list[list[Any]] = []
            for proc in procs:
                out, _ = proc.communicate(timeout=seconds + 120)
                if proc.returncode != 0:
                    raise RuntimeError(f"load exited {proc.returncode}")
                result = json.loads(out)
                failures += result.pop("failures")
                counts.update(result)
            counts["seconds"] = round(time.monotonic() - started)
            counts["allowed_failed"] = counts["direct_failed"] + counts["service_failed"] + counts["long_failed"]
            # How often the collision happened: connections the client's node gave a port of their
            # own (the LRU keeps them all at this rate).
            pins = stack.bpffs if nodes == 1 else f"{stack.bpffs}-{names[0]}"
            counts["given_ports"] = len(SnatMap(PinnedMap.open_any(pins, snatmap.NAME)).entries())
            # What the datapath counted at both ends: a failure no drop explains was not the policy's.
            drops = {}
            for pod in ("reuse/client", "reuse/backend"):
                got = stack.palisade("endpoint", "get", pod, "-o", "json")
                ep = json.loads(got.stdout)
                drops[pod] = {k: v for k, v in ep.get("counters", {}).items() if not k.endswith(ALLOWED)}
    bursts = _bursts(failures)
    counts["failure_bursts"] = len(bursts)
    return {**counts, "drops_counted": drops, "bursts": bursts, "failures": failures[:100]}


#: Counter reasons that are no drop.
ALLOWED = ("/policy-allow", "/established", "/not-enforced")


def _bursts(failures: list[list[Any]], gap: float = 1.0) -> list[dict[str, Any]]:
    """Failures grouped into bursts (less than ``gap`` seconds apart): when, how long, how many, what."""
    out: list[dict[str, Any]] = []
    for at, path, error in sorted(failures):
        if out and at - out[-1]["last"] < gap:
            burst = out[-1]
        else:
            burst = {"at_s": at, "last": at, "count": 0, "errors": {}}
            out.append(burst)
        burst["last"] = at
        burst["count"] += 1
        key = f"{path}: {error}"
        burst["errors"][key] = burst["errors"].get(key, 0) + 1
    for burst in out:
        burst["seconds"] = round(burst.pop("last") - burst["at_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600.0, help="load per cluster size (the target: 10 minutes)")
    p.add_argument("--rate", type=float, default=100.0, help="new connections a second, per path")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 3])
    p.add_argument("--quick", action="store_true", help="20 s per cluster size")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 20.0
    runs = {f"{n}_node": soak(n, args.seconds, args.rate) for n in args.nodes}
    summary: list[dict[str, Any]] = []
    for label, c in runs.items():
        where = label.replace("_", " ")
        summary.append(
            {"metric": f"{where}: allowed connections failed in {c['seconds']} s", "value": c["allowed_failed"],
             "unit": "", "target": {"op": "<=", "value": 0.0}}
        )  # fmt: skip
        for key, what in (
            ("direct_ok", "connections by pod address, ok"),
            ("direct_failed", "connections by pod address, failed"),
            ("service_ok", "connections by ClusterIP, ok"),
            ("service_failed", "connections by ClusterIP, failed"),
            ("long_ok", "long-lived connection's echoes, ok"),
            ("long_failed", "long-lived connection's echoes, failed"),
            ("given_ports", "connections given a source port of their own (tuple held by another flow)"),
            ("failure_bursts", "bursts the failures came in"),
            ("denied_blocked", "denied connections blocked"),
            ("denied_admitted", "denied connections admitted"),
        ):
            summary.append({"metric": f"{where}: {what}", "value": c[key], "unit": ""})
    print(json.dumps({"runs": runs, "rate_per_path": args.rate, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
