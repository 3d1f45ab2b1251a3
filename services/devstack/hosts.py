"""The hosts of a dev cluster on one machine: one network namespace per node, on one bridge.

Each node is a network namespace standing for a host: its own loopback, an ``eth0``
with the node's address on a bridge in the root namespace (the "physical" network),
a default route to the bridge's address (where the control plane listens), and
forwarding on. The node's datapath runs inside it, so its pods' veths, routes and tc
programs are the node's own. Pod CIDRs are routed natively: every node, and the root
namespace, routes each other node's pod CIDR to that node's address, so a packet
keeps its pod source address end to end (no SNAT, no tunnel), as Cilium's native
routing mode does.

Made and removed with ``ip`` (iproute2): this runs once per stack, in the stack
process, before and after the services.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass

from services.common.log import get_logger

log = get_logger("devhosts")

NODE_IFNAME = "eth0"


class HostsError(RuntimeError):
    """A host namespace, the bridge or a route could not be made."""


@dataclass(frozen=True)
class NodeHost:
    """One dev node: its name, its namespace and its address on the bridge."""

    name: str
    netns: str
    address: str
    #: The root side of its link to the bridge.
    link: str


@dataclass(frozen=True)
class HostNetwork:
    """The bridge and the node hosts on it."""

    bridge: str
    gateway: str
    prefix_len: int
    nodes: tuple[NodeHost, ...]

    def node(self, name: str) -> NodeHost:
        return next(n for n in self.nodes if n.name == name)


def _ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise HostsError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


def plan(names: list[str], subnet: str, tag: str) -> HostNetwork:
    """Names and addresses: the bridge takes the subnet's first address, node i the (10+i)th."""
    net = ipaddress.ip_network(subnet)
    if net.version != 4 or net.num_addresses < 16 + len(names):
        raise HostsError(f"--node-subnet {subnet} must be an IPv4 subnet with room for {len(names)} nodes")
    gateway = str(net.network_address + 1)
    nodes = tuple(
        NodeHost(name, f"pal-{tag}-{name}"[:40], str(net.network_address + 10 + i), f"pn{tag[:6]}{i}")
        for i, name in enumerate(names)
    )
    return HostNetwork(f"pbr{tag[:8]}", gateway, net.prefixlen, nodes)


def create(network: HostNetwork) -> None:
    """Make the bridge and every node namespace (removing a previous run's first)."""
    remove(network)
    _ip("link", "add", network.bridge, "type", "bridge")
    _ip("addr", "add", f"{network.gateway}/{network.prefix_len}", "dev", network.bridge)
    _ip("link", "set", network.bridge, "up")
    for node in network.nodes:
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.link, "type", "veth", "peer", "name", NODE_IFNAME, "netns", node.netns)
        _ip("link", "set", node.link, "master", network.bridge, "up")
        _ip("link", "set", "lo", "up", netns=node.netns)
        _ip("addr", "add", f"{node.address}/{network.prefix_len}", "dev", NODE_IFNAME, netns=node.netns)
        _ip("link", "set", NODE_IFNAME, "up", netns=node.netns)
        _ip("route", "add", "default", "via", network.gateway, netns=node.netns)
    log.info("dev hosts up", bridge=network.bridge, nodes=",".join(n.name for n in network.nodes))


def route_pod_cidrs(network: HostNetwork, cidrs: dict[str, list[str]]) -> None:
    """Route each node's pod CIDRs to its address, from every other node and from the root namespace."""
    for owner, prefixes in cidrs.items():
        via = network.node(owner).address
        for prefix in prefixes:
            if ipaddress.ip_network(prefix).version != 4:
                continue  # the bridge network is IPv4; IPv6 pod addresses stay node-local here
            _ip("route", "replace", prefix, "via", via)
            for node in network.nodes:
                if node.name != owner:
                    _ip("route", "replace", prefix, "via", via, netns=node.netns)


def remove(network: HostNetwork) -> list[str]:
    """Remove the node namespaces (their links and routes go with them) and the bridge.

    Returns what is still there, each with the command that removes it.
    """
    for node in network.nodes:
        if os.path.exists(f"/run/netns/{node.netns}"):
            _ip("netns", "del", node.netns, check=False)
        _ip("link", "del", node.link, check=False)
    _ip("link", "del", network.bridge, check=False)
    left = [
        f"network namespace {n.netns} (ip netns del {n.netns})"
        for n in network.nodes
        if os.path.exists(f"/run/netns/{n.netns}")
    ]
    if _ip("link", "show", network.bridge, check=False).returncode == 0:
        left.append(f"bridge {network.bridge} (ip link del {network.bridge})")
    return left
