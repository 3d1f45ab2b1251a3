"""A node's pod CIDR and the addresses in it a pod may get. Pure.

In a node's pod CIDR the network address is never handed out, the next one is
the gateway (the node's side of every pod route), and for IPv4 the broadcast
address is skipped too, as Cilium does. Shared by ipam (the authority on who holds
an address) and the datapath (which picks the next address of its own node's CIDR
before asking ipam to record it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Container

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def gateway(cidr: IPNetwork) -> IPAddress:
    """The node's address in its pod CIDR: the first after the network address."""
    return cidr.network_address + 1


def host_range(cidr: IPNetwork) -> tuple[int, int]:
    """First and last address (as ints) that may be given to a pod."""
    first = int(cidr.network_address) + 2
    last = int(cidr.broadcast_address) - (1 if cidr.version == 4 else 0)
    return first, last


def capacity(cidr: IPNetwork) -> int:
    first, last = host_range(cidr)
    return max(0, last - first + 1)


def next_free_address(cidr: IPNetwork, used: Container[int], after: int | None = None) -> IPAddress | None:
    """The first free address after ``after`` (wrapping around), so released addresses are reused last."""
    first, last = host_range(cidr)
    size = last - first + 1
    if size <= 0:
        return None
    start = after + 1 if after is not None and first <= after + 1 <= last else first
    for i in range(size):
        candidate = first + (start - first + i) % size
        if candidate not in used:
            return ipaddress.ip_address(candidate) if cidr.version == 4 else ipaddress.IPv6Address(candidate)
    return None


def assignable_problem(cidr: IPNetwork, ip: IPAddress) -> str | None:
    """Why ``ip`` cannot be given to a pod in ``cidr`` (None when it can)."""
    if ip.version != cidr.version or ip not in cidr:
        return f"{ip} is outside the node's pod CIDR {cidr}"
    first, last = host_range(cidr)
    if not first <= int(ip) <= last:
        return f"{ip} is the network, gateway or broadcast address of {cidr}"
    return None
