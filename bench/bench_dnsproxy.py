"""DNS proxy benchmark: what the node's proxy adds to a lookup, how many it serves, what it keeps.

Run as root (network namespaces, BPF):

    .venv/bin/python -m bench.bench_dnsproxy            # about a minute
    .venv/bin/python -m bench.bench_dnsproxy --quick    # a smoke run

A pod (a network namespace on a veth with Palisade's programs) resolves names at a table DNS
server in another namespace (the outside world), through the proxy process
(``services.datapath.dnsproxyd``) its DNS rule steers it to. Every answered name is new and
selected by a toFQDNs rule, so every lookup learns an address and writes ipcache and policy
entries before its answer is released. Measured:

- ``latency``: one client, lookups one after the other, each to a fresh name; the same without
  steering (straight to the server) is the baseline; the proxy's cost is the difference of
  percentiles;
- ``paced``: lookups sent at ``--rate`` per second from several clients, latency percentiles,
  straight to the server and through the proxy; the proxy's cost is the difference (target:
  p99 added <= 5 ms at 1,000 lookups/s);
- ``first_connections``: lookups of fresh names, each followed at once by a connection to the
  address it answered, on the port only the toFQDNs rule allows: the failures (target: none of
  10,000; a first SYN dropped would wait out the 1 s retransmission, past the 0.9 s timeout);
- ``throughput``: lookups per second answered with several clients sending back to back;
- ``memory``: the proxy process's RSS growth per 10,000 learned addresses (its cache and journal);
- ``restart_gap``: a client looking up every 10 ms; the proxy process is killed (-9) and started
  again at once; the longest time between two answers;
- ``datapath_kill``: the same client while the datapath service process (run as a node runs it,
  with a control plane on a real NATS, the proxy beside it) is killed (-9) and started again: the
  longest gap and the lookups that got no answer (the proxy needs only the pins and the published
  endpoints, so the target is none).

The DNS server runs in a process of its own: in the clients' process, its answers would wait for
their threads (one interpreter lock), and the wait would count as the proxy's.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import multiprocessing
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any, TypeVar

import dns.message

from bench.output import logger, run_as_json
from bench.stats import rss_mib, stats_ms, target
from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc
from services.datapath import dnsrouting, netns
from services.datapath.datapath import Datapath, teardown_all
from services.datapath.dnsnames import NamePublisher
from services.datapath.fqdnmaps import NameEndpoint
from services.datapath.types import (
    IDENTITY_WORLD,
    Direction,
    DnsRule,
    EndpointSpec,
    Enforcement,
    FqdnRule,
    L4Proto,
    NameRules,
    PolicyEntry,
    PolicyKey,
)
from testkit.builders import policy_entry
from testkit.controlplane import control_plane
from testkit.dnsserver import DnsServer, Record, query
from testkit.harness import NatsServer, ServiceProcess, datapath_flags, sync_channel
from testkit.traffic import EchoServer, socket_in

log = logger("dnsproxy")

RULES = NameRules(
    fqdn=(FqdnRule("*.example.test", L4Proto.TCP, 443),), dns=(DnsRule(0, L4Proto.ANY, 53, ("*.example.test",)),)
)
#: The outside world's addresses: every answer names the next one, so each lookup learns a fresh
#: address (65,534 before one repeats). The outside namespace holds the whole block (a local route),
#: so a connection to any of them is answered.
OUTSIDE = ipaddress.ip_network("10.253.0.0/16")


class Table(dict[str, Record]):
    """Every name under example.test answers with the next address of :data:`OUTSIDE` (``answered``:
    shared with the benchmark's process, which counts the addresses the proxy learned)."""

    def __init__(self, answered: Synchronized[int]) -> None:
        super().__init__()
        self.answered = answered

    def get(self, name: str, default: Any = None) -> Record | None:  # type: ignore[override]
        if not name.endswith(".example.test"):
            return None
        self.answered.value += 1
        return Record([str(OUTSIDE[1 + self.answered.value % (OUTSIDE.num_addresses - 2)])], ttl=300)


def _serve_dns(ns: str, address: str, answered: Synchronized[int]) -> None:
    """The outside world's DNS server, in a process of its own: in the benchmark's process its
    answers would wait for the clients' threads (one interpreter lock), and that wait would be
    measured as the proxy's."""
    server = DnsServer(ns, address)
    server.table = Table(answered)
    server.queries = _Discard()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(server.start())
    loop.run_forever()


class _Discard(list[str]):
    def append(self, _: str) -> None:  # the server's record of names: not kept for a million lookups
        pass


class Resolver:
    """A pod's UDP resolver socket, made once (a stub resolver's cost is not the proxy's)."""

    def __init__(self, ns: str, server: str) -> None:
        self.sock = socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM)
        self.server = (server, 53)

    def lookup(self, name: str, timeout: float) -> bool:
        return self.answer(name, timeout) is not None

    def answer(self, name: str, timeout: float) -> bytes | None:
        """The answer's bytes; None when none came within ``timeout``."""
        wire = dns.message.make_query(name, "A").to_wire()
        self.sock.settimeout(timeout)
        self.sock.sendto(wire, self.server)
        deadline = time.perf_counter() + timeout
        try:
            while True:
                raw = self.sock.recv(65535)
                if raw[:2] == wire[:2]:
                    return raw
                self.sock.settimeout(max(0.001, deadline - time.perf_counter()))
        except OSError:
            return None

    def close(self) -> None:
        self.sock.close()


