"""Datapath cost benchmark: what enforcement costs per packet, Palisade (BPF at tc) vs. iptables.

Run as root on a machine with bcc, iperf3 and iptables:

    .venv/bin/python bench/bench_datapath_cost.py            # about 15 minutes
    .venv/bin/python bench/bench_datapath_cost.py --quick    # under a minute, a smoke run

Two pods (network namespaces joined to the host by veths and routed through
it, as Palisade wires pods) exchange traffic under three kinds of variant,
all measured in one run:

- ``none``: no filter at all: no programs attached, no iptables rules;
- ``palisade-N``: Palisade's programs on both host veths, ingress and egress
  enforced on both pods by a policy that allows the measured traffic, while
  the policy map holds N other entries (other remote identities and ports:
  half on the two measured endpoints, half on eight other endpoint ids) and
  the ipcache N other addresses. As the agent runs them by default, with
  local delivery: the source's program judges the destination's ingress
  policy too and puts the packet straight into the destination's namespace,
  so Palisade's packets skip the host's routing and netfilter, which ``none``
  and ``iptables-N`` go through;
- ``palisade-host-N`` (the middle level only): the same with local delivery
  off (``--local-delivery false``): packets go through the host's routing as
  in ``none``, each judged at both veths. What local delivery is worth, and
  what enforcement costs on the host's path;
- ``palisade-other-N`` (the top level only, with ``--compare-attach``): ``palisade-N`` with
  its programs attached the other way (clsact filters where the run attaches with tcx, tcx
  links where it attaches with tc), from a third datapath with pins of its own: what the
  attach mechanism costs per packet, measured in the same rounds;
- ``redirect``: the limit of the packet path: a tc program that only forwards
  (bench/bareredirect.py: destination lookup, Ethernet addresses, TTL, then
  ``bpf_redirect_peer``, as local delivery does), no conntrack and no policy.
  ``Palisade N / redirect`` is what enforcement costs on the fastest path the
  kernel offers; ``palisade-host-N / none`` what it costs on the host's path;
- ``iptables-N``: the same policy written the way iptables-based engines write
  it: a chain jumped to from FORWARD that accepts conntrack ESTABLISHED and
  RELATED first (as kube-router and Calico do), then dispatches on the host
  veth (``-i``/``-o``) to one chain per pod and direction holding one rule per
  allowed remote address and port. All N other rules sit in the two chains a
  new flow from the source to the destination walks (the source's egress
  chain, then the destination's ingress chain) and the allowing rules come
  last: the worst case of a linear ruleset, paid by the first packet of every
  new flow (later packets match the ESTABLISHED rule).

Every round runs each variant once, in forward order on even rounds and
backward order on odd ones (A B C, C B A, ...), so a slow drift of the
machine hits every variant alike. Metrics, as medians over rounds and as
ratios to ``none``:

- TCP throughput: one iperf3 stream;
- 64-byte UDP rate: packets per second received (iperf3 -u -l 64 -b 0);
- new-connection rate: a Python client in the source pod connects, waits for
  the server's close and closes, against an accept-and-close server in the
  destination pod. Every connection uses a fresh 4-tuple, so each one is a new
  flow for Palisade's conntrack and for netfilter's. Palisade's flow events
  are taken throughout, as the agent takes them while no Observe client
  listens (a thread that takes them with ``skip_flows`` once a poll, the way
  the datapath service's flow hub does), so their cost is in every figure; the
  reader's CPU time per event is in the output (``events``).

Samples are noisy on a small shared machine; the output also has per-round
paired ratios (variant / none of the same round) and quartiles. After the
rounds, a few more UDP and connection samples per Palisade variant run with
the kernel's BPF run-time accounting on (BPF_ENABLE_STATS; it costs a little
per run, so never during the rounds): the programs' own cost in nanoseconds
per packet and per connection, far less sensitive to the machine's load
(``bpf_run_time``, medians; ``--bpf-stats-rounds 0`` skips it).

Before the first measurement of each variant, the script checks that it
really does what it claims: the allowed port connects, a port the
destination's ingress policy does not allow and a port the source's egress
policy does not allow are both dropped, and the drop counters (BPF metrics,
iptables rule counters) show where. The checks are in the output
(``checks``, ``checks_passed``).

Everything (namespaces, veths, iptables chains and the FORWARD jump, BPF pins
under /sys/fs/bpf/palisade-bench-<run>) is removed at the end, on failure and
on Ctrl-C too. The FORWARD chain's policy is never changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.bareredirect import BareRedirect
from bench.bpfstats import bpf_run_stats, runs_between, snapshot
from bench.iptables import Iptables, forward_chain, forward_policy
from bench.output import logger, run_as_json
from bench.roles import (
    CONN_PORT,
    CONN_PORTS,
    IPERF_PORT,
    Server,
    clean_up,
    connection_rate,
    create_pod_pair,
    iperf,
    missing_prerequisites,
    start_servers,
)
from bench.stats import median, quartiles, round_to, summarize_bpf, target
from services.datapath.datapath import Datapath, teardown_all
from services.datapath.loader import ATTACH_MODES, ProgramConfig, default_attach
from services.datapath.maps.bpf import prog_test_run
from services.datapath.netns import PodLink
from services.datapath.types import (
    Direction,
    EndpointSpec,
    Enforcement,
    L4Proto,
    PolicyEntry,
    PolicyKey,
    Reason,
)
from testkit.traffic import tc_frame as frame
from testkit.traffic import tcp_connects

#: How long the flow reader waits between two takes: the datapath service's default (flow_poll_ms).
FLOW_READ_POLL_MS = 200
#: Allowed by the source's egress policy, not by the destination's ingress policy.
PROBE_INGRESS_PORT = 7998
#: Allowed by neither.
PROBE_EGRESS_PORT = 7999

SRC_EP, DST_EP = 1, 2
OTHER_EPS = tuple(range(11, 19))
SRC_IDENTITY, DST_IDENTITY = 1001, 1002
OTHER_IDENTITY_BASE = 20000
#: The other remote addresses (rules and ipcache only; nothing routes to them).
OTHER_ADDR_BASE = int(ipaddress.IPv4Address("100.64.0.0"))
DEFAULT_LEVELS = (10, 1000, 10000)
ENFORCE_BOTH = Enforcement(ingress=True, egress=True)

#: How long a connection may take before a check calls it dropped.
DENY_TIMEOUT = 0.3
ALLOW_TIMEOUT = 3.0

#: Targets: every ratio to no filter at least this; the BPF run time per established packet
#: (both hooks) at most half the 589 ns measured before the work on it; the new-connection
#: cost flat from the fewest to the most entries (within 10%).
RATIO_TARGET = 0.95
PACKET_NS_TARGET = 295.0
FLAT_TARGET = 1.1
#: 64-byte UDP, Palisade at the most entries / the bare redirect, and through the host / no filter.
LIMIT_TARGET = 0.9
HOST_PATH_TARGET = 0.95

log = logger("datapath_cost")

METRICS: dict[str, dict[str, str]] = {
    "tcp_throughput": {"label": "TCP throughput", "unit": "Gbit/s"},
    "udp_64b_rate": {"label": "64-byte UDP rate", "unit": "packets/s"},
    "connection_rate": {"label": "New-connection rate", "unit": "connections/s"},
}


def human(n: int) -> str:
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # "none" | "redirect" | "palisade" | "palisade-host" | "palisade-other" | "iptables"
    entries: int = 0
    #: palisade-other: the mechanism its programs are attached with ("tc" or "tcx").
    mechanism: str = ""

    @property
    def name(self) -> str:
        return self.kind if self.kind in ("none", "redirect") else f"{self.kind}-{self.entries}"

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "no filter"
        if self.kind == "redirect":
            return "bare redirect (forwarding only: the limit)"
        if self.kind == "palisade":
            return f"Palisade {human(self.entries)} entries"
        if self.kind == "palisade-host":
            return f"Palisade {human(self.entries)} entries through the host (local delivery off)"
        if self.kind == "palisade-other":
            return f"Palisade {human(self.entries)} entries attached with {self.mechanism}"
        return f"iptables {human(self.entries)} rules"

    @property
    def runs_palisade(self) -> bool:
        return self.kind in ("palisade", "palisade-host", "palisade-other")


@dataclasses.dataclass(frozen=True)
class Other:
    """One "other" policy entry / iptables rule: a remote that is not the measured peer."""

    addr: str
    identity: int
    protocol: L4Proto
    port: int


def other(i: int) -> Other:
    # Ports 1024..5023: never one the measured traffic uses.
    return Other(
        addr=str(ipaddress.IPv4Address(OTHER_ADDR_BASE + 1 + i)),
        identity=OTHER_IDENTITY_BASE + i,
        protocol=L4Proto.TCP if i % 2 == 0 else L4Proto.UDP,
        port=1024 + (i * 7) % 4000,
    )


# -- the allowed traffic, in both engines ----------------------------------------------

#: (protocol, port_low, port_high) the source may send to the destination.
EGRESS_ALLOWED = (
    (L4Proto.TCP, IPERF_PORT, IPERF_PORT),
    (L4Proto.UDP, IPERF_PORT, IPERF_PORT),
    (L4Proto.TCP, CONN_PORT, CONN_PORT + CONN_PORTS - 1),
    (L4Proto.TCP, PROBE_INGRESS_PORT, PROBE_INGRESS_PORT),
)
#: What the destination accepts from the source.
INGRESS_ALLOWED = EGRESS_ALLOWED[:3]


def palisade_policy(n: int) -> dict[int, list[PolicyEntry]]:
    """Entries per endpoint: the allowing ones plus ``n`` others (half on src/dst, half elsewhere)."""
    policy: dict[int, list[PolicyEntry]] = {ep: [] for ep in (SRC_EP, DST_EP, *OTHER_EPS)}
    for proto, low, high in EGRESS_ALLOWED:
        policy[SRC_EP].append(PolicyEntry(PolicyKey(Direction.EGRESS, DST_IDENTITY, proto, low, high)))
    for proto, low, high in INGRESS_ALLOWED:
        policy[DST_EP].append(PolicyEntry(PolicyKey(Direction.INGRESS, SRC_IDENTITY, proto, low, high)))
    ours = n // 2
    for i in range(n):
        o = other(i)
        if i < ours:
            ep, direction = (SRC_EP, Direction.EGRESS) if i % 2 == 0 else (DST_EP, Direction.INGRESS)
        else:
            ep = OTHER_EPS[i % len(OTHER_EPS)]
            direction = Direction.INGRESS if (i // len(OTHER_EPS)) % 2 else Direction.EGRESS
        policy[ep].append(PolicyEntry(PolicyKey(direction, o.identity, o.protocol, o.port)))
    return policy


def sent_packets(ifname: str) -> int:
    """Packets the host has sent on ``ifname``: a packet put into the peer with bpf_redirect_peer
    is not one of them, a packet the host's routing forwards to the pod is."""
    return int(open(f"/sys/class/net/{ifname}/statistics/tx_packets").read())


