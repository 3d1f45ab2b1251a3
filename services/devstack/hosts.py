"""The hosts of a dev cluster on one machine: one network namespace per node, on one bridge or several.

Each node is a network namespace standing for a host: its own loopback, an ``eth0``
with the node's address on a bridge in the root namespace (the "physical" network),
a default route to the bridge's address (where the control plane listens), and
forwarding on. The node's datapath runs inside it, so its pods' veths, routes and tc
programs are the node's own.

Nothing here routes pods: each node's datapath installs the routes to the other nodes'
pod CIDRs itself (``--routing``), as on a real node. Two shapes of network:

- ``direct``: every node on one bridge, one subnet (nodes share a network; the datapaths
  route each pod CIDR via its node's address);
- ``tunnel``: each node on a bridge of its own, a /28 of the subnet each, joined by a router
  (a namespace of its own with a leg on every bridge and forwarding on), so no node reaches
  another on a link and direct routes cannot work; the datapaths tunnel (VXLAN) between the
  nodes' addresses, which the router forwards like any other packet. The control plane listens
  on the first bridge's address, which every node reaches through its own bridge's (the root
  namespace's own addresses: it never forwards).

Made and removed with ``ip`` (iproute2): this runs once per stack, in the stack
process, before and after the services.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

from services.common.log import get_logger

log = get_logger("devhosts")

NODE_IFNAME = "eth0"


class HostsError(RuntimeError):
    """A host namespace, the bridge or a route could not be made."""


@dataclass(frozen=True)
class NodeHost:
    """One dev node: its name, its namespace and its address on its bridge."""

    name: str
    netns: str
    address: str
    #: The root side of its link to the bridge.
    link: str
    #: Its bridge, that bridge's address in the root namespace and the subnet's prefix length.
    bridge: str = ""
    gateway: str = ""
    prefix_len: int = 24
    #: Tunnel shape: the router's address on this node's bridge (the way to the other nodes).
    router: str = ""
    #: Tunnel shape: the root side of the router's leg on this bridge.
    router_link: str = ""


@dataclass(frozen=True)
class HostNetwork:
    """The bridges and the node hosts on them."""

    #: The control plane's address (the first bridge's).
    gateway: str
    nodes: tuple[NodeHost, ...]
    #: The whole hosts' network (--node-subnet).
    subnet: str = ""
    #: Tunnel shape: the router's namespace ("": one bridge, no router).
    router_netns: str = ""

    @property
    def bridges(self) -> list[str]:
        return sorted({n.bridge for n in self.nodes})

    def node(self, name: str) -> NodeHost:
        return next(n for n in self.nodes if n.name == name)


def run_ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise HostsError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


MODES = ("direct", "tunnel")


def tag_of(run_dir: str | os.PathLike[str]) -> str:
    """The tag a stack's hosts are named with: its run directory's, so stacks side by side do not collide."""
    return format(zlib.crc32(str(Path(run_dir).resolve()).encode()), "08x")


def plan(names: list[str], subnet: str, tag: str, mode: str = "direct") -> HostNetwork:
    """Names and addresses.

    direct: one bridge takes the subnet's first address, node i the (10+i)th. tunnel: node i gets
    the subnet's i-th /28, its bridge the /28's first address, the router the second, the node the
    tenth.
    """
    net = ipaddress.ip_network(subnet)
    if mode not in MODES:
        raise HostsError(f"--routing {mode!r}: give one of {', '.join(MODES)}")
    if net.version != 4 or net.num_addresses < 16 + len(names):
        raise HostsError(f"--node-subnet {subnet} must be an IPv4 subnet with room for {len(names)} nodes")
    if mode == "direct":
        gateway = str(net.network_address + 1)
        bridge = f"pbr{tag[:8]}"
        nodes = tuple(
            NodeHost(name, f"pal-{tag}-{name}"[:40], str(net.network_address + 10 + i), f"pn{tag[:6]}{i}",
                     bridge, gateway, net.prefixlen)
            for i, name in enumerate(names)
        )  # fmt: skip
        return HostNetwork(gateway, nodes, str(net))
    if net.prefixlen > 28 or net.num_addresses < 16 * len(names):
        raise HostsError(f"--node-subnet {subnet} must hold a /28 per node ({len(names)}) with --routing tunnel")
    nodes = tuple(
        NodeHost(
            name,
            f"pal-{tag}-{name}"[:40],
            str(net.network_address + 16 * i + 10),
            f"pn{tag[:6]}{i}",
            f"pb{tag[:8]}{i}",
            str(net.network_address + 16 * i + 1),
            28,
            str(net.network_address + 16 * i + 2),
            f"pr{tag[:6]}{i}",
        )
        for i, name in enumerate(names)
    )
    return HostNetwork(nodes[0].gateway, nodes, str(net), f"pal-{tag}-router")


def create(network: HostNetwork) -> None:
    """Make the bridges, the router and every node namespace (removing a previous run's first)."""
    remove(network)
    for bridge in network.bridges:
        run_ip("link", "add", bridge, "type", "bridge")
        run_ip("link", "set", bridge, "up")
    for node in network.nodes:
        if node.gateway not in _root_addresses():
            run_ip("addr", "add", f"{node.gateway}/{node.prefix_len}", "dev", node.bridge)
    if network.router_netns:
        run_ip("netns", "add", network.router_netns)
        run_ip("link", "set", "lo", "up", netns=network.router_netns)
        sysctl(network.router_netns, "net.ipv4.ip_forward=1")
        for i, node in enumerate(network.nodes):
            leg = f"leg{i}"
            run_ip("link", "add", node.router_link, "type", "veth", "peer", "name", leg, "netns", network.router_netns)
            run_ip("link", "set", node.router_link, "master", node.bridge, "up")
            run_ip("addr", "add", f"{node.router}/{node.prefix_len}", "dev", leg, netns=network.router_netns)
            run_ip("link", "set", leg, "up", netns=network.router_netns)
    for node in network.nodes:
        run_ip("netns", "add", node.netns)
        run_ip("link", "add", node.link, "type", "veth", "peer", "name", NODE_IFNAME, "netns", node.netns)
        run_ip("link", "set", node.link, "master", node.bridge, "up")
        run_ip("link", "set", "lo", "up", netns=node.netns)
        run_ip("addr", "add", f"{node.address}/{node.prefix_len}", "dev", NODE_IFNAME, netns=node.netns)
        run_ip("link", "set", NODE_IFNAME, "up", netns=node.netns)
        run_ip("route", "add", "default", "via", node.gateway, netns=node.netns)
        if node.router:
            # The other nodes are behind the router; the control plane stays behind the gateway.
            run_ip("route", "add", network.subnet, "via", node.router, netns=node.netns)
    log.info("dev hosts up", bridges=",".join(network.bridges), nodes=",".join(n.name for n in network.nodes))


def _root_addresses() -> set[str]:
    done = run_ip("-o", "-4", "addr", "show", check=False)
    return {line.split()[3].partition("/")[0] for line in done.stdout.splitlines() if len(line.split()) > 3}


def sysctl(netns: str, setting: str) -> None:
    cmd = ["ip", "netns", "exec", netns, "sysctl", "-qw", setting]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HostsError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def remove(network: HostNetwork) -> list[str]:
    """Remove the node namespaces (their links and routes go with them), the router and the bridges.

    Returns what is still there, each with the command that removes it.
    """
    spaces = [n.netns for n in network.nodes] + ([network.router_netns] if network.router_netns else [])
    for netns in spaces:
        if os.path.exists(f"/run/netns/{netns}"):
            run_ip("netns", "del", netns, check=False)
    for node in network.nodes:
        run_ip("link", "del", node.link, check=False)
        if node.router_link:
            run_ip("link", "del", node.router_link, check=False)
    for bridge in network.bridges:
        run_ip("link", "del", bridge, check=False)
    left = [f"network namespace {n} (ip netns del {n})" for n in spaces if os.path.exists(f"/run/netns/{n}")]
    for bridge in network.bridges:
        if run_ip("link", "show", bridge, check=False).returncode == 0:
            left.append(f"bridge {bridge} (ip link del {bridge})")
    return left