def _lookups(pod: str, server: str, count: int, prefix: str, timeout: float = 2.0) -> list[float]:
    resolver = Resolver(pod, server)
    out = []
    try:
        for i in range(count):
            start = time.perf_counter()
            if resolver.lookup(f"{prefix}{i}.example.test", timeout):
                out.append((time.perf_counter() - start) * 1000)
    finally:
        resolver.close()
    return out


def _first_connections(pod: str, server: str, count: int) -> dict[str, Any]:
    """``count`` lookups of fresh names, each followed at once by a connection to the address it
    answered (port 443, which only the toFQDNs rule allows): how many connected, and of those that
    did not, why and at which lookups. A connection fails if its first SYN was dropped (the
    retransmission comes after 1 s, past the timeout)."""
    resolver = Resolver(pod, server)
    connected = 0
    failures: dict[str, list[int]] = {}
    try:
        for i in range(count):
            raw = resolver.answer(f"first{i}.example.test", 2.0)
            answer = dns.message.from_wire(raw) if raw is not None else None
            ips = [rd.address for rrset in answer.answer for rd in rrset] if answer is not None else []
            if not ips:
                failures.setdefault("no answer", []).append(i)
                continue
            with socket_in(pod, socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.9)
                try:
                    sock.connect((ips[0], 443))
                    connected += 1
                except OSError as exc:
                    failures.setdefault(type(exc).__name__, []).append(i)
    finally:
        resolver.close()
    failed = sum(len(v) for v in failures.values())
    return {
        "connected": connected,
        "failed": failed,
        "failures": {why: {"count": len(at), "first": at[:20]} for why, at in failures.items()},
    }


def _clients(fn: Callable[[int], list[float]], clients: int) -> list[float]:
    results: list[list[float]] = [[] for _ in range(clients)]

    def run(i: int) -> None:
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for r in results for x in r]


NODE = "bench-node"
UDP, TCP = common_pb2.PROTOCOL_UDP, common_pb2.PROTOCOL_TCP
T = TypeVar("T")