# -- the bench -------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = secrets.token_hex(2)
        self.prefix = f"pbc{self.run}"
        self.base = f"/sys/fs/bpf/palisade-bench-{self.run}"
        self.host_base = f"{self.base}-host"
        self.pods: list[PodLink] = []
        self.servers: list[Server] = []
        self.dp: Datapath | None = None
        #: A second datapath (own pins) whose programs have local delivery off: palisade-host-N.
        self.dp_host: Datapath | None = None
        #: With --compare-attach, a third (own pins) attaching the other way: palisade-other-N.
        self.dp_other: Datapath | None = None
        self.other_base = f"{self.base}-other"
        self.ipt: Iptables | None = None
        self.redirect: BareRedirect | None = None
        self.current: Variant | None = None
        self.next_conn = 0
        self.checks: list[dict[str, Any]] = []
        self.events: dict[str, float] = {"taken": 0, "drained": 0, "lost": 0}
        self._stop_reading = threading.Event()
        self._reader: threading.Thread | None = None

    # setup / teardown -----------------------------------------------------------------

    def setup(self) -> None:
        self.src, self.dst = create_pod_pair(self.prefix, self.pods)
        self.dst_ip = self.dst.ips[0]
        extra = (PROBE_INGRESS_PORT, PROBE_EGRESS_PORT)
        self.iperf_server, self.accept_server = start_servers(self.dst, extra, self.servers)
        self.dp = Datapath.open(self.base, attach=self.args.attach)
        host = ProgramConfig(local_delivery=False)
        self.dp_host = Datapath.open(self.host_base, config=host, attach=self.args.attach)
        if self.args.compare_attach:
            self.dp_other = Datapath.open(self.other_base, attach=other_mechanism(main_mechanism(self.args)))
        self.redirect = BareRedirect((self.src, self.dst))
        self._reader = threading.Thread(target=self._read_flows, name="flow-reader", daemon=True)
        self._reader.start()
        self.ipt = Iptables(
            self.run,
            self.src,
            self.dst,
            other=other,
            egress_allowed=EGRESS_ALLOWED,
            ingress_allowed=INGRESS_ALLOWED,
        )
        self.src_spec = EndpointSpec(SRC_EP, self.src.host_ifindex, self.src.host_ifname, self.src.ips, SRC_IDENTITY)
        self.dst_spec = EndpointSpec(DST_EP, self.dst.host_ifindex, self.dst.host_ifname, self.dst.ips, DST_IDENTITY)

    def _read_flows(self) -> None:
        """The agent's flow reader with nobody observing, as the flow hub does it: take what is
        there without decoding it, then wait one poll."""
        began = time.thread_time()
        while not self._stop_reading.is_set():
            for dp in self.datapaths():
                self.events["taken"] += dp.skip_flows(0)
            self._stop_reading.wait(FLOW_READ_POLL_MS / 1000)
        self.events["reader_cpu_s"] = round(time.thread_time() - began, 3)

    def cleanup(self) -> dict[str, Any]:
        self._stop_reading.set()
        if self._reader is not None:
            self._reader.join()
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.ipt is not None:
            steps.append(("iptables", self.ipt.uninstall))
        if self.redirect is not None:
            steps.append(("bare redirect", self.redirect.close))
        if self.dp is not None:
            steps.append(("datapath teardown", self.dp.teardown))
        if self.dp_host is not None:
            steps.append(("datapath (local delivery off) teardown", self.dp_host.teardown))
        steps.append(("teardown_all (local delivery off)", functools.partial(teardown_all, self.host_base)))
        if self.dp_other is not None:
            steps.append(("datapath (other attach) teardown", self.dp_other.teardown))
            steps.append(("teardown_all (other attach)", functools.partial(teardown_all, self.other_base)))
        out = clean_up(self.prefix, self.base, self.servers, self.pods, steps)
        out["bpf_dir_left"] = out["bpf_dir_left"] or os.path.exists(self.host_base) or os.path.exists(self.other_base)
        out["iptables_chains_left"] = sorted(self.ipt.our_chains()) if self.ipt is not None else []
        return out

    # variants ---------------------------------------------------------------------------

    def datapaths(self) -> list[Datapath]:
        return [dp for dp in (self.dp, self.dp_host, self.dp_other) if dp is not None]

    def datapath(self, variant: Variant) -> Datapath:
        """The datapath whose programs a Palisade variant runs."""
        dp = {"palisade-host": self.dp_host, "palisade-other": self.dp_other}.get(variant.kind, self.dp)
        assert dp is not None
        return dp

    def switch(self, variant: Variant) -> float:
        """Leave the current variant and set up ``variant``; returns the seconds it took."""
        assert self.dp is not None and self.ipt is not None
        started = time.perf_counter()
        current = self.current
        if current is not None and current.runs_palisade and variant.kind != current.kind:
            self.datapath(current).detach_endpoint(SRC_EP)
            self.datapath(current).detach_endpoint(DST_EP)
        if current is not None and current.kind == "iptables":
            self.ipt.uninstall()
        if current is not None and current.kind == "redirect" and self.redirect is not None:
            self.redirect.detach()
        if variant.kind == "redirect" and self.redirect is not None:
            self.redirect.attach()
        elif variant.runs_palisade:
            self.palisade(variant.entries, self.datapath(variant))
        elif variant.kind == "iptables":
            self.ipt.install(variant.entries)
        self.current = variant
        return time.perf_counter() - started

    def palisade(self, n: int, dp: Datapath) -> None:
        for ep, entries in palisade_policy(n).items():
            dp.sync_policy(ep, ENFORCE_BOTH, entries)
        desired = {f"{other(i).addr}/32": other(i).identity for i in range(n)}
        desired[f"{self.src.ips[0]}/32"] = SRC_IDENTITY
        desired[f"{self.dst_ip}/32"] = DST_IDENTITY
        current = dp.ipcache_dump()
        for prefix in current.keys() - desired.keys():
            dp.ipcache_delete(prefix)
        for prefix, identity in desired.items():
            if current.get(prefix) != identity:
                dp.ipcache_upsert(prefix, identity)
        dp.attach_endpoint(self.src_spec)
        dp.attach_endpoint(self.dst_spec)

    def drain_events(self) -> None:
        lost = 0
        for dp in self.datapaths():
            while events := dp.read_flows(0):
                self.events["drained"] += len(events)
            lost += dp.counters().events_lost
        self.events["lost"] = lost

    # checks -----------------------------------------------------------------------------

    def check(self, variant: Variant, name: str, passed: bool, detail: str) -> None:
        self.checks.append({"variant": variant.name, "check": name, "passed": bool(passed), "detail": detail})
        if not passed:
            log(f"CHECK FAILED: {variant.name}: {name}: {detail}")

    def run_checks(self, variant: Variant) -> None:
        assert self.dp is not None and self.ipt is not None
        src, ip = self.src.name, self.dst_ip
        allowed = tcp_connects(src, ip, CONN_PORT, ALLOW_TIMEOUT)
        self.check(variant, "allowed-port-connects", allowed, f"tcp {CONN_PORT}")
        if variant.kind == "none":
            # So that a probe failing under a filter is the filter, never a missing listener.
            for port in (PROBE_INGRESS_PORT, PROBE_EGRESS_PORT):
                ok = tcp_connects(src, ip, port, ALLOW_TIMEOUT)
                self.check(variant, "probe-port-open-without-filter", ok, f"tcp {port} has a listener")
        elif variant.runs_palisade:
            self.palisade_checks(variant)
        elif variant.kind == "redirect":
            self.redirect_checks(variant)
        else:
            self.iptables_checks(variant)

    def _drops(self, dp: Datapath, ep_id: int, direction: Direction) -> int:
        c = dp.counters()
        return sum(
            c.packets(endpoint_id=ep_id, reason=r, direction=direction)
            for r in (Reason.POLICY_DENY, Reason.DEFAULT_DENY)
        )

    def palisade_checks(self, variant: Variant) -> None:
        dp = self.datapath(variant)
        src, ip = self.src.name, self.dst_ip
        for port, ep, direction, what in (
            (PROBE_INGRESS_PORT, DST_EP, Direction.INGRESS, "ingress"),
            (PROBE_EGRESS_PORT, SRC_EP, Direction.EGRESS, "egress"),
        ):
            before = self._drops(dp, ep, direction)
            blocked = not tcp_connects(src, ip, port, DENY_TIMEOUT)
            dropped = self._drops(dp, ep, direction) - before
            self.check(
                variant,
                f"{what}-denied-port-dropped",
                blocked and dropped > 0,
                f"tcp {port}: connect {'failed' if blocked else 'succeeded'}, "
                f"{dropped} packets dropped at endpoint {ep} {what}",
            )
        prefixes = sum(len(p) for p in dp.policy.read().values())
        # One prefix per other entry, plus the allowing ones (the 32-port block is one prefix).
        expected = variant.entries + len(EGRESS_ALLOWED) + len(INGRESS_ALLOWED)
        self.check(variant, "policy-map-populated", prefixes == expected, f"{prefixes} prefixes, {expected} expected")
        enforced = dp.dump_policy(SRC_EP)[0] == ENFORCE_BOTH and dp.dump_policy(DST_EP)[0] == ENFORCE_BOTH
        self.check(variant, "ingress-and-egress-enforced", enforced, "both endpoints, both directions")

    def redirect_checks(self, variant: Variant) -> None:
        """The limit must really forward by itself: a connection is made, and the host never sent
        its packets to the destination (its veth sent nothing meanwhile)."""
        src, ip = self.src.name, self.dst_ip
        before = sent_packets(self.dst.host_ifname)
        ok = tcp_connects(src, ip, PROBE_INGRESS_PORT, ALLOW_TIMEOUT)
        routed = sent_packets(self.dst.host_ifname) - before
        self.check(variant, "forwards-past-the-host", ok and routed == 0, f"connect {ok}, {routed} packets routed")

    def iptables_checks(self, variant: Variant) -> None:
        assert self.ipt is not None
        ipt, src, ip = self.ipt, self.src.name, self.dst_ip
        for port, chain, what in (
            (PROBE_INGRESS_PORT, ipt.in_dst, "ingress"),
            (PROBE_EGRESS_PORT, ipt.eg_src, "egress"),
        ):
            before = ipt.drop_packets(chain)
            blocked = not tcp_connects(src, ip, port, DENY_TIMEOUT)
            dropped = ipt.drop_packets(chain) - before
            self.check(
                variant,
                f"{what}-denied-port-dropped",
                blocked and dropped > 0,
                f"tcp {port}: connect {'failed' if blocked else 'succeeded'}, {dropped} packets hit {chain}'s DROP",
            )
        rules = ipt.rule_count()
        # 6 dispatch rules, the others, the allowing rules, a DROP in each of the 4 pod chains.
        expected = 6 + variant.entries + len(EGRESS_ALLOWED) + len(INGRESS_ALLOWED) + 4
        self.check(variant, "iptables-rules-installed", rules == expected, f"{rules} rules, {expected} expected")

    # measuring --------------------------------------------------------------------------

    def bpf_cost(self, variant: Variant) -> dict[str, dict[str, float]]:
        """Kernel-measured run time of Palisade's programs under 64-byte UDP and new connections.

        Runs after the measured rounds: the accounting itself costs a little per run. A packet
        crosses from_container at the source, then, with local delivery, deliver (the
        destination's ingress policy, tail-called: the kernel accounts a tail call's time to the
        run that made it, so deliver's is in from_container's figure), else to_container at the
        destination's veth.
        """
        template = self.datapath(variant).template
        fds = {"from_container": template.from_container_fd, "to_container": template.to_container_fd}
        seconds = self.args.seconds
        out: dict[str, dict[str, float]] = {}
        with bpf_run_stats():
            for workload in ("udp_64b", "connections"):
                before = snapshot(fds)
                if workload == "udp_64b":
                    got = iperf(self.src.name, self.dst_ip, seconds, udp=True, server=self.iperf_server)
                    units = got["value"] * seconds
                else:
                    self.accept_server.ensure()
                    got = connection_rate(self.src, self.dst_ip, seconds, self.next_conn)
                    self.next_conn = int(got["next"])
                    units = got["connections"]
                row, total_ns = runs_between(before, snapshot(fds))
                if workload == "udp_64b":
                    # Each datagram crosses from_container at the source (deliver inside that run),
                    # or to_container at the destination without local delivery.
                    sent = row["from_container_runs"]
                    row["ns_per_packet"] = round(total_ns / sent, 1) if sent else 0.0
                    row["packets_received"] = round(units)
                else:
                    row["ns_per_connection"] = round(total_ns / units, 1) if units else 0.0
                    row["connections"] = units
                out[workload] = row
        self.drain_events()
        return out

    def program_time(self, variant: Variant) -> dict[str, float]:
        """Program time per packet without traffic (BPF_PROG_TEST_RUN, warm caches, no accounting).

        Precise where the in-traffic figure is noisy: the same frame through each hook
        ``TEST_RUN_REPEAT`` times, in batches of ``TEST_RUN_BATCH`` (a run changes the frame as
        local delivery forwards it, one TTL less: each batch starts from a fresh copy with TTL
        255, so every run in it is delivered), the median of the batches. An established UDP
        datagram crosses
        from_container at the source and, with local delivery, deliver within that run (the
        frame comes back redirected), else to_container at the destination; a TCP reply (the
        ACK stream of a transfer) crosses them the other way. Every timed run must pass the
        frame (a check), or the figure would time a drop.
        """
        dp = self.datapath(variant)
        fds = {"from_container": dp.template.from_container_fd, "to_container": dp.template.to_container_fd}
        local = dp.config.local_delivery
        passed = TC_ACT_REDIRECT if local else TC_ACT_OK
        src_ip, src_if, dst_if = self.src.ips[0], self.src.host_ifindex, self.dst.host_ifindex
        udp = frame(src_ip, self.dst_ip, 40000, IPERF_PORT, socket.IPPROTO_UDP, ttl=255)
        syn = frame(src_ip, self.dst_ip, 40001, CONN_PORT, socket.IPPROTO_TCP, tcp_flags=0x02, ttl=255)
        ack = frame(self.dst_ip, src_ip, CONN_PORT, 40001, socket.IPPROTO_TCP, tcp_flags=0x10, ttl=255)
        cases = (("udp_established", udp, udp, src_if, dst_if), ("tcp_reply", syn, ack, dst_if, src_if))
        out: dict[str, float] = {}
        codes: set[int] = set()
        for name, opening, packet, first, second in cases:
            # The opening packet crosses the source's from_container and the destination's to_container.
            prog_test_run(fds["from_container"], opening, src_if, 1)
            prog_test_run(fds["to_container"], opening, dst_if, 1)
            total = 0.0
            hooks = (("from_container", first),) if local else (("from_container", first), ("to_container", second))
            for hook, ifindex in hooks:
                batches = TEST_RUN_REPEAT // TEST_RUN_BATCH
                runs = [prog_test_run(fds[hook], packet, ifindex, TEST_RUN_BATCH) for _ in range(batches)]
                codes |= {code for code, _ in runs}
                ns = median([duration for _, duration in runs])
                out[f"{name}_{hook}_ns"] = float(ns)
                total += ns
            out[f"{name}_ns_per_packet"] = total
        self.check(variant, "test-run frames pass", codes == {passed}, f"return codes {sorted(codes)}")
        return out

    def measure(self, variant: Variant) -> dict[str, dict[str, float]]:
        seconds = self.args.seconds
        out: dict[str, dict[str, float]] = {}
        out["tcp_throughput"] = iperf(self.src.name, self.dst_ip, seconds, udp=False, server=self.iperf_server)
        out["udp_64b_rate"] = iperf(self.src.name, self.dst_ip, seconds, udp=True, server=self.iperf_server)
        self.accept_server.ensure()
        conn = connection_rate(self.src, self.dst_ip, seconds, self.next_conn)
        self.next_conn = int(conn.pop("next"))
        out["connection_rate"] = conn
        if variant.runs_palisade:
            self.drain_events()
        return out


