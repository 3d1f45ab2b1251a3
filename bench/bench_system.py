"""The whole system: writing a policy file -> the changed connectivity enforced, seen with real packets.

    sudo .venv/bin/python bench/bench_system.py [--pods 50] [--changes 50] [--quick]

Runs the stack the way `make run` does (``python -m services.devstack`` with its own
manifest folder, run dir, bpffs directory and free ports), with ``--pods`` Pods of one
namespace on the dev node, each serving TCP 8080, and one NetworkPolicy per pod (pod i
admits pod i+1 on a port nobody probes), so every pod is policy-enforced. Once every
endpoint is READY, a policy file selecting pod-1 is rewritten ``--changes`` times,
alternately admitting pod-0 on 8080 and not, and a probe agent inside pod-0's network
namespace opens a new TCP connection to pod-1:8080 every ``--interval`` seconds until
the new verdict holds. The time from the file's rename into the folder to the first
connection attempt that saw the new verdict (the first one that succeeded; or the
first of an unbroken run of failures lasting ``--confirm`` seconds) is one sample.
The watcher polls the folder every 0.5 s (its default), which is part of the figure;
a random pause before each write keeps the writes out of step with the polls.

Needs root and bcc. Everything it creates (processes, namespaces, pins, temporary
directories) is removed on exit, also on failure. ``--quick``: 10 pods, 5 changes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.output import logger, run_timed
from bench.stats import percentile, stats_ms, target
from services.common.access import INBOX_PREFIX
from services.common.grpcserver import open_channel
from services.common.subjects import k8s_subject
from services.common.trust import Credentials, TrustError

ROOT = Path(__file__).resolve().parent.parent

PORT = 8080
CLUSTER_CIDR = "10.214.0.0/16"  # apart from other stacks' pod addresses on this machine


log = logger("system")


# -- the probe agent (a child process inside the source pod's namespace) -------------------


@dataclass
class Attempt:
    start: float
    done: bool = False
    ok: bool = False


async def attempt_once(ip: str, port: int, timeout: float, attempt: Attempt) -> None:
    """One new TCP connection; ok when the server's greeting arrives within ``timeout``."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
        left = max(0.01, attempt.start + timeout - time.monotonic())
        attempt.ok = bool(await asyncio.wait_for(reader.readline(), left))
    except (OSError, TimeoutError):
        attempt.ok = False
    finally:
        attempt.done = True
        if writer is not None:
            writer.close()


def verdict_time(attempts: list[Attempt], want: bool, confirm: float) -> float | None:
    """When the wanted verdict started to hold, if the attempts so far show it; else None.

    Allowed: the earliest successful attempt, once every attempt started before it is done.
    Denied: the first attempt after the last success, once every attempt started in the
    ``confirm`` seconds from it is done and failed (a verdict flips once, it does not flap).
    """
    if want:
        ok = [a.start for a in attempts if a.done and a.ok]
        if not ok:
            return None
        first = min(ok)
        return first if all(a.done for a in attempts if a.start < first) else None
    last_ok = max((a.start for a in attempts if a.done and a.ok), default=float("-inf"))
    after = [a for a in attempts if a.start > last_ok]
    if not after:
        return None
    first = after[0].start
    if attempts[-1].start < first + confirm:
        return None
    window = [a for a in after if a.start <= first + confirm]
    return first if all(a.done and not a.ok for a in window) else None