def _datapath_kill_gap(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The datapath service process (as a node runs it, with a control plane on a real NATS) and the
    proxy beside it; a client looks up every 10 ms while the datapath is killed (-9) and started
    again: the longest time between two answers, and the lookups that got no answer."""
    loop = asyncio.new_event_loop()  # the control plane's gRPC servers and bus client live on it
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    nats = NatsServer(work / "nats")
    nats.start()
    run_id = "pb" + secrets.token_hex(2)
    bpffs = f"/sys/fs/bpf/palisade-{run_id}"
    state = work / "state"
    o3 = secrets.randbelow(250)
    outside, dns_ip = f"{run_id}x", f"10.252.{o3}.53"
    world = netns.create_pod(outside, outside, [dns_ip])
    answered = multiprocessing.get_context("fork").Value("q", 0)
    server = multiprocessing.get_context("fork").Process(target=_serve_dns, args=(world.name, dns_ip, answered))
    server.start()
    port = 20000 + secrets.randbelow(20000)
    env = {"PALISADE_DNS_PROXY_PORT": str(port)}  # both processes read it
    proxy: subprocess.Popen[bytes] | None = None
    datapath: ServiceProcess | None = None
    plane = control_plane(nats.url, NODE, cidr=f"10.251.{o3}.0/24")
    cp = run(plane.__aenter__())
    try:
        flags = ["--nats-url", nats.url, "--node-name", NODE,
                 *datapath_flags(cp.policy_address, cp.ipam_address, state, bpffs),
                 "--retry-backoff-max", "0.5", "--log-level", "warning"]  # fmt: skip

        def start_datapath() -> ServiceProcess:
            proc = ServiceProcess("datapath", work, flags, env)
            proc.start()
            return proc

        datapath = start_datapath()
        with sync_channel(datapath.address, "datapath") as ch:
            request = datapath_pb2.CreateEndpointRequest(
                namespace=run_id, pod="a", labels=[common_pb2.Label(source="k8s", key="app", value="a")]
            )
            ep = datapath_pb2_grpc.DatapathServiceStub(ch).CreateEndpoint(request, timeout=60)
        dns_allowed = [policy_entry(common_pb2.DIRECTION_EGRESS, IDENTITY_WORLD, 53, p) for p in (UDP, TCP)]
        run(cp.set_policy(ep.identity, dns_allowed, ingress=False, egress=True))
        names = common_pb2.DnsRule(protocol=common_pb2.PROTOCOL_ANY, port=53, selectors=["*.example.test"])
        fqdn = common_pb2.FqdnRule(
            selector="*.example.test", protocol=common_pb2.PROTOCOL_TCP, port_low=443, verdict=common_pb2.VERDICT_ALLOW
        )
        run(cp.wait_realized(run(cp.set_names(ep.identity, [fqdn], [names])), [ep.id]))
        cmd = [sys.executable, "-m", "services.datapath.dnsproxyd", "--bpffs", bpffs, "--state-dir", str(state),
               "--dns-proxy-port", str(port), "--log-level", "warning"]  # fmt: skip
        proxy = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        pod = f"pal_{run_id}_a"
        while query(pod, dns_ip, "warmup.example.test", timeout=0.2) is None:
            time.sleep(0.05)
        before = answered.value

        answers: list[float] = []
        sent = 0
        stop = threading.Event()

        def prober() -> None:
            # As a stub resolver: a 1 s timeout, then one retry; unanswered is what both lost
            # (a lookup lost once shows in the gap as a second or more).
            nonlocal sent
            resolver = Resolver(pod, dns_ip)
            while not stop.is_set():
                sent += 1
                name = f"dpgap{sent}.example.test"
                if resolver.lookup(name, 1.0) or resolver.lookup(name, 1.0):
                    answers.append(time.perf_counter())
                time.sleep(0.01)
            resolver.close()

        log("datapath kill: kill -9 of the datapath process under lookups, started again at once")
        t = threading.Thread(target=prober)
        t.start()
        try:
            time.sleep(0.5)
            datapath.kill()
            datapath = start_datapath()
            time.sleep(args.gap_seconds)
        finally:
            stop.set()
            t.join()
        gap = max((b - a for a, b in itertools.pairwise(answers)), default=float("nan")) * 1000
        return {
            "datapath_kill_gap_ms": round(gap, 1),
            "datapath_kill_lookups": sent,
            "datapath_kill_unanswered": sent - len(answers),
            "datapath_kill_proxied": answered.value - before,
        }
    finally:
        if proxy is not None:
            proxy.kill()
            proxy.wait()
        if datapath is not None:
            datapath.kill()
        run(plane.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        server.kill()
        server.join(5)
        nats.stop()
        netns.delete_pod(world)
        for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
            if name.startswith(f"pal_{run_id}_"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if os.path.isdir(bpffs):
            teardown_all(bpffs)
        dnsrouting.remove()


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    run_id = "pb" + secrets.token_hex(2)
    base = f"/sys/fs/bpf/palisade-{run_id}"
    netns.enable_forwarding()
    o2, o3 = 200 + secrets.randbelow(50), secrets.randbelow(256)
    dp = Datapath.open(base)
    pod = netns.create_pod(f"{run_id}a", f"{run_id}a", [f"10.{o2}.{o3}.1"])
    ext = netns.create_pod(f"{run_id}x", f"{run_id}x", [f"10.{o2}.{o3}.129"])
    server_ip = f"10.{o2}.{o3}.129"
    answered = multiprocessing.get_context("fork").Value("q", 0)
    server = multiprocessing.get_context("fork").Process(target=_serve_dns, args=(ext.name, server_ip, answered))
    server.start()
    # The outside world holds all of OUTSIDE and answers on 443; the host routes the block to it
    # through its address (a device route would take a neighbour entry per destination, and past
    # 1,024 of them, gc_thresh3, the host's table overflows and drops packets).
    subprocess.run(["ip", "-n", ext.name, "route", "add", "local", str(OUTSIDE), "dev", "lo"], check=True)
    subprocess.run(["ip", "route", "replace", str(OUTSIDE), "via", server_ip, "dev", ext.host_ifname], check=True)
    web = EchoServer(ext.name, (443,), ())
    state = Path(tempfile.mkdtemp(prefix="palisade-dnsbench-"))
    port = 20000 + secrets.randbelow(20000)
    proc: subprocess.Popen[bytes] | None = None
    cmd = [sys.executable, "-m", "services.datapath.dnsproxyd", "--bpffs", base, "--state-dir", str(state),
           "--dns-proxy-port", str(port), "--log-level", "warning"]  # fmt: skip
    try:
        dp.attach_endpoint(EndpointSpec(id=101, ifindex=pod.host_ifindex, host_ifname=pod.host_ifname,
                                        ips=(f"10.{o2}.{o3}.1",), identity=1001))  # fmt: skip
        allow_dns = [
            PolicyEntry(PolicyKey(Direction.EGRESS, IDENTITY_WORLD, p, 53)) for p in (L4Proto.UDP, L4Proto.TCP)
        ]
        dp.sync_policy(101, Enforcement(egress=True), allow_dns)
        publisher = NamePublisher(str(state), dp, port)
        n = 200 if args.quick else args.lookups

        clients = args.clients
        per_client = args.rate / clients

        def paced(i: int, prefix: str) -> list[float]:
            resolver = Resolver(pod.name, server_ip)
            out, k = [], 0
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                due = start + k / per_client
                if (wait := due - time.perf_counter()) > 0:
                    time.sleep(wait)
                sent = time.perf_counter()
                if resolver.lookup(f"{prefix}{i}-{k}.example.test", 2.0):
                    out.append((time.perf_counter() - sent) * 1000)
                k += 1
            resolver.close()
            return out

        log(f"baseline: {n} lookups straight to the server, then {args.rate}/s for {args.seconds}s")
        publisher.publish([NameEndpoint(101, 1001, (f"10.{o2}.{o3}.1",), NameRules())])
        while query(pod.name, server_ip, "warmup.example.test", timeout=0.2) is None:
            pass
        direct = _lookups(pod.name, server_ip, n, "direct")
        direct_paced = _clients(lambda i: paced(i, "dp"), clients)

        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        publisher.publish([NameEndpoint(101, 1001, (f"10.{o2}.{o3}.1",), RULES)])
        while query(pod.name, server_ip, "warmup.example.test", timeout=0.2) is None:
            pass
        rss_before = rss_mib(proc.pid)
        learned_before = answered.value
        log(f"proxied: {n} lookups, each a fresh name")
        proxied = _lookups(pod.name, server_ip, n, "fresh")

        firsts = 200 if args.quick else args.first_connections
        log(f"first connections: {firsts} lookups, each followed at once by a connection to its answer")
        first = _first_connections(pod.name, server_ip, firsts)

        log(f"throughput: {clients} clients back to back")
        started = time.perf_counter()
        done = _clients(lambda i: _lookups(pod.name, server_ip, n // clients, f"t{i}-"), clients)
        rate = len(done) / (time.perf_counter() - started)

        log(f"paced: {args.rate}/s from {clients} clients for {args.seconds}s")
        paced_ms = _clients(lambda i: paced(i, "p"), clients)
        learned = answered.value - learned_before
        rss_after = rss_mib(proc.pid)
        per_10k = (rss_after - rss_before) / max(1, learned) * 10_000

        log("restart gap: kill -9 of the proxy process, started again at once")
        answers: list[float] = []
        stop = threading.Event()

        def prober() -> None:
            resolver = Resolver(pod.name, server_ip)
            k = 0
            while not stop.is_set():
                k += 1
                if resolver.lookup(f"gap{k}.example.test", 0.05):
                    answers.append(time.perf_counter())
                time.sleep(0.01)
            resolver.close()

        t = threading.Thread(target=prober)
        t.start()
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        time.sleep(args.gap_seconds)
        stop.set()
        t.join()
        gap = max((b - a for a, b in itertools.pairwise(answers)), default=float("nan")) * 1000

        proc.kill()
        proc.wait()
        proc = None
        with tempfile.TemporaryDirectory(prefix="palisade-dnsbench-dp-") as work:
            killed = _datapath_kill_gap(args, Path(work))

        lat_direct, lat_proxied, lat_paced = stats_ms(direct), stats_ms(proxied), stats_ms(paced_ms)
        lat_direct_paced = stats_ms(direct_paced)
        added_p50 = round(lat_proxied["p50"] - lat_direct["p50"], 3)
        added_p99 = round(lat_proxied["p99"] - lat_direct["p99"], 3)
        paced_added_p50 = round(lat_paced["p50"] - lat_direct_paced["p50"], 3)
        paced_added_p99 = round(lat_paced["p99"] - lat_direct_paced["p99"], 3)
        return {
            "latency_direct_ms": lat_direct,
            "latency_proxied_ms": lat_proxied,
            "latency_paced_ms": lat_paced,
            "latency_direct_paced_ms": lat_direct_paced,
            "paced_rate": args.rate,
            "paced_answered": len(paced_ms),
            "direct_paced_answered": len(direct_paced),
            "throughput_lookups_per_s": round(rate, 1),
            "learned_addresses": learned,
            "rss_mib": {"before": round(rss_before, 1), "after": round(rss_after, 1)},
            "restart_gap_ms": round(gap, 1),
            "first_connections": first,
            **killed,
            "summary": [
                {"metric": "proxy latency added p50", "value": added_p50, "unit": "ms"},
                {"metric": "proxy latency added p99", "value": added_p99, "unit": "ms"},
                {"metric": f"proxy latency added p50 at {args.rate:g}/s", "value": paced_added_p50, "unit": "ms"},
                {
                    "metric": f"proxy latency added p99 at {args.rate:g}/s",
                    "value": paced_added_p99,
                    "unit": "ms",
                    "target": target("<=", 5.0),
                },
                {"metric": f"lookup p99 at {args.rate:g}/s, proxied", "value": lat_paced["p99"], "unit": "ms"},
                {"metric": f"lookup p99 at {args.rate:g}/s, straight", "value": lat_direct_paced["p99"], "unit": "ms"},
                {
                    "metric": f"first connections after a lookup failed (of {firsts}, each a fresh address)",
                    "value": first["failed"],
                    "unit": "connections",
                    "target": target("<=", 0.0),
                },
                {"metric": "lookups/s (one node)", "value": round(rate, 1), "unit": "1/s"},
                {"metric": "proxy RSS per 10,000 learned addresses", "value": round(per_10k, 1), "unit": "MiB"},
                {"metric": "longest DNS gap, proxy kill -9 + restart", "value": round(gap, 1), "unit": "ms"},
                {
                    "metric": "longest DNS gap, datapath kill -9 + restart",
                    "value": killed["datapath_kill_gap_ms"],
                    "unit": "ms",
                },
                {
                    "metric": "lookups unanswered within one retry across the datapath kill -9",
                    "value": killed["datapath_kill_unanswered"],
                    "unit": "lookups",
                    "target": target("<=", 0.0),
                },
            ],
        }
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        server.kill()
        server.join(5)
        web.close()
        for link in (pod, ext):
            netns.delete_pod(link)
        dp.teardown()
        dnsrouting.remove()
        shutil.rmtree(state, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--lookups", type=int, default=2000, help="lookups per latency series")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (throughput, paced)")
    p.add_argument("--rate", type=float, default=1000.0, help="paced lookups per second")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the paced run")
    p.add_argument(
        "--first-connections", type=int, default=10_000, help="lookups each followed by a connection to the answer"
    )
    p.add_argument("--gap-seconds", type=float, default=3.0, help="probing time after the restart")
    return p.parse_args(argv)


def missing() -> str | None:
    return None if os.geteuid() == 0 else "needs root (network namespaces, BPF)"


def main(argv: list[str] | None = None) -> int:
    return run_as_json(run_bench, parse_args(argv), missing=missing)


if __name__ == "__main__":
    sys.exit(main())