#: Runs per BPF_PROG_TEST_RUN measurement, and the code a passed frame returns.
TEST_RUN_REPEAT = 200_000
#: Runs per BPF_PROG_TEST_RUN call: fewer than the 254 hops a TTL of 255 allows.
TEST_RUN_BATCH = 250
TC_ACT_OK = 0
#: What from_container returns for a packet it delivered to a local endpoint (bpf_redirect_peer).
TC_ACT_REDIRECT = 7


def analyse(
    variants: list[Variant],
    samples: dict[str, dict[str, list[float]]],
    levels: Sequence[int],
    bpf_cost: dict[str, dict[str, dict[str, float]]],
) -> dict[str, Any]:
    medians = {v.name: {m: round_to(median(samples[v.name][m])) for m in METRICS} for v in variants}
    base = medians["none"]
    ratios = {
        v.name: {m: round_to(medians[v.name][m] / base[m]) if base[m] else 0.0 for m in METRICS} for v in variants
    }
    paired: dict[str, dict[str, float]] = {}
    for v in variants:
        paired[v.name] = {}
        for m in METRICS:
            pairs = [x / b for x, b in zip(samples[v.name][m], samples["none"][m], strict=False) if b > 0]  # same round
            paired[v.name][m] = round_to(median(pairs))
    spread = {v.name: {m: quartiles(samples[v.name][m]) for m in METRICS} for v in variants}
    summary: list[dict[str, Any]] = []
    for m, meta in METRICS.items():
        summary.append({"metric": f"{meta['label']}, no filter (median)", "value": base[m], "unit": meta["unit"]})
        for v in variants:
            if v.kind != "none":
                row = {"metric": f"{meta['label']}, {v.label} / no filter", "value": ratios[v.name][m], "unit": "x"}
                if v.kind == "palisade":
                    row["target"] = target(">=", RATIO_TARGET)
                if v.kind == "palisade-host" and m == "udp_64b_rate":
                    row["target"] = target(">=", HOST_PATH_TARGET)
                summary.append(row)
        if "redirect" in medians and medians["redirect"][m]:
            for v in variants:
                if v.kind == "palisade":
                    value = round_to(medians[v.name][m] / medians["redirect"][m])
                    row = {"metric": f"{meta['label']}, {v.label} / bare redirect", "value": value, "unit": "x"}
                    if m == "udp_64b_rate" and v.entries == max(levels):
                        row["target"] = target(">=", LIMIT_TARGET)
                    summary.append(row)
        for v in variants:
            same = f"palisade-{v.entries}"
            if v.kind == "palisade-other" and medians[same][m]:
                value = round_to(medians[v.name][m] / medians[same][m])
                label = f"{meta['label']}, {v.label} / attached with {other_mechanism(v.mechanism)}"
                summary.append({"metric": label, "value": value, "unit": "x"})
    plots = []
    for m, meta in METRICS.items():
        series: dict[str, list[list[float]]] = {
            "Palisade (BPF)": [[n, ratios[f"palisade-{n}"][m]] for n in levels],
            "iptables": [[n, ratios[f"iptables-{n}"][m]] for n in levels],
            "no filter": [[levels[0], 1.0], [levels[-1], 1.0]],
        }
        plots.append(
            {
                "name": f"cost_{m}",
                "title": f"{meta['label']} relative to no filter",
                "xlabel": "other policy entries (Palisade) / rules (iptables)",
                "ylabel": "ratio to no filter (median)",
                "kind": "line",
                "logx": True,
                "series": series,
            }
        )
    if bpf_cost:
        by_name = {v.name: v for v in variants}
        for name, cost in bpf_cost.items():
            row = {
                "metric": f"BPF run time per 64-byte packet (source and destination), {by_name[name].label}",
                "value": cost["udp_64b"]["ns_per_packet"],
                "unit": "ns",
            }
            if by_name[name].kind == "palisade":
                row["target"] = target("<=", PACKET_NS_TARGET)
            summary.append(row)
            label = by_name[name].label
            summary.append(
                {
                    "metric": f"BPF run time per new connection (all packets, both pods), {label}",
                    "value": cost["connections"]["ns_per_connection"],
                    "unit": "ns",
                }
            )
        fewest, most = bpf_cost[f"palisade-{levels[0]}"], bpf_cost[f"palisade-{levels[-1]}"]
        if fewest["connections"]["ns_per_connection"]:
            summary.append(
                {
                    "metric": f"BPF run time per new connection, {human(levels[-1])} / {human(levels[0])} entries",
                    "value": round_to(
                        most["connections"]["ns_per_connection"] / fewest["connections"]["ns_per_connection"]
                    ),
                    "unit": "x",
                    "target": target("<=", FLAT_TARGET),
                }
            )
        plots.append(
            {
                "name": "cost_bpf_run_time",
                "title": "Palisade program run time (kernel BPF stats)",
                "xlabel": "other policy entries",
                "ylabel": "ns",
                "kind": "line",
                "logx": True,
                "series": {
                    "per 64-byte packet (source and destination)": [
                        [n, bpf_cost[f"palisade-{n}"]["udp_64b"]["ns_per_packet"]] for n in levels
                    ],
                    "per new connection (all hooks)": [
                        [n, bpf_cost[f"palisade-{n}"]["connections"]["ns_per_connection"]] for n in levels
                    ],
                },
            }
        )
    return {
        "medians": medians,
        "ratios": ratios,
        "paired_ratios": paired,
        "quartiles": spread,
        "bpf_run_time": bpf_cost,
        "summary": summary,
        "plots": plots,
    }