async def wait_for_verdict(request: dict[str, Any]) -> dict[str, Any]:
    ip, port, want = str(request["ip"]), int(request["port"]), bool(request["want"])
    interval, timeout, confirm = float(request["interval"]), float(request["timeout"]), float(request["confirm"])
    deadline = time.monotonic() + float(request["deadline"])
    attempts: list[Attempt] = []
    tasks: set[asyncio.Task[None]] = set()
    try:
        while time.monotonic() < deadline:
            attempt = Attempt(time.monotonic())
            attempts.append(attempt)
            task = asyncio.create_task(attempt_once(ip, port, timeout, attempt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(interval)
            at = verdict_time(attempts, want, confirm)
            if at is not None:
                return {"at": at, "attempts": len(attempts)}
        return {"error": f"{'allowed' if want else 'denied'} not seen within {request['deadline']}s"}
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def probe_agent(netns: str) -> int:
    """Answer one JSON request per stdin line with one JSON line, from inside ``netns``."""
    from services.devstack.netnsexec import enter

    enter(netns)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = asyncio.run(wait_for_verdict(json.loads(line)))
        print(json.dumps(answer), flush=True)
    return 0


class Agent:
    def __init__(self, netns: str) -> None:
        cmd = [sys.executable, "-m", "bench.bench_system", "--probe-agent", netns]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if json.loads(self.readline()).get("ready") is not True:
            raise RuntimeError("the probe agent did not start")

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the probe agent exited ({self.proc.poll()})")
        return line

    def wait(self, ip: str, want: bool, args: argparse.Namespace, deadline: float = 60.0) -> float:
        request = {
            "ip": ip,
            "port": PORT,
            "want": want,
            "interval": args.interval,
            "timeout": args.attempt_timeout,
            "confirm": args.confirm,
            "deadline": deadline,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.readline())
        if "error" in answer:
            raise RuntimeError(f"probe to {ip}:{PORT}: {answer['error']}")
        return float(answer["at"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


# -- manifests -------------------------------------------------------------------------


def manifests(namespace: str, pods: int, node: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": {"team": "bench"}}}
    ]
    for i in range(pods):
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"pod-{i}", "namespace": namespace, "labels": {"app": f"pod-{i}"}},
                "spec": {
                    "nodeName": node,
                    "containers": [
                        {"name": "srv", "image": "bench", "ports": [{"name": "http", "containerPort": PORT}]}
                    ],
                },
            }
        )
    return docs


def base_policies(namespace: str, pods: int) -> list[dict[str, Any]]:
    """Pod i admits pod i+1 on port 9000+i: every pod is selected, none of it is probed."""
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"base-{i}", "namespace": namespace},
            "spec": {
                "podSelector": {"matchLabels": {"app": f"pod-{i}"}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"app": f"pod-{(i + 1) % pods}"}}}],
                        "ports": [{"port": 9000 + i, "protocol": "TCP"}],
                    }
                ],
            },
        }
        for i in range(pods)
    ]


class Hops:
    """When each hop of a change reached the bus: the watcher's delta and the policy service's order.

    Follows the flip policy's subject and the node's order subject on the stream with a
    consumer of its own, in a thread, and keeps each message's JetStream timestamp (the
    server's clock, which is this machine's, as the writes' and probes' times are).
    """

    def __init__(self, nats_url: str, namespace: str, credentials: Credentials) -> None:
        self.deltas: list[float] = []
        self.orders: list[float] = []
        self._url = nats_url
        self._credentials = credentials
        self._subjects = {
            k8s_subject("networkpolicy", namespace, "bench-flip"): self.deltas,
            "palisade.regen.dev-node": self.orders,
        }
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the hop observer did not subscribe")

    async def _run(self) -> None:
        import nats
        from nats.js import api as jsapi

        # The policy service's bus user reads both streams (k8s objects in, orders out).
        who = self._credentials
        nc = await nats.connect(
            self._url, tls=who.client_ssl_context(), tls_hostname="nats", inbox_prefix=INBOX_PREFIX + who.name
        )
        js = nc.jetstream()
        subs = []
        for subject, into in self._subjects.items():

            async def on_msg(msg: Any, into: list[float] = into) -> None:
                into.append(msg.metadata.timestamp.timestamp())

            config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.NEW)
            subs.append(await js.subscribe(subject, cb=on_msg, ordered_consumer=True, config=config))
        self._ready.set()
        await asyncio.to_thread(self._stop.wait)
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()

    def first_after(self, into: list[float], t: float, timeout: float = 5.0) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = [x for x in list(into) if x >= t]
            if later:
                return min(later)
            time.sleep(0.005)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def flip_policy(namespace: str, allow: bool) -> dict[str, Any]:
    """pod-1 admits pod-0 on 8080 (allow) or pod-2 instead (pod-0 denied)."""
    peer = "pod-0" if allow else "pod-2"
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "bench-flip", "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {"app": "pod-1"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"app": peer}}}],
                    "ports": [{"port": PORT, "protocol": "TCP"}],
                }
            ],
        },
    }


def write_yaml(folder: Path, name: str, docs: Sequence[dict[str, Any]], staging: Path) -> None:
    """Write a manifest file whole (rename), so the watcher never sees half of it."""
    import yaml

    tmp = staging / name
    tmp.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    os.replace(tmp, folder / name)


# -- the stack -------------------------------------------------------------------------


def free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports."""
    from testkit.harness import free_port

    return free_port(count)


def descendants(pid: int) -> dict[int, str]:
    """Child processes of ``pid`` (one level) with their command lines."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


