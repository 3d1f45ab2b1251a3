"""Masquerade: pod traffic leaving the cluster goes out with the node's address (nftables).

A packet from one of this node's pod CIDRs to an address outside every pod CIDR of the
cluster, every node address and the ranges the user listed (``--non-masquerade-cidrs``, as
ip-masq-agent's ``nonMasqueradeCIDRs``) has its source rewritten by the kernel to the address
of the interface it leaves by (``masquerade`` in a ``srcnat`` postrouting chain); netfilter's
connection tracking gives the replies their pod back. Pod-to-pod and pod-to-node traffic keeps
the pod's address, so identities still travel with the packets.

Why nftables and not BPF: the BPF program runs at the pod's veth, before the host has routed
the packet, so it does not know the interface (and address) a packet leaves by; doing it in BPF
needs a program on every external interface, a NAT table, port allocation and ICMP error
translation (Cilium's BPF masquerade is thousands of lines). Netfilter has all of that, per
network namespace, and is on every node. One table, ``inet palisade``, written whole in one
``nft -f`` transaction, so a reader never sees half a rule set; nothing else on the node is
touched.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import subprocess
from collections.abc import Iterable

from services.common.log import get_logger

log = get_logger("masquerade")

TABLE = "palisade"


class MasqueradeError(OSError):
    """nft refused the rule set, or is not installed."""


@dataclasses.dataclass(frozen=True)
class MasqueradePlan:
    enabled: bool
    #: This node's pod CIDRs: the sources masqueraded.
    sources: tuple[str, ...] = ()
    #: Destinations never masqueraded: the cluster's pod CIDRs and node addresses, the user's ranges.
    keep: tuple[str, ...] = ()


def _by_family(prefixes: Iterable[str], version: int) -> list[str]:
    nets = {ipaddress.ip_network(p, strict=False) for p in prefixes}
    return [str(n) for n in sorted(n for n in nets if n.version == version)]


def ruleset(plan: MasqueradePlan) -> str:
    """The nft script that replaces the table with what ``plan`` says. Pure."""
    lines = [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}"]
    if not plan.enabled:
        return "\n".join(lines) + "\n"
    lines.append(f"table inet {TABLE} {{")
    rules = []
    for version, kind, match in ((4, "ipv4_addr", "ip"), (6, "ipv6_addr", "ip6")):
        sources, keep = _by_family(plan.sources, version), _by_family(plan.keep, version)
        if not sources:
            continue
        for name, items in ((f"pods{version}", sources), (f"cluster{version}", keep)):
            lines.append(f"  set {name} {{ type {kind}; flags interval; auto-merge;")
            if items:
                lines.append(f"    elements = {{ {', '.join(items)} }}")
            lines.append("  }")
        rules.append(f"    {match} saddr @pods{version} {match} daddr != @cluster{version} masquerade")
    lines.append("  chain postrouting {")
    lines.append("    type nat hook postrouting priority srcnat; policy accept;")
    lines.extend(rules)
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def apply(plan: MasqueradePlan) -> None:
    """Write the table (or remove it, disabled) in this network namespace; blocking."""
    try:
        done = subprocess.run(["nft", "-f", "-"], input=ruleset(plan), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        if not plan.enabled:
            return  # without nft there is no table of ours to remove
        raise MasqueradeError(
            "masquerade needs the nft command (Debian: apt-get install nftables); or run with --masquerade false"
        ) from None
    if done.returncode != 0:
        raise MasqueradeError(f"nft refused the masquerade rules: {done.stderr.strip()}")
    log.info("masquerade applied", enabled=plan.enabled, sources=",".join(plan.sources), keep=len(plan.keep))


class NftMasquerade:
    """:func:`apply` as the node manager's port."""

    def apply(self, plan: MasqueradePlan) -> None:
        apply(plan)
