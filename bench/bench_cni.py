"""CNI through a real runtime: palisade-cni ADD and DEL times, sandboxes per second against the
runtime with ptp + host-local alone, and a burst of pods on one node.

    python -m bench.bench_cni [--sandboxes 120] [--rounds 12] [--burst 100] [--quick] [--python-plugin]

The whole system runs as `make run --no-pods` brings it up; containerd's CRI plays kubelet.
Three containerd instances run side by side, one per mode: ``ptp`` (ptp + host-local alone,
the baseline: no Palisade), ``standalone`` (palisade-cni alone) and ``chained`` (palisade-cni
after ptp + host-local). The sandboxes of each mode are created in ``--rounds`` batches, the
modes taking turns batch by batch (interleaved, so a load on the machine falls on all alike);
each batch is created one sandbox after another through RunPodSandbox, then removed
(StopPodSandbox + RemovePodSandbox). Rounds alternate between two kinds. In the rate's rounds
the runtime runs the plugin executable itself, as a node's does; a mode's sandbox rate is its
sandboxes there over the time RunPodSandbox took (the runtime's own work included), and its
ratio is that rate over the baseline's in the same rounds. In the timed rounds the plugin is
wrapped by a shell script that times each ADD and DEL as the runtime ran it; the wrapper
itself costs about 3.5 ms a call here (a shell and two ``date`` processes), which is why its
rounds do not count for the rate. The Pod objects are published first, so every endpoint gets
its identity.

The runtime runs the plugin executable (services/cni/shim.c), which has the datapath run the
plugin's code. ``--python-plugin`` adds two modes to the turns, ``standalone-python`` and
``chained-python``: the same configurations with the Python plugin started by the runtime for every
call (``palisade-cni-python``, what the executable hands over to), so the executable's gain is
measured in the same run, interleaved.

Where an ADD's and a DEL's time goes: ``plugin_own_ms`` is the plugin's own cost, from its exec to
its exit (DEL, with a peer on a socket of its own that answers at once), so a call's time less
it is the datapath's (reported as ``datapath_share_ms`` at p50), and RunPodSandbox's time less
the ADD is containerd's and runc's (``runtime_share_ms``).

The burst: ``--burst`` palisade-cni ADDs started at once on the one node, each in a network
namespace of its own (made beforehand), for Pods that a NetworkPolicy selects; timed from the
first start to the moment every endpoint is READY with its pod's identity (its policy written
into its map), then as many DELs at once until every endpoint is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket as socket_mod
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from bench.output import logger
from bench.stats import stats_ms, target
from services.cni import install
from services.cni.spec import plugin_socket
from testkit.containerd import Containerd, Cri, missing
from testkit.stack import running_stack, wait_for

NS = "bench-cni"
BURST_NS = "bench-burst"
MODES = ("ptp", "standalone", "chained")
#: With --python-plugin: the same configurations, the Python plugin run for every call.
PYTHON_MODES = ("standalone-python", "chained-python")
#: The baseline's and the chained mode's host-local ranges (apart, so no route is shared).
SUBNETS = {"ptp": "10.79.0.0/16", "chained": "10.78.0.0/16", "chained-python": "10.77.0.0/16"}
READY = "ENDPOINT_STATE_READY"
INIT_IDENTITY = 5

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


def pods(count: int, burst: int) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": BURST_NS}},
        # Every burst pod is selected: its endpoint is enforced once this policy is in its map.
        {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "web-from-client", "namespace": BURST_NS},
            "spec": {"podSelector": {"matchLabels": {"tier": "web"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a0"}}}],
                                  "ports": [{"port": 80, "protocol": "TCP"}]}]},
        },
    ]  # fmt: skip
    for ns, n in ((NS, count), (BURST_NS, burst)):
        for i in range(n):
            docs.append({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"p{i}", "namespace": ns, "labels": {"app": f"a{i % 5}", "tier": "web"}},
                "spec": {"nodeName": "dev-node", "containers": [{"name": "c", "image": "i"}]},
            })  # fmt: skip
    return docs


class Runtime:
    """One containerd with the CNI configuration of a mode, and the plugin calls it made."""

    def __init__(self, mode: str, socket: str, work: Path) -> None:
        self.mode = mode
        self.containerd = Containerd(work / mode)
        self.timings = work / f"{mode}.timings"
        self.timings.touch()
        self.wrapper = work / f"{mode}-palisade"
        plugin = "palisade-cni-python" if mode.endswith("-python") else "palisade-cni"
        self.plugin = Path(sys.executable).parent / plugin
        self.wrapper.write_text(WRAPPER.format(plugin=self.plugin, log=self.timings))
        self.wrapper.chmod(0o755)
        self.containerd.start(str(self.wrapper))
        self.cri: Cri = self.containerd.cri()
        cni_conf = self.containerd.cni_conf
        mode = mode.removesuffix("-python")
        if mode == "standalone":
            self.containerd.write_conflist([{"type": "palisade", "socket": socket}])
        else:
            ranges = [[{"subnet": SUBNETS[self.mode]}]]
            ipam_dir = str(work / f"{self.mode}-ipam")
            ptp = {"type": "ptp", "ipMasq": False,
                   "ipam": {"type": "host-local", "ranges": ranges, "dataDir": ipam_dir}}  # fmt: skip
            conf = {"cniVersion": "1.0.0", "name": "ptp-net", "plugins": [ptp]}
            (cni_conf / "10-ptp.conflist").write_text(json.dumps(conf))
            if mode == "chained":
                chained = install.conflist(cni_conf, chain=True, socket=socket)
                (cni_conf / install.CONFLIST).write_text(json.dumps(chained))
        self.logs = work / f"{mode}-logs"
        #: RunPodSandbox times of the rate's rounds (the plugin run by the runtime itself) and of the timed ones.
        self.run_ms: list[float] = []
        self.timed_run_ms: list[float] = []
        self.remove_ms: list[float] = []

    def _plugin(self, timed: bool) -> None:
        """What the runtime runs as type ``palisade`` from its next call on: the wrapper or the plugin itself."""
        if self.mode == "ptp":
            return
        link = self.containerd.cni_bin / "palisade"
        fresh = link.with_name(".palisade.next")
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(self.wrapper if timed else self.plugin)
        os.replace(fresh, link)  # the runtime looks the plugin up on every call

    def batch(self, first: int, count: int, *, timed: bool) -> None:
        """Create sandboxes ``p<first>`` .. one after another, then remove them (``timed``: each call timed)."""
        self._plugin(timed)
        times = self.timed_run_ms if timed else self.run_ms
        ids = []
        for i in range(first, first + count):
            t = time.perf_counter()
            ids.append(self.cri.run_sandbox(NS, f"p{i}", f"uid-{self.mode}-{i}", self.logs))
            times.append((time.perf_counter() - t) * 1000)
        for sid in ids:
            t = time.perf_counter()
            self.cri.remove(sid)
            self.remove_ms.append((time.perf_counter() - t) * 1000)

    def close(self) -> None:
        self.cri.close()
        self.containerd.stop()

    def result(self) -> dict[str, Any]:
        calls: dict[str, list[float]] = {"ADD": [], "DEL": []}
        failures = 0
        for line in self.timings.read_text().splitlines():
            command, micros, status = line.split()
            failures += status != "0"
            calls.setdefault(command, []).append(int(micros) / 1000)
        out: dict[str, Any] = {
            "run_sandbox_ms": stats_ms(self.run_ms),
            "remove_sandbox_ms": stats_ms(self.remove_ms),
            "sandboxes_per_s": round(len(self.run_ms) / (sum(self.run_ms) / 1000), 2),
            "rate_sandboxes": len(self.run_ms),
            "timed_sandboxes": len(self.timed_run_ms),
        }
        if self.mode != "ptp":
            out.update(
                add_ms=stats_ms(calls["ADD"]),
                del_ms=stats_ms(calls["DEL"]),
                plugin_failures=failures,
                add_calls=len(calls["ADD"]),
                run_sandbox_timed_ms=stats_ms(self.timed_run_ms),
            )
        return out


def run_modes(count: int, rounds: int, socket: str, work: Path, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    runtimes: dict[str, Runtime] = {}
    try:
        for mode in modes:
            runtimes[mode] = Runtime(mode, socket, work)
        size = max(1, count // rounds)
        for r in range(rounds):
            timed = r % 2 == 1
            log(f"round {r + 1}/{rounds}: {size} sandboxes per mode" + (", each plugin call timed" if timed else ""))
            for mode in modes:
                runtimes[mode].batch(r * size, size, timed=timed)
    finally:
        for runtime in runtimes.values():
            runtime.close()
    return {mode: runtimes[mode].result() for mode in modes}


# -- the plugin's own cost ----------------------------------------------------------------------


def plugin_own_ms(plugin: Path, work: Path, calls: int = 100) -> dict[str, float]:
    """Times of ``calls`` DELs by ``plugin``, exec to exit, with a peer on a socket of its own that
    answers each at once (the framed call and the Python plugin's JSON line alike)."""
    directory = Path(tempfile.mkdtemp(dir=work, prefix="own-"))
    listener = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    listener.bind(plugin_socket(str(directory / "cni.sock")))
    listener.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as stream:
                line = stream.readline()
                if line.startswith(b"PALISADE-CNI 1 "):
                    env_len, stdin_len = (int(n) for n in line.split()[2:])
                    stream.read(env_len + stdin_len)
                    conn.sendall(b"exit 0 0\n")
                else:
                    conn.sendall(b'{"response": {}}\n')
                conn.shutdown(socket_mod.SHUT_RDWR)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conf = json.dumps({"cniVersion": "1.0.0", "name": "own", "type": "palisade", "socket": str(directory / "cni.sock")})
    env = {**_plugin_env("DEL", 0, "/run/netns/none"), "CNI_CONTAINERID": "own"}
    times = []
    try:
        for _ in range(calls):
            started = time.perf_counter()
            done = subprocess.run([str(plugin)], input=conf.encode(), env=env, capture_output=True, check=False)
            times.append((time.perf_counter() - started) * 1000)
            if done.returncode != 0:
                raise RuntimeError(f"{plugin} DEL against an answering peer failed: {done.stdout!r} {done.stderr!r}")
    finally:
        listener.shutdown(socket_mod.SHUT_RDWR)
        listener.close()
        thread.join(5)
    return stats_ms(times)


# -- the burst --------------------------------------------------------------------------------


def _plugin_env(command: str, i: int, netns: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": f"burst{i:04d}",
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/usr/lib/cni",
        "CNI_ARGS": f"K8S_POD_NAMESPACE={BURST_NS};K8S_POD_NAME=p{i}",
    }


def _plugins(command: str, count: int, netns: list[str], conf: Path) -> list[subprocess.Popen[bytes]]:
    """``count`` plugin calls started at once, each reading the network configuration from ``conf``."""
    plugin = str(Path(sys.executable).parent / "palisade-cni")
    procs = []
    for i in range(count):
        with conf.open("rb") as stdin:
            procs.append(subprocess.Popen(
                [plugin], env=_plugin_env(command, i, netns[i]), stdin=stdin,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            ))  # fmt: skip
    return procs


def _finish(procs: list[subprocess.Popen[bytes]], what: str) -> None:
    failed = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed.append(f"p{i}: {out.decode()[-300:]} {err.decode()[-300:]}")
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(procs)} {what} failed: " + "; ".join(failed[:3]))


