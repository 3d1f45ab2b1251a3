"""Routes to the other nodes' pod CIDRs, in the node's kernel: direct or through a VXLAN tunnel.

What Cilium's agent does with ``auto-direct-node-routes`` and its tunnel mode, here with
pyroute2 on the node's own routing table:

- ``direct`` (nodes share a network): each other node's pod CIDR is routed via that node's
  address (``ip route replace 10.0.2.0/24 via 172.31.255.12``). A node address the kernel
  cannot reach on a link of its own is refused (ENETUNREACH): the plan says so, naming the
  tunnel mode as the fix, and the other routes are still installed.
- ``tunnel`` (nodes that do not): one kernel VXLAN device, ``palisade_vxlan`` (UDP port 8472,
  one VNI, learning off), bound to this node's address. Every other node is a static
  neighbour of it: its address, at an Ethernet address derived from that address (the same
  on every node, so nothing is exchanged), with a forwarding entry sending that Ethernet
  address to the node's address. Each other node's pod CIDR is routed via its address *on the
  VXLAN device* (onlink): the kernel encapsulates and the underlay routes the outer packet as
  any other, across routers.
- ``none``: nothing is touched (another plugin or the cloud routes pods).

Every route carries the protocol number :data:`RTPROT_PALISADE`, so a reconcile finds its own
routes and removes those no node needs any more, never anyone else's. Pure planning lives in
:mod:`services.datapath.nodes`; this module only writes what a plan says.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import ipaddress
import socket
from typing import Any

from services.common.log import get_logger

log = get_logger("routing")

#: The ``proto`` of every route Palisade installs (``ip route show proto 199``).
RTPROT_PALISADE = 199
#: The tunnel device, as Cilium's ``cilium_vxlan``.
TUNNEL_IFNAME = "palisade_vxlan"
#: VXLAN's bytes on top of the inner frame (outer IPv4, UDP, VXLAN, inner Ethernet).
VXLAN_OVERHEAD = 50
#: Routing modes (``--routing``).
MODES = ("direct", "tunnel", "none")
_RTNH_F_ONLINK = 4
_NUD_PERMANENT = 0x80


@dataclasses.dataclass(frozen=True, order=True)
class NodeRoute:
    """One other node's pod CIDR, and the address of the node it is routed to."""

    prefix: str
    gateway: str
    node: str


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """What this node's kernel should hold."""

    mode: str
    routes: tuple[NodeRoute, ...] = ()
    #: This node's own address (tunnel: the VXLAN device's local end; source of host traffic).
    local_address: str = ""
    tunnel_port: int = 8472
    tunnel_vni: int = 2


@dataclasses.dataclass(frozen=True)
class RoutingResult:
    installed: int
    removed: int
    #: Routes the kernel refused, each with why and what to do.
    failed: tuple[str, ...] = ()


def tunnel_mac(address: str) -> str:
    """The Ethernet address a node's VXLAN device has: derived from its node address, locally administered."""
    digest = hashlib.sha256(ipaddress.ip_address(address).packed).digest()
    return ":".join(f"{b:02x}" for b in (0x0E, *digest[:5]))


