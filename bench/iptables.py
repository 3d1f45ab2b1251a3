"""The iptables baseline of the datapath cost benchmark: a policy written the way iptables-based
engines write it (per-pod chains dispatched from FORWARD), installed with iptables-restore.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Protocol

from bench.roles import run_cmd
from services.datapath.netns import PodLink
from services.datapath.types import L4Proto

#: (protocol, first port, last port) allowed from the source to the destination.
Allowed = tuple[L4Proto, int, int]


class OtherRule(Protocol):
    """One rule for a remote that is not the measured peer."""

    @property
    def addr(self) -> str: ...
    @property
    def protocol(self) -> L4Proto: ...
    @property
    def port(self) -> int: ...


class Iptables:
    """The iptables baseline: per-pod chains dispatched from FORWARD, built with iptables-restore."""

    def __init__(
        self,
        run: str,
        src: PodLink,
        dst: PodLink,
        *,
        other: Callable[[int], OtherRule],
        egress_allowed: Sequence[Allowed],
        ingress_allowed: Sequence[Allowed],
    ) -> None:
        """``other(i)`` is the i-th other rule; the allowed lists say what the source may send and the
        destination accept."""
        self.prefix = f"PALB-{run}"
        self._other = other
        self._egress_allowed = egress_allowed
        self._ingress_allowed = ingress_allowed
        self.src, self.dst = src, dst
        self.fwd = f"{self.prefix}-FWD"
        self.eg_src = f"{self.prefix}-EG-S"
        self.in_dst = f"{self.prefix}-IN-D"
        self.eg_dst = f"{self.prefix}-EG-D"
        self.in_src = f"{self.prefix}-IN-S"
        self.chains = (self.fwd, self.eg_src, self.in_dst, self.eg_dst, self.in_src)

    def ruleset(self, n: int) -> str:
        src_ip, dst_ip = self.src.ips[0], self.dst.ips[0]
        lines = ["*filter", *(f":{c} - [0:0]" for c in self.chains)]
        add = lines.append
        add(f"-A {self.fwd} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT")
        add(f"-A {self.fwd} -m conntrack --ctstate INVALID -j DROP")
        add(f"-A {self.fwd} -i {self.src.host_ifname} -j {self.eg_src}")
        add(f"-A {self.fwd} -i {self.dst.host_ifname} -j {self.eg_dst}")
        add(f"-A {self.fwd} -o {self.src.host_ifname} -j {self.in_src}")
        add(f"-A {self.fwd} -o {self.dst.host_ifname} -j {self.in_dst}")
        # Every other rule sits in a chain a new src->dst flow walks; the allowing rules come last.
        for i in range(n):
            o = self._other(i)
            match = f"-p {o.protocol} -m {o.protocol} --dport {o.port}"
            if i % 2 == 0:
                add(f"-A {self.eg_src} -d {o.addr}/32 {match} -j RETURN")
            else:
                add(f"-A {self.in_dst} -s {o.addr}/32 {match} -j ACCEPT")
        for proto, low, high in self._egress_allowed:
            ports = str(low) if low == high else f"{low}:{high}"
            add(f"-A {self.eg_src} -d {dst_ip}/32 -p {proto} -m {proto} --dport {ports} -j RETURN")
        add(f"-A {self.eg_src} -j DROP")
        for proto, low, high in self._ingress_allowed:
            ports = str(low) if low == high else f"{low}:{high}"
            add(f"-A {self.in_dst} -s {src_ip}/32 -p {proto} -m {proto} --dport {ports} -j ACCEPT")
        add(f"-A {self.in_dst} -j DROP")
        # The destination only answers and the source only is answered: ESTABLISHED covers both.
        add(f"-A {self.eg_dst} -j DROP")
        add(f"-A {self.in_src} -j DROP")
        add(f"-I FORWARD 1 -j {self.fwd}")
        add("COMMIT")
        return "\n".join(lines) + "\n"

    def install(self, n: int) -> None:
        self.uninstall()
        run_cmd(["iptables-restore", "-w", "10", "--noflush"], stdin=self.ruleset(n))

    def uninstall(self) -> None:
        while run_cmd(["iptables", "-w", "10", "-D", "FORWARD", "-j", self.fwd], check=False).returncode == 0:
            pass
        existing = self.our_chains()
        for chain in self.chains:
            if chain in existing:
                run_cmd(["iptables", "-w", "10", "-F", chain], check=False)
        for chain in self.chains:
            if chain in existing:
                run_cmd(["iptables", "-w", "10", "-X", chain], check=False)

    def our_chains(self) -> set[str]:
        out = run_cmd(["iptables-save", "-t", "filter"], check=False).stdout
        return set(re.findall(rf"^:({re.escape(self.prefix)}-\S+)", out, re.M))

    def rule_count(self) -> int:
        out = run_cmd(["iptables-save", "-t", "filter"]).stdout
        return sum(1 for line in out.splitlines() if line.startswith(f"-A {self.prefix}-"))

    def drop_packets(self, chain: str) -> int:
        """Packets the final DROP rule of ``chain`` has counted."""
        out = run_cmd(["iptables", "-w", "10", "-t", "filter", "-L", chain, "-n", "-v", "-x"]).stdout
        rows = [line.split() for line in out.splitlines()[2:] if line.strip()]
        if not rows or rows[-1][2] != "DROP":
            raise RuntimeError(f"{chain} does not end in DROP")
        return int(rows[-1][0])


def forward_chain() -> list[str]:
    return run_cmd(["iptables", "-w", "10", "-S", "FORWARD"]).stdout.splitlines()


def forward_policy(lines: list[str]) -> str:
    return next((line for line in lines if line.startswith("-P FORWARD")), "")