def _burst_endpoints(socket: str) -> list[dict[str, Any]]:
    import socket as sock_mod

    with sock_mod.socket(sock_mod.AF_UNIX, sock_mod.SOCK_STREAM) as s:
        s.connect(plugin_socket(socket))
        s.sendall(b'{"method": "ListEndpoints", "request": {}}\n')
        answer = json.loads(s.makefile("rb").readline())
    return [e for e in answer["response"].get("endpoints", []) if e.get("namespace") == BURST_NS]


def enforced(ep: dict[str, Any]) -> bool:
    """READY with the pod's own identity: its policy is in its map."""
    return ep.get("state") == READY and int(ep.get("identity", 0)) not in (0, INIT_IDENTITY)


def run_burst(count: int, socket: str, work: Path) -> dict[str, Any]:
    names = [f"pal_burst_{i}" for i in range(count)]
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    netns = [f"/run/netns/{name}" for name in names]
    conf = work / "burst.conf"
    conf.write_text(json.dumps({"cniVersion": "1.0.0", "name": "palisade", "type": "palisade", "socket": socket}))
    try:
        started = time.perf_counter()
        adds = _plugins("ADD", count, netns, conf)
        _finish(adds, "ADDs")
        answered = time.perf_counter() - started
        # CreateEndpoint answers once the endpoint's first policy is written; this checks it.
        if not wait_for(lambda: sum(map(enforced, _burst_endpoints(socket))) == count, 120):
            eps = _burst_endpoints(socket)
            raise RuntimeError(f"only {sum(map(enforced, eps))} of {count} burst endpoints are enforced")
        all_enforced = time.perf_counter() - started
        started = time.perf_counter()
        _finish(_plugins("DEL", count, netns, conf), "DELs")
        if not wait_for(lambda: not _burst_endpoints(socket), 60):
            raise RuntimeError("burst endpoints left after DEL")
        deleted = time.perf_counter() - started
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    return {
        "pods": count,
        "first_add_to_all_answered_s": round(answered, 3),
        "first_add_to_all_enforced_s": round(all_enforced, 3),
        "first_del_to_all_gone_s": round(deleted, 3),
    }


