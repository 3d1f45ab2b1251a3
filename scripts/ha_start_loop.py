"""Start the HA dev stack (`make run RUN_ARGS=--ha`) again and again; every start must hold.

    flock /work/stack.lock .venv/bin/python -m scripts.ha_start_loop [--runs 20]

As root (the stack makes network namespaces and loads BPF). Each run starts the stack on
free ports with its own bpffs directory (testkit/stack.py), checks that it came up
with no part exited or restarted, that every member and replica is healthy (3 NATS
servers, 3 etcd members, 2 policy replicas, 2 ipam replicas, the watcher and the
datapath), then stops it. Prints one JSON object: runs, failures (with what went
wrong) and the start times; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.harness import ROOT
from testkit.stack import Stack, running_stack

#: Members and replicas a healthy HA stack lists in `palisade status`.
EXPECTED = {"nats": 3, "etcd": 3}
SERVICES = {"policy": 2, "ipam": 2, "watcher": 1, "datapath": 1}


def problems(stack: Stack) -> list[str]:
    """What is wrong with a stack that printed its banner (empty: nothing)."""
    out = [line.strip() for line in stack.output if "exited" in line or "restarted" in line]
    status = stack.status()
    for group, count in EXPECTED.items():
        members = [m for m in status["members"] if m["group"] == group]
        healthy = [m for m in members if m["health"] == "ok"]
        if len(healthy) != count:
            out.append(f"{group}: {len(healthy)} of {count} members healthy: {members}")
    for service, count in SERVICES.items():
        replicas = [r for r in status["services"] if r["service"] == service]
        serving = [r for r in replicas if r["health"] == "SERVING"]
        if len(serving) != count:
            out.append(f"{service}: {len(serving)} of {count} replicas SERVING: {replicas}")
    if stack.proc.poll() is not None:
        out.append(f"the stack exited ({stack.proc.returncode})")
    return out


def one_run(tmp: Path) -> tuple[float, list[str]]:
    started = time.monotonic()
    try:
        with running_stack(tmp, ROOT / "examples", "--ha") as stack:
            took = time.monotonic() - started
            return took, problems(stack)
    except pytest.fail.Exception as exc:  # the stack did not come up; the message holds its output
        return time.monotonic() - started, [str(exc)[-3000:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="starts to make")
    args = parser.parse_args()
    failures: list[dict[str, Any]] = []
    seconds: list[float] = []
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="palisade-ha-loop-") as tmp:
            took, wrong = one_run(Path(tmp))
        seconds.append(round(took, 1))
        print(f"run {run}: {'ok' if not wrong else 'FAILED'} ({took:.1f}s)", file=sys.stderr, flush=True)
        if wrong:
            failures.append({"run": run, "problems": wrong})
    print(json.dumps({"runs": args.runs, "failed": len(failures), "start_seconds": seconds, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
