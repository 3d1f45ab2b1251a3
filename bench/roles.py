"""The processes of the namespace benchmarks: two routed pods, an accept server and a connection
client inside them, iperf3 runs, and the clean-up after.

The accept server and the connection client are this module run in a pod's namespace
(``python -m bench.roles --role accept|connect``), each pinned to its own CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.datapath import netns
from services.datapath.datapath import teardown_all
from services.datapath.netns import PodLink

#: How this module runs itself in a namespace (from the project root, as `make bench` runs it).
SELF = ["-m", "bench.roles"]

ROOT = Path(__file__).resolve().parents[1]

IPERF_PORT = 5201
#: The connection-rate server listens on CONN_PORT .. CONN_PORT + CONN_PORTS - 1: an aligned
#: block, so it is one policy-map prefix and one iptables rule.
CONN_PORT = 6144
CONN_PORTS = 32

#: Client source ports for the connection-rate test, below the default ephemeral range (32768+)
#: so they never meet iperf3's. With CONN_PORTS destination ports: 704,000 distinct 4-tuples, about
#: as many connections as a default run makes.
CLIENT_PORT_LOW = 10000
CLIENT_PORTS = 22000


#: Where the connection client and the accept server run (indexes into the allowed CPUs).
CLIENT_CPU = 0
SERVER_CPU = 1


def pin_to_cpu(index: int) -> None:
    """Run this process on CPU ``index`` (modulo the CPUs it may use): the connection client and the
    accept server each on their own, so every variant is measured with the same placement (left to
    the scheduler, it changes between samples and moves a sample's rate by up to 15 %)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[index % len(cpus)]})


def role_accept(ports: Sequence[int]) -> int:
    """Accept-and-close server (runs inside the destination namespace, on the second CPU)."""
    pin_to_cpu(SERVER_CPU)
    sel = selectors.DefaultSelector()
    listeners = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(4096)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        listeners.append(s)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:  # BlockingIOError: nothing more to accept now
                    break
                conn.close()


def role_connect(src: str, dst: str, seconds: float, start: int) -> int:
    """Connect / wait for the server's close / close, for ``seconds`` (runs in the source namespace,
    on the first CPU).

    Connection ``n`` uses destination port ``CONN_PORT + n % CONN_PORTS`` and source port
    ``CLIENT_PORT_LOW + (n // CONN_PORTS) % CLIENT_PORTS`` (``n`` counts on across samples): a
    4-tuple comes back only after 704,000 connections, minutes later, long after both conntracks
    forgot the closed flow (10 s), so every connection is a new flow. The client closes with a reset
    (SO_LINGER 0) after the server's FIN, so neither side keeps TIME_WAIT sockets.
    """
    pin_to_cpu(CLIENT_CPU)
    linger = struct.pack("ii", 1, 0)
    n = start
    ok = errors = 0
    began = time.perf_counter()
    deadline = began + seconds
    while time.perf_counter() < deadline:
        dport = CONN_PORT + n % CONN_PORTS
        sport = CLIENT_PORT_LOW + (n // CONN_PORTS) % CLIENT_PORTS
        n += 1
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            s.settimeout(2.0)
            s.bind((src, sport))
            s.connect((dst, dport))
            if s.recv(1) == b"":
                ok += 1
            else:
                errors += 1
        except OSError:
            errors += 1
        finally:
            s.close()
    elapsed = time.perf_counter() - began
    print(json.dumps({"connections": ok, "errors": errors, "seconds": elapsed, "next": n}))
    return 0


class Server:
    """A long-running process in a namespace, ended by its pid."""

    def __init__(self, name: str, ns: str, argv: list[str], ready_line: str | None = None) -> None:
        self.name, self.ns, self.argv, self.ready_line = name, ns, argv, ready_line
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, *self.argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if self.ready_line else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            cwd=ROOT,
        )
        if self.ready_line:
            assert self.proc.stdout is not None
            sel = selectors.DefaultSelector()
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(15) or self.proc.stdout.readline().strip() != self.ready_line:
                raise RuntimeError(f"{self.name} did not start in {self.ns}")
            sel.close()
        else:
            time.sleep(0.3)
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited at start ({self.proc.returncode})")

    def ensure(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(3)
        if proc.stdout is not None:
            proc.stdout.close()


def create_pod_pair(prefix: str, pods: list[PodLink]) -> tuple[PodLink, PodLink]:
    """Two pods (``<prefix>s`` and ``<prefix>d``) routed through the host, added to ``pods`` as made."""
    netns.enable_forwarding()
    o2 = 150 + secrets.randbelow(50)
    o3 = 64 + secrets.randbelow(190)
    src = netns.create_pod(f"{prefix}s", f"{prefix}s", [f"10.{o2}.{o3}.1"])
    pods.append(src)
    dst = netns.create_pod(f"{prefix}d", f"{prefix}d", [f"10.{o2}.{o3}.2"])
    pods.append(dst)
    return src, dst


def start_servers(dst: PodLink, extra_ports: Sequence[int], servers: list[Server]) -> tuple[Server, Server]:
    """iperf3 and the accept server (the connection ports and ``extra_ports``) in ``dst``, both added to ``servers``."""
    iperf_server = Server("iperf3 server", dst.name, ["iperf3", "-s", "-p", str(IPERF_PORT)])
    ports = [*range(CONN_PORT, CONN_PORT + CONN_PORTS), *extra_ports]
    accept_argv = [sys.executable, *SELF, "--role", "accept", "--ports", ",".join(map(str, ports))]
    accept_server = Server("accept server", dst.name, accept_argv, ready_line="ready")
    for server in (iperf_server, accept_server):
        servers.append(server)
        server.start()
    return iperf_server, accept_server


def clean_up(
    prefix: str, base: str, servers: Sequence[Server], pods: Sequence[PodLink], steps: Sequence[tuple[str, Any]]
) -> dict[str, Any]:
    """Stop the servers, run ``steps`` (name, callable), remove the pins and pods; what could not be undone."""
    problems: list[str] = []

    def attempt(what: str, fn: Any, *a: Any) -> None:
        try:
            fn(*a)
        except Exception as exc:
            problems.append(f"{what}: {exc}")

    for server in servers:
        attempt(f"stop {server.name}", server.stop)
    for what, fn in steps:
        attempt(what, fn)
    attempt("teardown_all", teardown_all, base)
    for pod in pods:
        attempt(f"delete {pod.name}", netns.delete_pod, pod)
    return {"problems": problems, "netns_left": netns.list_netns(prefix), "bpf_dir_left": os.path.exists(base)}


# -- measurements ------------------------------------------------------------------------


def iperf(ns: str, ip: str, seconds: float, *, udp: bool, server: Server) -> dict[str, float]:
    cmd = ["ip", "netns", "exec", ns, "iperf3", "-c", ip, "-p", str(IPERF_PORT), "-t", f"{seconds:g}", "-J"]
    cmd += ["--connect-timeout", "3000"]
    if udp:
        cmd += ["-u", "-l", "64", "-b", "0"]
    last = ""
    for _ in range(3):
        server.ensure()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
        try:
            data = json.loads(proc.stdout)
        except json.JSONDecodeError:
            data = {"error": proc.stdout[-300:] + proc.stderr[-300:]}
        if "error" not in data and proc.returncode == 0:
            end = data["end"]
            if udp:
                recv = end.get("sum_received") or end["sum"]
                sent = end.get("sum_sent") or end["sum"]
                got = recv["packets"] - recv["lost_packets"]
                return {
                    "value": got / recv["seconds"],
                    "sent_pps": sent["packets"] / sent["seconds"],
                    "lost_percent": float(recv["lost_percent"]),
                }
            recv = end["sum_received"]
            return {"value": recv["bits_per_second"] / 1e9, "retransmits": float(end["sum_sent"].get("retransmits", 0))}
        last = str(data.get("error"))
        time.sleep(0.5)
    raise RuntimeError(f"iperf3 {'UDP' if udp else 'TCP'} failed: {last}")


def conntrack_count() -> int | None:
    try:
        return int(Path("/proc/sys/net/netfilter/nf_conntrack_count").read_text())
    except (OSError, ValueError):
        return None


def connection_rate(src: PodLink, dst_ip: str, seconds: float, start: int) -> dict[str, float]:
    cmd = ["ip", "netns", "exec", src.name, sys.executable, *SELF, "--role", "connect"]
    cmd += ["--src", src.ips[0], "--dst", dst_ip, "--seconds", f"{seconds:g}", "--start", str(start)]
    before = conntrack_count()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, cwd=ROOT)
    after = conntrack_count()
    if proc.returncode != 0:
        raise RuntimeError(f"connection client failed: {proc.stderr[-500:]}")
    out = json.loads(proc.stdout)
    result = {
        "value": out["connections"] / out["seconds"],
        "connections": float(out["connections"]),
        "errors": float(out["errors"]),
        "next": float(out["next"]),
    }
    if before is not None and after is not None:
        # Netfilter's conntrack is only active while the iptables variants' rules exist.
        result["nf_conntrack_count_change"] = float(after - before)
    return result


def run_cmd(argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc


def missing_prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, BPF, iptables)"
    for tool in ("ip", "iperf3", "iptables", "iptables-restore", "iptables-save"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a process role of the namespace benchmarks (started by them)")
    p.add_argument("--role", choices=("accept", "connect"), required=True)
    p.add_argument("--ports", default="")
    p.add_argument("--src", default="")
    p.add_argument("--dst", default="")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--start", type=int, default=0)
    args = p.parse_args(argv)
    if args.role == "accept":
        return role_accept([int(port) for port in args.ports.split(",")])
    return role_connect(args.src, args.dst, args.seconds, args.start)


if __name__ == "__main__":
    sys.exit(main())