# -- main -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="palisade-bench-cni-"))
    try:
        return _run(args, work)
    finally:
        # Three runtimes' state, the stack's data and logs: ~20 MB a run (--keep-logs copies the logs).
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"sandboxes": args.sandboxes, "rounds": args.rounds}
    with running_stack(work, None, "--no-pods") as stack:
        (stack.manifests / "pods.yaml").write_text(yaml.safe_dump_all(pods(args.sandboxes, args.burst)))
        socket = str(stack.run_dir / "datapath" / "cni.sock")
        assert wait_for(lambda: stack.palisade("status").returncode == 0, 60)
        # The Pod objects published and their identities allocated (a late one would start as init).
        if not wait_for(lambda: _identities(stack, BURST_NS) and _identities(stack, NS), 60):
            log("warning: the pods' identities are not listed yet; endpoints may start with init")
        time.sleep(1.0)
        log(f"{args.sandboxes} sandboxes per mode through containerd, {args.rounds} rounds, modes interleaved")
        modes = MODES + (PYTHON_MODES if args.python_plugin else ())
        out.update(run_modes(args.sandboxes, args.rounds, socket, work, modes))
        bin_dir = Path(sys.executable).parent
        out["plugin_own_ms"] = plugin_own_ms(bin_dir / "palisade-cni", work)
        if args.python_plugin:
            out["python_plugin_own_ms"] = plugin_own_ms(bin_dir / "palisade-cni-python", work)
        for mode in modes[1:]:
            m, own = out[mode], out["python_plugin_own_ms" if mode.endswith("-python") else "plugin_own_ms"]
            m["datapath_share_ms"] = {c: round(m[f"{c}_ms"]["p50"] - own["p50"], 3) for c in ("add", "del")}
            # Both from the timed rounds (the wrapper's cost in each).
            m["runtime_share_ms"] = round(m["run_sandbox_timed_ms"]["p50"] - m["add_ms"]["p50"], 3)
        if args.burst:
            log(f"burst: {args.burst} palisade-cni ADDs at once")
            out["burst"] = run_burst(args.burst, socket, work)
        if args.keep_logs:
            # The datapath's "endpoint created" / "endpoint deleted" lines carry each step's milliseconds.
            shutil.copytree(stack.run_dir / "logs", args.keep_logs, dirs_exist_ok=True)
    out["summary"] = summary(out)
    out["plots"] = []
    return out