class DevStack:
    """`python -m services.devstack` as a child; stop() leaves nothing behind, also when it misbehaves."""

    def __init__(self, tmp: Path, manifests: Path, namespace: str) -> None:
        self.tmp = tmp
        self.namespace = namespace
        self.bpffs = f"/sys/fs/bpf/palisade-bench-{secrets.token_hex(4)}"
        self.grpc_base = free_ports(4)
        self.log_path = tmp / "devstack.log"
        self.nats_port = free_ports(1)
        etcd = free_ports(2)
        cmd = [
            sys.executable, "-m", "services.devstack",
            "--manifests", str(manifests),
            "--run-dir", str(tmp / "run"),
            "--bpffs", self.bpffs,
            "--nats-port", str(self.nats_port),
            "--etcd-port", str(etcd),
            "--grpc-port-base", str(self.grpc_base),
        ]  # fmt: skip
        env = {**os.environ, "PALISADE_CLUSTER_CIDRS": CLUSTER_CIDR}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.children: dict[int, str] = {}

    @property
    def datapath(self) -> str:
        return f"127.0.0.1:{self.grpc_base + 3}"

    @property
    def tls_dir(self) -> Path:
        """The stack's installation, which it makes on start."""
        return self.tmp / "run" / "tls"

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the stack exited ({self.proc.returncode}); its output ends:\n{self.tail()}")

    def remember_children(self) -> None:
        self.children.update(descendants(self.proc.pid))

    def stop(self) -> None:
        self.remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the stack deletes its pods and stops its services
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                log("the stack did not stop within 120s; killing it")
                self.proc.kill()
                self.proc.wait(10)
        for pid, cmdline in self.children.items():  # whatever of ours outlived it
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") == cmdline:
                    os.kill(pid, signal.SIGKILL)
                    log(f"killed a leftover process {pid}: {cmdline.replace(chr(0), ' ')[:100]}")
            except (OSError, ProcessLookupError):
                pass
        from services.datapath.datapath import teardown_all

        try:
            teardown_all(self.bpffs)
        except Exception as exc:
            log(f"cleanup: tearing down {self.bpffs} failed: {exc!r}")
        shutil.rmtree(self.bpffs, ignore_errors=True)
        netns = Path("/run/netns")
        for entry in netns.iterdir() if netns.is_dir() else []:
            if entry.name.startswith(f"pal_{self.namespace}_"):
                subprocess.run(["ip", "netns", "del", entry.name], capture_output=True, check=False)
                log(f"removed a leftover namespace {entry.name}")


