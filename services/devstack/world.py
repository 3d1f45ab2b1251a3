"""The world outside a dev cluster: a network namespace on documentation addresses, with its DNS.

One namespace (``pal-<tag>-world``) stands for the internet and its DNS. It has a leg on every
bridge of the hosts' network (an address of each bridge's subnet that no node, gateway or router
has) and holds the three documentation ranges (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24)
as local routes on its loopback, so every address of them is a host of the world: the world's
server (:mod:`services.devstack.podserver`, on :data:`PORTS`) answers on all of them, and its
DNS server (:mod:`services.devstack.dnsserver`) on :data:`DNS_ADDRESS`. No address outside the
machine is ever used.

Each node host routes the documentation ranges to the world's leg on its bridge, as a real
host's routing table sends the internet to its router (at a high metric, as a default route:
a link of the node's own to one of the ranges, as a test may add, wins). That is all the dev cluster does: a
pod's packets to the world leave through its node's routing and masquerade (the datapath's
own, as for any external address), and the world knows no way to any pod CIDR, so it sees
the node's address. Pods resolve through :data:`DNS_ADDRESS` (the stack's ``addresses.json``
names it), so their queries pass their node's DNS proxy wherever a DNS rule selects them.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.log import get_logger
from services.devstack.dnsserver import Record, render_zone
from services.devstack.hosts import HostNetwork, run_ip

log = get_logger("devworld")

#: The documentation ranges (RFC 5737): the whole outside world of a dev cluster.
RANGES = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
#: The metric of each node's routes to the world.
ROUTE_METRIC = 1000
#: Where the world's DNS server answers: the pods' resolver.
DNS_ADDRESS = "192.0.2.53"
#: TCP ports every address of the world serves (greets with "world", then echoes).
PORTS = (80, 443)
#: The names the world's DNS starts with (its zone file, edited while the cluster runs, says more).
DEFAULT_NAMES = {
    "api.example.test": Record(("192.0.2.10",), 30),
    "www.example.test": Record(("192.0.2.11",), 30),
    "s3.example.test": Record(("203.0.113.1", "203.0.113.2", "203.0.113.3"), 30),
    "elsewhere.test": Record(("198.51.100.10",), 30),
}
ZONE_COMMENT = (
    "The dev cluster's outside world: the names its DNS server (192.0.2.53) answers.\n"
    "Edit it while the cluster runs: it is read again at the next query. Addresses from\n"
    "192.0.2.0/24, 198.51.100.0/24 and 203.0.113.0/24 are hosts of the world (TCP 80 and 443)."
)


@dataclass(frozen=True)
class Leg:
    """The world's link to one bridge: the root side's name, and the world's address on it."""

    bridge: str
    link: str
    address: str
    prefix_len: int


@dataclass(frozen=True)
class World:
    netns: str
    legs: tuple[Leg, ...]
    #: (node namespace, the world's address on its bridge): where each node sends the ranges.
    gateways: tuple[tuple[str, str], ...]
    dns: str = DNS_ADDRESS


def plan(network: HostNetwork, tag: str) -> World:
    """One leg per bridge, at the lowest address of its subnet nobody else holds."""
    legs: dict[str, Leg] = {}
    for node in network.nodes:
        if node.bridge in legs:
            continue
        subnet = ipaddress.ip_interface(f"{node.gateway}/{node.prefix_len}").network
        on_bridge = [n for n in network.nodes if n.bridge == node.bridge]
        taken = {node.gateway, node.router, *(n.address for n in on_bridge)}
        free = next(str(a) for a in subnet.hosts() if str(a) not in taken)
        # pn<tag><90+i>: the leftover sweep's pattern for links (the namespace takes them with it anyway).
        legs[node.bridge] = Leg(node.bridge, f"pn{tag[:6]}{90 + len(legs)}", free, node.prefix_len)
    gateways = tuple((n.netns, legs[n.bridge].address) for n in network.nodes)
    return World(f"pal-{tag}-world", tuple(legs.values()), gateways)


def create(world: World) -> None:
    """The namespace, its legs and addresses, and each node's routes to it (a previous run's removed first)."""
    remove(world)
    run_ip("netns", "add", world.netns)
    run_ip("link", "set", "lo", "up", netns=world.netns)
    for i, leg in enumerate(world.legs):
        inner = f"w{i}"
        run_ip("link", "add", leg.link, "type", "veth", "peer", "name", inner, "netns", world.netns)
        run_ip("link", "set", leg.link, "master", leg.bridge, "up")
        run_ip("addr", "add", f"{leg.address}/{leg.prefix_len}", "dev", inner, netns=world.netns)
        run_ip("link", "set", inner, "up", netns=world.netns)
    for prefix in RANGES:
        # Every address of the range is the world's own (a local route: no address list to keep).
        run_ip("route", "add", "local", prefix, "dev", "lo", netns=world.netns)
    for netns, via in world.gateways:
        for prefix in RANGES:
            # A metric as a default route's: a link of the node's own to the same range wins.
            run_ip("route", "replace", prefix, "via", via, "metric", str(ROUTE_METRIC), netns=netns)
    log.info("dev world up", netns=world.netns, dns=world.dns, legs=",".join(leg.address for leg in world.legs))


def remove(world: World) -> list[str]:
    """Remove the namespace (its legs go with it); returns what is still there, with the command to remove it."""
    if os.path.exists(f"/run/netns/{world.netns}"):
        run_ip("netns", "del", world.netns, check=False)
    for leg in world.legs:
        run_ip("link", "del", leg.link, check=False)
    if os.path.exists(f"/run/netns/{world.netns}"):
        return [f"network namespace {world.netns} (ip netns del {world.netns})"]
    return []


def write_zone(path: Path) -> None:
    """The starting zone file, unless one is there (a run kept with --keep-state keeps its edits)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_zone(DEFAULT_NAMES, ZONE_COMMENT))