def _family(prefix: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_network(prefix).version == 6 else socket.AF_INET


class KernelRouting:
    """Applies :class:`RoutingPlan` objects to the namespace this process runs in (blocking calls)."""

    def apply(self, plan: RoutingPlan) -> RoutingResult:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        installed, failed = 0, []
        if plan.mode == "none":
            return RoutingResult(0, 0)  # another plugin or the cloud routes pods: nothing is touched
        with IPRoute() as ipr:
            tunnel = 0
            if plan.mode == "tunnel" and plan.routes:
                tunnel = self._tunnel_device(ipr, plan)
            elif plan.mode != "tunnel":
                self._remove_device(ipr)
            wanted: set[tuple[str, int]] = set()
            for route in plan.routes:
                net = ipaddress.ip_network(route.prefix)
                wanted.add((str(net.network_address), net.prefixlen))
                args: dict[str, Any] = {"dst": route.prefix, "gateway": route.gateway, "proto": RTPROT_PALISADE}
                if tunnel:
                    args.update(oif=tunnel, flags=_RTNH_F_ONLINK)
                    if plan.local_address and ipaddress.ip_address(plan.local_address).version == net.version:
                        args["prefsrc"] = plan.local_address
                try:
                    ipr.route("replace", family=_family(route.prefix), **args)
                    installed += 1
                except NetlinkError as exc:
                    why = (
                        "is not on a network this node shares: run the datapaths with --routing tunnel "
                        "(PALISADE_ROUTING=tunnel)"
                        if exc.code in (errno.ENETUNREACH, errno.EINVAL)  # "invalid gateway": not on a link
                        else f"the kernel said: {exc}"
                    )
                    failed.append(f"pod CIDR {route.prefix} of node {route.node} via {route.gateway}: {why}")
            removed = self._prune(ipr, wanted)
            if tunnel:
                self._prune_peers(ipr, tunnel, {r.gateway for r in plan.routes})
        for line in failed:
            log.warning("node route not installed", detail=line)
        return RoutingResult(installed, removed, tuple(failed))

    def remove_all(self) -> int:
        """Remove every route and the tunnel device Palisade made (routing turned off, uninstall)."""
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            removed = self._prune(ipr, set())
            self._remove_device(ipr)
        return removed

    # -- parts ---------------------------------------------------------------

    def _tunnel_device(self, ipr: Any, plan: RoutingPlan) -> int:
        """The VXLAN device, made (or re-made when its settings differ) and up; its ifindex."""
        local = plan.local_address
        if not local:
            raise OSError("tunnel mode needs this node's address: its Node object has no InternalIP/ExternalIP yet")
        mac = tunnel_mac(local)
        found = ipr.link_lookup(ifname=TUNNEL_IFNAME)
        if found:
            link = ipr.get_links(found[0])[0]
            info = link.get_attr("IFLA_LINKINFO")
            data = info.get_attr("IFLA_INFO_DATA") if info else None
            same = (
                data is not None
                and data.get_attr("IFLA_VXLAN_ID") == plan.tunnel_vni
                and data.get_attr("IFLA_VXLAN_PORT") == plan.tunnel_port
                and data.get_attr("IFLA_VXLAN_LOCAL") == local
                and link.get_attr("IFLA_ADDRESS") == mac
            )
            if same:
                return int(found[0])
            ipr.link("del", index=found[0])
        ipr.link(
            "add",
            ifname=TUNNEL_IFNAME,
            kind="vxlan",
            vxlan_id=plan.tunnel_vni,
            vxlan_port=plan.tunnel_port,
            vxlan_local=local,
            vxlan_learning=0,
            address=mac,
            mtu=self._underlay_mtu(ipr, local) - VXLAN_OVERHEAD,
        )
        index = int(ipr.link_lookup(ifname=TUNNEL_IFNAME)[0])
        ipr.link("set", index=index, state="up")
        log.info("tunnel device made", device=TUNNEL_IFNAME, local=local, port=plan.tunnel_port, vni=plan.tunnel_vni)
        return index

    @staticmethod
    def _underlay_mtu(ipr: Any, local: str) -> int:
        for addr in ipr.get_addr(address=local):
            link = ipr.get_links(addr["index"])[0]
            return int(link.get_attr("IFLA_MTU") or 1500)
        return 1500

    @staticmethod
    def _remove_device(ipr: Any) -> None:
        found = ipr.link_lookup(ifname=TUNNEL_IFNAME)
        if found:
            ipr.link("del", index=found[0])
            log.info("tunnel device removed", device=TUNNEL_IFNAME)

    @staticmethod
    def _prune(ipr: Any, wanted: set[tuple[str, int]]) -> int:
        removed = 0
        for family in (socket.AF_INET, socket.AF_INET6):
            for route in ipr.route("dump", family=family, proto=RTPROT_PALISADE):
                key = (str(route.get_attr("RTA_DST") or ""), int(route["dst_len"]))
                if key not in wanted:
                    ipr.route("del", family=family, dst=f"{key[0]}/{key[1]}", proto=RTPROT_PALISADE)
                    removed += 1
        return removed

    @staticmethod
    def _prune_peers(ipr: Any, index: int, peers: set[str]) -> None:
        """Neighbour and forwarding entries for exactly ``peers`` on the tunnel device."""
        for peer in sorted(peers):
            ipr.neigh("replace", dst=peer, lladdr=tunnel_mac(peer), ifindex=index, state=_NUD_PERMANENT)
        for neigh in ipr.neigh("dump", ifindex=index):
            dst = neigh.get_attr("NDA_DST")
            if dst and dst not in peers:
                ipr.neigh("del", dst=dst, ifindex=index)
        held: set[tuple[str, str]] = set()
        for entry in ipr.fdb("dump", ifindex=index):
            dst, mac = entry.get_attr("NDA_DST"), entry.get_attr("NDA_LLADDR")
            if entry["ifindex"] != index or not dst:
                continue
            if dst in peers and mac == tunnel_mac(dst):
                held.add((mac, dst))
            else:
                ipr.fdb("del", ifindex=index, lladdr=mac, dst=dst)
        for peer in sorted(peers):
            if (tunnel_mac(peer), peer) not in held:
                # "append": a VXLAN device's forwarding entries are per destination (replace is refused).
                ipr.fdb("append", ifindex=index, lladdr=tunnel_mac(peer), dst=peer)