def _identities(stack: Any, namespace: str) -> bool:
    """Whether the pods of ``namespace`` have identities yet."""
    listed = stack.palisade("identity", "list", "-o", "json", "--ipam-address", stack.address("ipam"))
    if listed.returncode != 0:
        return False
    return any(
        label.get("key") == "io.kubernetes.pod.namespace" and label.get("value") == namespace
        for identity in json.loads(listed.stdout).get("identities", [])
        for label in identity.get("labels", [])
    )


def summary(out: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base = out["ptp"]["sandboxes_per_s"]
    rows.append({"metric": "ptp + host-local alone: sandboxes per second via containerd", "value": base, "unit": "1/s"})
    if "plugin_own_ms" in out:
        rows += [
            {"metric": f"palisade-cni's own cost (exec to exit, answered at once) {q}",
             "value": out["plugin_own_ms"][q], "unit": "ms"}
            for q in ("p50", "p99")
        ]  # fmt: skip
    if "python_plugin_own_ms" in out:
        rows.append({"metric": "the Python plugin's own cost (exec to exit, answered at once) p50",
                     "value": out["python_plugin_own_ms"]["p50"], "unit": "ms"})  # fmt: skip
    for mode in ("standalone", "chained"):
        m = out[mode]
        if "datapath_share_ms" in m:
            rows += [
                {"metric": f"{mode}: ADD p50 less the plugin's own cost (the datapath's share)",
                 "value": m["datapath_share_ms"]["add"], "unit": "ms"},
                {"metric": f"{mode}: DEL p50 less the plugin's own cost (the datapath's share)",
                 "value": m["datapath_share_ms"]["del"], "unit": "ms"},
                {"metric": f"{mode}: RunPodSandbox p50 less ADD p50 (containerd's and runc's share"
                 + (", ptp's and host-local's)" if mode == "chained" else ")"),
                 "value": m["runtime_share_ms"], "unit": "ms"},
            ]  # fmt: skip
        if f"{mode}-python" in out:
            py = out[f"{mode}-python"]
            rows += [
                {"metric": f"{mode}, Python plugin per call: ADD {q}", "value": py["add_ms"][q], "unit": "ms"}
                for q in ("p50", "p99")
            ] + [
                {"metric": f"{mode}, Python plugin per call: DEL {q}", "value": py["del_ms"][q], "unit": "ms"}
                for q in ("p50", "p99")
            ]
            rows.append({"metric": f"{mode}, Python plugin per call: sandboxes per second / ptp + host-local alone",
                         "value": round(py["sandboxes_per_s"] / base, 3), "unit": "x"})  # fmt: skip
        rows += [
            {"metric": f"{mode}: palisade-cni ADD p50", "value": m["add_ms"]["p50"], "unit": "ms"},
            {"metric": f"{mode}: palisade-cni ADD p99", "value": m["add_ms"]["p99"], "unit": "ms",
             "target": target("<=", 50.0)},
            {"metric": f"{mode}: palisade-cni DEL p50", "value": m["del_ms"]["p50"], "unit": "ms"},
            {"metric": f"{mode}: palisade-cni DEL p99", "value": m["del_ms"]["p99"], "unit": "ms",
             "target": target("<=", 50.0)},
            {"metric": f"{mode}: sandboxes per second via containerd", "value": m["sandboxes_per_s"], "unit": "1/s"},
            {"metric": f"{mode}: sandboxes per second / ptp + host-local alone (same run, interleaved)",
             "value": round(m["sandboxes_per_s"] / base, 3), "unit": "x", "target": target(">=", 0.8)},
        ]  # fmt: skip
    if "burst" in out:
        b = out["burst"]
        rows.append({
            "metric": f"burst of {b['pods']} pods on one node: first ADD -> all enforced",
            "value": b["first_add_to_all_enforced_s"], "unit": "s", "target": target("<=", 5.0),
        })  # fmt: skip
        rows.append({
            "metric": f"burst of {b['pods']} pods on one node: first DEL -> all gone",
            "value": b["first_del_to_all_gone_s"], "unit": "s",
        })  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 sandboxes per mode in 4 rounds, a burst of 20")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the services' logs there at the end")
    p.add_argument("--sandboxes", type=int, help="sandboxes per mode (default 120; 16 with --quick)")
    p.add_argument(
        "--rounds",
        type=int,
        help="batches per mode, interleaved, alternately the rate's and timed (default 12; 4 with --quick; at least 2)",
    )
    p.add_argument("--burst", type=int, help="pods in the burst (default 100; 20 with --quick; 0: none)")
    p.add_argument(
        "--python-plugin",
        action="store_true",
        help="also the modes standalone-python and chained-python: the Python plugin run for every call",
    )
    args = p.parse_args()
    args.sandboxes = args.sandboxes or (16 if args.quick else 120)
    args.rounds = args.rounds or (4 if args.quick else 12)
    if args.rounds < 2 or args.sandboxes < args.rounds:
        p.error(
            f"--rounds {args.rounds} with --sandboxes {args.sandboxes}: give at least 2 rounds (they alternate "
            "between the rate's and the timed) and at least one sandbox per round"
        )
    args.burst = args.burst if args.burst is not None else (20 if args.quick else 100)
    problem = missing()
    if os.geteuid() != 0 or problem:
        print(json.dumps({"error": problem or "needs root", "summary": [], "plots": []}))
        return 0
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