async def wait_ready(stack: DevStack, pods: int, timeout: float) -> dict[str, Any]:
    """Every pod's endpoint READY on the datapath; returns them by pod name."""
    import grpc

    from palisade.v1 import datapath_pb2, datapath_pb2_grpc

    deadline = time.monotonic() + timeout
    ready: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            cli = Credentials.load(stack.tls_dir, "cli")
            async with open_channel(stack.datapath, "datapath", cli) as ch:
                stub = datapath_pb2_grpc.DatapathServiceStub(ch)
                listed = await stub.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=5)
            ready = {
                ep.pod: ep
                for ep in listed.endpoints
                if ep.namespace == stack.namespace and ep.state == datapath_pb2.ENDPOINT_STATE_READY
            }
            if len(ready) == pods:
                return ready
        except (grpc.aio.AioRpcError, TrustError):  # not serving yet, or its certificates not made yet
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{len(ready)} of {pods} endpoints READY after {timeout:.0f}s; stack output:\n{stack.tail()}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="palisade-bench-sys-"))
    namespace = f"bsys{secrets.token_hex(3)}"
    folder = tmp / "manifests"
    staging = tmp / "staging"
    folder.mkdir()
    staging.mkdir()
    stack: DevStack | None = None
    agents: list[Agent] = []
    try:
        write_yaml(folder, "00-pods.yaml", manifests(namespace, args.pods, "dev-node"), staging)
        write_yaml(folder, "10-base.yaml", base_policies(namespace, args.pods), staging)
        write_yaml(folder, "20-flip.yaml", [flip_policy(namespace, allow=False)], staging)
        log(f"starting the stack with {args.pods} pods")
        started = time.monotonic()
        stack = DevStack(tmp, folder, namespace)
        endpoints = asyncio.run(wait_ready(stack, args.pods, args.ready_timeout))
        ready_s = time.monotonic() - started
        stack.remember_children()
        src, dst, other = endpoints["pod-0"], endpoints["pod-1"], endpoints["pod-2"]
        ip = dst.ips[0]
        agent = Agent(src.netns)
        agents.append(agent)
        # Baseline: pod-1 serves (pod-2 gets through) and pod-0 is denied.
        witness = Agent(other.netns)
        agents.append(witness)
        witness.wait(ip, True, args, deadline=60)
        agent.wait(ip, False, args, deadline=60)
        log(f"{args.pods} pods ready in {ready_s:.1f}s; timing {args.changes} changes")
        hops = Hops(f"nats://127.0.0.1:{stack.nats_port}", namespace, Credentials.load(stack.tls_dir, "policy"))
        hop_samples: list[tuple[float, float, float]] = []
        samples: list[tuple[bool, float]] = []
        rng = random.Random(1)
        for n in range(args.changes):
            allow = n % 2 == 0
            # A random pause, so that writes do not fall into step with the watcher's polls.
            time.sleep(rng.uniform(0.0, args.jitter))
            wall = time.time()
            write_yaml(folder, "20-flip.yaml", [flip_policy(namespace, allow)], staging)
            written = time.monotonic()
            at = agent.wait(ip, allow, args)
            samples.append((allow, (at - written) * 1000))
            delta = hops.first_after(hops.deltas, wall)
            order = hops.first_after(hops.orders, delta) if delta is not None else None
            if delta is not None and order is not None:
                enforced = wall + (at - written)
                hop_samples.append(((delta - wall) * 1000, (order - delta) * 1000, (enforced - order) * 1000))
            stack.check_alive()
        hops.close()
        stack.remember_children()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        for a in agents:
            a.close()
        if stack is not None:
            log("stopping the stack")
            stack.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    delays = [ms for _, ms in samples]
    allowed = [ms for allow, ms in samples if allow]
    denied = [ms for allow, ms in samples if not allow]
    return {
        "benchmark": "system_policy_file_to_enforced",
        "pods": args.pods,
        "changes": len(samples),
        "probe_interval_ms": args.interval * 1000,
        "start_to_pods_ready_s": round(ready_s, 1),
        "file_to_enforced_ms": stats_ms(delays, 1),
        "file_to_allowed_ms": stats_ms(allowed, 1),
        "file_to_denied_ms": stats_ms(denied, 1) if denied else {},
        "samples_ms": [round(d, 1) for d in delays],
        # Where the time goes: file written -> the watcher's delta on the bus -> the policy
        # service's order on the bus -> the probe sees the new verdict (datapath and probe).
        "hops_ms": {
            name: stats_ms([h[i] for h in hop_samples], 1) if hop_samples else {}
            for i, name in enumerate(("file_to_delta", "delta_to_order", "order_to_enforced"))
        },
        "summary": [
            {
                "metric": f"policy file -> enforced, p50 ({args.pods} pods, {len(samples)} changes)",
                "value": round(percentile(delays, 0.5), 1),
                "unit": "ms",
            },
            {
                "metric": f"policy file -> enforced, p99 ({args.pods} pods, {len(samples)} changes)",
                "value": round(percentile(delays, 0.99), 1),
                "unit": "ms",
                "target": target("<=", 100.0),
            },
            *(
                {"metric": f"hop {name}, p50", "value": stats["p50"], "unit": "ms"}
                for name, stats in (
                    (n, stats_ms([h[i] for h in hop_samples], 1) if hop_samples else {"p50": 0.0})
                    for i, n in enumerate(("file_to_delta", "delta_to_order", "order_to_enforced"))
                )
            ),
            {"metric": "policy file -> now allowed, p50", "value": round(percentile(allowed, 0.5), 1), "unit": "ms"},
            *(
                [{"metric": "policy file -> now denied, p50", "value": round(percentile(denied, 0.5), 1), "unit": "ms"}]
                if denied
                else []
            ),
            {"metric": f"stack start -> {args.pods} pods READY", "value": round(ready_s, 1), "unit": "s"},
        ],
        "plots": [
            {
                "name": "file_to_enforced",
                "title": f"Policy file written -> verdict enforced ({args.pods} pods)",
                "xlabel": "ms",
                "ylabel": "changes",
                "kind": "hist",
                "series": {"now allowed": [round(d, 1) for d in allowed], "now denied": [round(d, 1) for d in denied]},
            }
        ],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 pods, 5 changes")
    p.add_argument("--pods", type=int, help="pods on the node (default 50; 10 with --quick)")
    p.add_argument("--changes", type=int, help="policy changes timed (default 50; 5 with --quick)")
    p.add_argument("--interval", type=float, default=0.005, help="seconds between two connection attempts")
    p.add_argument("--attempt-timeout", type=float, default=0.5, help="seconds one connection attempt may take")
    p.add_argument("--confirm", type=float, default=0.5, help="seconds of failures that make a denial")
    p.add_argument("--jitter", type=float, default=1.0, help="longest random pause before a change, seconds")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for the pods to become READY")
    p.add_argument("--probe-agent", metavar="NETNS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe_agent:
        return probe_agent(args.probe_agent)
    args.pods = args.pods or (10 if args.quick else 50)
    args.changes = args.changes or (5 if args.quick else 50)
    if args.pods < 3 or args.changes < 1:
        p.error("--pods must be at least 3 and --changes at least 1")
    if os.geteuid() != 0:
        log("needs root (the stack creates namespaces and loads BPF programs)")
        return 2
    return run_timed(run, args, log)


if __name__ == "__main__":
    sys.exit(main())
