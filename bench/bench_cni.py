"""CNI through a real runtime: palisade-cni ADD and DEL times and sandboxes per second via containerd.

    python -m bench.bench_cni [--sandboxes 50] [--quick]

The whole system runs as `make run --no-pods` brings it up; containerd's CRI plays kubelet.
For each mode (standalone, and chained after ptp + host-local) it creates the sandboxes one
after another through RunPodSandbox, then removes them (StopPodSandbox + RemovePodSandbox).
The plugin is wrapped so that each ADD and DEL is timed as the runtime ran it; the sandbox
rate is the number of sandboxes over the time RunPodSandbox took in all (the runtime's own
work included). The Pod objects are published first, so every endpoint gets its identity.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.output import logger
from bench.stats import stats_ms
from services.cni import install
from testkit.containerd import Containerd, missing
from testkit.stack import running_stack, wait_for

NS = "bench-cni"

WRAPPER = """#!/bin/sh
# Times each call of palisade-cni as the runtime makes it.
start=$(date +%s%N)
"{plugin}"
status=$?
end=$(date +%s%N)
echo "$CNI_COMMAND $(( (end - start) / 1000 )) $status" >> "{log}"
exit $status
"""


log = logger("cni")


def pods(count: int) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}]
    for i in range(count):
        docs.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": NS, "labels": {"app": f"a{i % 5}"}},
            "spec": {"nodeName": "dev-node", "containers": [{"name": "c", "image": "i"}]},
        })  # fmt: skip
    return docs


def run_mode(mode: str, count: int, socket: str, work: Path) -> dict[str, Any]:
    containerd = Containerd(work / mode)
    timings = work / f"{mode}.timings"
    wrapper = work / f"{mode}-palisade"
    wrapper.write_text(WRAPPER.format(plugin=Path(sys.executable).parent / "palisade-cni", log=timings))
    wrapper.chmod(0o755)
    containerd.start(str(wrapper))
    cri = containerd.cri()
    try:
        if mode == "standalone":
            containerd.write_conflist([{"type": "palisade", "socket": socket}])
        else:
            ranges = [[{"subnet": "10.78.0.0/16"}]]
            ptp = {"type": "ptp", "ipMasq": False,
                   "ipam": {"type": "host-local", "ranges": ranges, "dataDir": str(work / f"{mode}-ipam")}}  # fmt: skip
            conf = {"cniVersion": "1.0.0", "name": "ptp-net", "plugins": [ptp]}
            (containerd.cni_conf / "10-ptp.conflist").write_text(json.dumps(conf))
            chained = install.conflist(containerd.cni_conf, chain=True, socket=socket)
            (containerd.cni_conf / install.CONFLIST).write_text(json.dumps(chained))
        ids = []
        run_ms = []
        started = time.perf_counter()
        for i in range(count):
            t = time.perf_counter()
            ids.append(cri.run_sandbox(NS, f"p{i}", f"uid-{i}", work / "logs"))
            run_ms.append((time.perf_counter() - t) * 1000)
        created_s = time.perf_counter() - started
        remove_ms = []
        for sid in ids:
            t = time.perf_counter()
            cri.remove(sid)
            remove_ms.append((time.perf_counter() - t) * 1000)
    finally:
        cri.close()
        containerd.stop()
    calls: dict[str, list[float]] = {"ADD": [], "DEL": []}
    failures = 0
    for line in timings.read_text().splitlines():
        command, micros, status = line.split()
        failures += status != "0"
        calls.setdefault(command, []).append(int(micros) / 1000)
    return {
        "add_ms": stats_ms(calls["ADD"]),
        "del_ms": stats_ms(calls["DEL"]),
        "run_sandbox_ms": stats_ms(run_ms),
        "remove_sandbox_ms": stats_ms(remove_ms),
        "sandboxes_per_s": round(count / created_s, 2),
        "plugin_failures": failures,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="palisade-bench-cni-"))
    out: dict[str, Any] = {"sandboxes": args.sandboxes}
    with running_stack(work, None, "--no-pods") as stack:
        (stack.manifests / "pods.yaml").write_text(yaml.safe_dump_all(pods(args.sandboxes)))
        socket = str(stack.run_dir / "datapath" / "cni.sock")
        assert wait_for(lambda: stack.palisade("status").returncode == 0, 60)
        time.sleep(1.0)  # let the watcher publish the Pod objects and ipam resolve them
        for mode in ("standalone", "chained"):
            log(f"{mode}: {args.sandboxes} sandboxes through containerd")
            out[mode] = run_mode(mode, args.sandboxes, socket, work)
    summary = []
    for mode in ("standalone", "chained"):
        m = out[mode]
        summary += [
            {"metric": f"{mode}: palisade-cni ADD p50", "value": m["add_ms"]["p50"], "unit": "ms"},
            {"metric": f"{mode}: palisade-cni ADD p99", "value": m["add_ms"]["p99"], "unit": "ms"},
            {"metric": f"{mode}: palisade-cni DEL p50", "value": m["del_ms"]["p50"], "unit": "ms"},
            {"metric": f"{mode}: palisade-cni DEL p99", "value": m["del_ms"]["p99"], "unit": "ms"},
            {"metric": f"{mode}: sandboxes per second via containerd", "value": m["sandboxes_per_s"], "unit": "1/s"},
        ]
    out["summary"] = summary
    out["plots"] = []
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 sandboxes per mode")
    p.add_argument("--sandboxes", type=int, help="sandboxes per mode (default 50; 10 with --quick)")
    args = p.parse_args()
    args.sandboxes = args.sandboxes or (10 if args.quick else 50)
    problem = missing()
    if os.geteuid() != 0 or problem:
        print(json.dumps({"error": problem or "needs root", "summary": [], "plots": []}))
        return 0
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