def main_mechanism(args: argparse.Namespace) -> str:
    """How palisade-N attaches: ``--attach``, else the datapath's default with local delivery."""
    return str(args.attach or default_attach(ProgramConfig()))


def other_mechanism(mechanism: str) -> str:
    """The other way to attach: tc for tcx (and for auto, tcx where the kernel has it), tcx for tc."""
    return "tcx" if mechanism == "tc" else "tc"


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).splitlines()[0].strip()
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = sorted(set(args.levels))
    variants = [Variant("none"), Variant("redirect")]
    for n in levels:
        variants += [Variant("palisade", n), Variant("iptables", n)]
    variants.append(Variant("palisade-host", levels[len(levels) // 2]))
    bench = Bench(args)
    if args.compare_attach:
        variants.append(Variant("palisade-other", max(levels), other_mechanism(main_mechanism(args))))
    result: dict[str, Any] = {
        "config": {
            "rounds": args.rounds,
            "bpf_stats_rounds": args.bpf_stats_rounds,
            "seconds_per_sample": args.seconds,
            "levels": levels,
            "attach": {
                "palisade": main_mechanism(args),
                "palisade-host": args.attach or default_attach(ProgramConfig(local_delivery=False)),
            },
            "order": "each round runs every variant once; forward order on even rounds, backward on odd",
            "variants": {v.name: v.label for v in variants},
            "metrics": METRICS,
            "kernel": os.uname().release,
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "iptables": tool_version(["iptables", "--version"]),
            "iperf3": tool_version(["iperf3", "--version"]),
            "layout": {
                "palisade": "N other entries (single ports, other identities): N/2 on the measured endpoints "
                "(source egress, destination ingress), N/2 on 8 other endpoint ids; ipcache holds the N "
                "other addresses; ingress and egress enforced on both pods",
                "iptables": "FORWARD -> dispatch chain: ctstate RELATED,ESTABLISHED ACCEPT, INVALID DROP, then "
                "-i/-o host veth to per-pod chains; all N other rules in the source's egress and the "
                "destination's ingress chains (both walked by each new flow), allowing rules last, then DROP",
                "connection_rate": "client: bind fresh 4-tuple, connect, wait for the server's close, close "
                "with RST; server: accept and close",
            },
        }
    }
    forward_before = forward_chain()
    samples: dict[str, dict[str, list[float]]] = {v.name: {m: [] for m in METRICS} for v in variants}
    extra: dict[str, dict[str, list[dict[str, float]]]] = {v.name: {m: [] for m in METRICS} for v in variants}
    setup_seconds: dict[str, list[float]] = {v.name: [] for v in variants}
    checked: set[str] = set()
    bpf_samples: dict[str, list[dict[str, dict[str, float]]]] = {}
    program_times: dict[str, dict[str, float]] = {}
    started = time.monotonic()
    try:
        bench.setup()
        assert bench.dp is not None
        result["config"]["template"] = {
            "hash": bench.dp.template.short,
            "compile_seconds": round(bench.dp.template.compile_seconds, 3),
        }
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                setup_seconds[v.name].append(round(bench.switch(v), 4))
                if v.name not in checked:
                    bench.run_checks(v)
                    checked.add(v.name)
                got = bench.measure(v)
                for m in METRICS:
                    samples[v.name][m].append(got[m].pop("value"))
                    extra[v.name][m].append(got[m])
                log(
                    f"[round {r + 1}/{args.rounds}] {v.name:>15}: "
                    f"tcp {samples[v.name]['tcp_throughput'][-1]:.2f} Gbit/s, "
                    f"udp {samples[v.name]['udp_64b_rate'][-1]:.0f} pps, "
                    f"conn {samples[v.name]['connection_rate'][-1]:.0f}/s"
                )
        # The attach mechanism does not change a program's own run time: palisade-other is left out.
        palisade = [v for v in variants if v.runs_palisade and v.kind != "palisade-other"]
        for r in range(args.bpf_stats_rounds):
            for v in palisade if r % 2 == 0 else palisade[::-1]:
                bench.switch(v)
                bpf_samples.setdefault(v.name, []).append(bench.bpf_cost(v))
                if r == 0:
                    program_times[v.name] = bench.program_time(v)
                log(f"[bpf run time {r + 1}/{args.bpf_stats_rounds}] {v.name}: {json.dumps(bpf_samples[v.name][-1])}")
        bench.switch(Variant("none"))
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            cleanup = bench.cleanup()
        finally:
            signal.signal(signal.SIGINT, previous)
    forward_after = forward_chain()
    cleanup["forward_policy_unchanged"] = forward_policy(forward_after) == forward_policy(forward_before)
    cleanup["forward_jumps_left"] = [line for line in forward_after if f"PALB-{bench.run}-" in line]
    if forward_after != forward_before:  # someone else may edit FORWARD meanwhile; show it
        cleanup["forward_chain_before"], cleanup["forward_chain_after"] = forward_before, forward_after
    result.update(analyse(variants, samples, levels, summarize_bpf(bpf_samples)))
    result["bpf_run_time_samples"] = bpf_samples
    result["program_time"] = program_times
    labels = {v.name: v.label for v in variants}
    for name, times in program_times.items():
        label = labels[name]
        for what, key in (("established 64-byte UDP packet", "udp_established"), ("TCP reply", "tcp_reply")):
            result["summary"].append(
                {
                    "metric": f"program time per {what}, source and destination, without traffic (test run), {label}",
                    "value": times[f"{key}_ns_per_packet"],
                    "unit": "ns",
                }
            )
    result["samples"] = samples
    result["sample_details"] = extra
    result["setup_seconds"] = setup_seconds
    result["flow_events"] = bench.events
    taken = bench.events["taken"] + bench.events["drained"]
    if taken:
        result["summary"].append(
            {
                "metric": "agent's flow reader CPU time per flow event (nobody observing)",
                "value": round(bench.events.get("reader_cpu_s", 0.0) / taken * 1e6, 2),
                "unit": "us",
            }
        )
    result["checks"] = bench.checks
    result["checks_passed"] = bool(bench.checks) and all(c["passed"] for c in bench.checks)
    result["cleanup"] = cleanup
    result["cleanup_ok"] = (
        not cleanup["problems"]
        and not cleanup["netns_left"]
        and not cleanup["iptables_chains_left"]
        and not cleanup["bpf_dir_left"]
        and cleanup["forward_policy_unchanged"]
        and not cleanup["forward_jumps_left"]
    )
    result["run_seconds"] = round(time.monotonic() - started, 1)
    result["config"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["summary"].append(
        {
            "metric": "enforcement checks passed",
            "value": sum(c["passed"] for c in bench.checks),
            "unit": f"of {len(bench.checks)}",
        }
    )
    problems = []
    if not result["checks_passed"]:
        problems.append(
            "enforcement checks failed: "
            + "; ".join(f"{c['variant']} {c['check']}" for c in bench.checks if not c["passed"])
        )
    if not result["cleanup_ok"]:
        problems.append(f"cleanup incomplete: {cleanup}")
    if problems:
        result["error"] = " | ".join(problems)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 1-second samples (under a minute)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds; each runs every variant once (default 12; even balances the order)",
    )
    p.add_argument("--seconds", type=int, default=None, help="seconds per sample, whole (iperf3 -t) (default 2)")
    p.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(DEFAULT_LEVELS),
        help="comma-separated other-entry/rule counts (default 10,1000,10000)",
    )
    p.add_argument(
        "--bpf-stats-rounds",
        type=int,
        default=None,
        help="repetitions of the final kernel BPF run-time measurement of Palisade's programs "
        "(default 5, --quick 1; 0 skips it)",
    )
    p.add_argument(
        "--attach",
        choices=ATTACH_MODES,
        default="",
        help="how Palisade's programs go on the veths (default: the datapath's, by its local delivery: tc for "
        "palisade-N, tcx where the kernel has it for palisade-host)",
    )
    p.add_argument(
        "--compare-attach",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run Palisade at the top level attached the other way (tc / tcx), in the same rounds "
        "(default: on, off with --quick)",
    )
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 12
    if args.compare_attach is None:
        args.compare_attach = not args.quick
    if args.bpf_stats_rounds is None:
        args.bpf_stats_rounds = 1 if args.quick else 5
    if args.seconds is None:
        args.seconds = 1 if args.quick else 2
    if args.rounds < 1 or args.seconds < 1 or not args.levels or min(args.levels) < 1:
        p.error("--rounds, --seconds and --levels must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_as_json(run_bench, parse_args(argv), missing=missing_prerequisites)


if __name__ == "__main__":
    sys.exit(main())
