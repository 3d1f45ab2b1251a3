"""The cluster's nodes, as this node's datapath routes to them (Cilium's node manager).

Also what lies outside the cluster: masquerade (:mod:`services.datapath.masquerade`) keeps the
pod's address for the cluster's pod CIDRs and node addresses, which only this module knows.

Follows ``palisade.k8s.node.>`` (a Node's addresses: InternalIP, then ExternalIP) and asks
ipam for each node's pod CIDRs (``IPAMService.GetNodeCIDR``: what ipam assigned, the Node's
``spec.podCIDRs`` when it honours them), then hands :mod:`services.datapath.routing` the routes
to every other node's pod CIDRs. One task owns the state: a Node change marks it dirty, and a
resync every ``interval`` seconds asks ipam again and re-applies everything, which repairs a
route someone removed. The plan is pure (:func:`plan`).

Pods whose addresses lie outside every node's pod CIDR (a manifest's ``status.podIP``, an
address another IPAM chose) are routed too, one host route each, via the node the ipcache says
hosts them (``palisade.ipcache.>``, the entries naming a pod and a node), as Cilium's ipcache
gives every address its tunnel endpoint: without it such a pod is reachable from its own node
only. Addresses inside a pod CIDR need nothing more than their CIDR's route.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from palisade.v1 import identity_pb2, k8s_pb2
from services.common.bus import Bus, Follower
from services.common.largeobjects import follow_deltas
from services.common.log import get_logger
from services.common.subjects import IPCACHE_ALL, k8s_filter
from services.datapath.masquerade import MasqueradePlan
from services.datapath.routing import NodeRoute, RoutingPlan, RoutingResult

log = get_logger("nodes")

_ADDRESS_TYPES = ("InternalIP", "ExternalIP")


class RoutingPort(Protocol):
    """The kernel side (blocking)."""

    def apply(self, plan: RoutingPlan) -> RoutingResult: ...


class MasqueradePort(Protocol):
    """The masquerade rules (blocking); failures raise OSError."""

    def apply(self, plan: MasqueradePlan) -> None: ...


class NodeCidrs(Protocol):
    """ipam's answer for a node's pod CIDRs; failures raise."""

    async def node_cidrs(self, node: str) -> list[str]: ...


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    #: InternalIP addresses first, then ExternalIP ones.
    addresses: tuple[str, ...] = ()
    #: ``spec.podCIDRs`` (or ``spec.podCIDR``), used while ipam cannot be asked.
    pod_cidrs: tuple[str, ...] = ()


def parse_node(name: str, obj: Mapping[str, Any]) -> NodeInfo:
    """A Node object's addresses and pod CIDRs; invalid values are left out."""
    status = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    addresses: list[str] = []
    items = status.get("addresses") if isinstance(status, Mapping) else None
    for kind in _ADDRESS_TYPES:
        for item in items if isinstance(items, list) else ():
            if isinstance(item, Mapping) and item.get("type") == kind:
                with contextlib.suppress(ValueError):
                    address = str(ipaddress.ip_address(str(item.get("address", ""))))
                    if address not in addresses:
                        addresses.append(address)
    raw = spec.get("podCIDRs") if isinstance(spec, Mapping) else None
    cidrs: list[str] = []
    for value in [*(raw if isinstance(raw, list) else ()), spec.get("podCIDR") if isinstance(spec, Mapping) else None]:
        with contextlib.suppress(ValueError, TypeError):
            cidr = str(ipaddress.ip_network(str(value), strict=False)) if value else ""
            if cidr and cidr not in cidrs:
                cidrs.append(cidr)
    return NodeInfo(name, tuple(addresses), tuple(cidrs))


def _first(addresses: Sequence[str], version: int) -> str:
    return next((a for a in addresses if ipaddress.ip_address(a).version == version), "")


def plan(
    self_name: str,
    nodes: Mapping[str, NodeInfo],
    cidrs: Mapping[str, Sequence[str]],
    mode: str,
    *,
    tunnel_port: int = 8472,
    tunnel_vni: int = 2,
    pod_addresses: Mapping[str, str] | None = None,
) -> tuple[RoutingPlan, list[str]]:
    """The routes to every other node's pod CIDRs, and what cannot be routed (and why). Pure.

    ``pod_addresses`` (pod address prefix -> the node hosting it) adds a host route for each
    address of another node's pod that lies outside every pod CIDR (:func:`outside_cidrs`).

    A CIDR goes via the other node's address of its own family. In tunnel mode the underlay is
    this node's first address (IPv4 first) and only CIDRs whose other node has an address of that
    family are routed: the kernel's VXLAN device carries any inner family, but a route needs a
    neighbour of the CIDR's family on it.
    """
    me = nodes.get(self_name)
    local = (_first(me.addresses, 4) or _first(me.addresses, 6)) if me else ""
    routes: list[NodeRoute] = []
    skipped: list[str] = []
    outside: dict[str, list[str]] = {}
    for prefix, host in outside_cidrs(nodes, cidrs, pod_addresses or {}).items():
        outside.setdefault(host, []).append(prefix)
    for name in sorted(nodes):
        if name == self_name:
            continue
        info = nodes[name]
        for prefix in [*cidrs.get(name, info.pod_cidrs), *sorted(outside.get(name, ()))]:
            version = ipaddress.ip_network(prefix).version
            gateway = _first(info.addresses, version)
            if not gateway:
                skipped.append(f"{prefix} of node {name}: the node has no IPv{version} address")
            elif mode == "tunnel" and (not local or ipaddress.ip_address(local).version != version):
                skipped.append(f"{prefix} of node {name}: the tunnel's underlay is not IPv{version}")
            else:
                routes.append(NodeRoute(prefix, gateway, name))
    return RoutingPlan(mode, tuple(sorted(routes)), local, tunnel_port, tunnel_vni), skipped


def outside_cidrs(
    nodes: Mapping[str, NodeInfo], cidrs: Mapping[str, Sequence[str]], pod_addresses: Mapping[str, str]
) -> dict[str, str]:
    """The pod addresses (prefix -> hosting node) that no node's pod CIDR holds. Pure.

    One set lookup per address and distinct pod-CIDR length (one or two in a cluster), not one
    comparison per node.
    """
    pools: set[Any] = set()
    for name in set(nodes) | set(cidrs):
        pools.update(ipaddress.ip_network(c) for c in cidrs.get(name, nodes[name].pod_cidrs if name in nodes else ()))
    lengths = {(p.version, p.prefixlen) for p in pools}
    out: dict[str, str] = {}
    for prefix, host in pod_addresses.items():
        net = ipaddress.ip_network(prefix)
        held = any(
            net.version == version
            and net.prefixlen >= length
            and (net if net.prefixlen == length else net.supernet(new_prefix=length)) in pools
            for version, length in lengths
        )
        if not held:
            out[prefix] = host
    return out


def masquerade_plan(
    self_name: str,
    nodes: Mapping[str, NodeInfo],
    cidrs: Mapping[str, Sequence[str]],
    enabled: bool,
    non_masquerade: Sequence[str] = (),
    pod_addresses: Mapping[str, str] | None = None,
) -> MasqueradePlan:
    """Masquerade this node's pod CIDRs towards everything but the cluster's ranges. Pure.

    The cluster's ranges: every pod CIDR, every node address, and the pod addresses outside
    every pod CIDR (``pod_addresses``, as :func:`plan` takes them): a pod talking to such a pod
    keeps its address, so the receiver judges it by its identity.
    """
    me = nodes.get(self_name)
    sources = tuple(cidrs.get(self_name, me.pod_cidrs if me else ()))
    keep: set[str] = set(non_masquerade)
    for name in set(nodes) | set(cidrs):
        info = nodes.get(name)
        keep.update(cidrs.get(name, info.pod_cidrs if info else ()))
        keep.update(str(ipaddress.ip_network(a)) for a in (info.addresses if info else ()))
    keep.update(outside_cidrs(nodes, cidrs, pod_addresses or {}))
    return MasqueradePlan(enabled, sources, tuple(sorted(keep)))


class NodeRoutes:
    """Keeps this node's routes to the other nodes' pod CIDRs equal to the cluster's nodes."""

    def __init__(
        self,
        node: str,
        mode: str,
        routing: RoutingPort,
        ipam: NodeCidrs,
        *,
        interval: float = 30.0,
        tunnel_port: int = 8472,
        tunnel_vni: int = 2,
        masquerade: MasqueradePort | None = None,
        masquerade_enabled: bool = True,
        non_masquerade: Sequence[str] = (),
    ) -> None:
        self._node = node
        self._masquerade = masquerade
        self._masquerade_enabled = masquerade_enabled
        self._non_masquerade = tuple(non_masquerade)
        self.masqueraded: MasqueradePlan | None = None
        self.masquerade_error = ""
        self.mode = mode
        self._routing = routing
        self._ipam = ipam
        self._interval = interval
        self._port = tunnel_port
        self._vni = tunnel_vni
        self.nodes: dict[str, NodeInfo] = {}
        #: ipam's pod CIDRs per node, as last answered.
        self.cidrs: dict[str, tuple[str, ...]] = {}
        #: Nodes whose pod CIDRs ipam is to be asked for (this node's own: for masquerade).
        self._stale: set[str] = {node}
        #: Other nodes' pod addresses (prefix -> node), from the ipcache.
        self.pod_addresses: dict[str, str] = {}
        self._pods_follower: Follower | None = None
        self._wake = asyncio.Event()
        self._follower: Follower | None = None
        self.loaded = asyncio.Event()
        self.applied: RoutingPlan | None = None
        self.result = RoutingResult(0, 0)
        self.skipped: list[str] = []

    async def start(self, bus: Bus) -> None:
        """Replay the Node objects; the first routes are written by :meth:`run`."""
        self._follower = await follow_deltas(bus, k8s_filter("node"), self._on_node)
        self._pods_follower = await bus.follow(IPCACHE_ALL, identity_pb2.IpcacheEntry, self._on_ipcache)
        await self._follower.caught_up.wait()
        await self._pods_follower.caught_up.wait()
        self.loaded.set()
        self._wake.set()

    async def stop(self) -> None:
        for follower in (self._follower, self._pods_follower):
            if follower is not None:
                await follower.stop()

    async def _on_node(self, subject: str, delta: k8s_pb2.K8sDelta) -> None:
        name = delta.name
        if delta.op == k8s_pb2.DELTA_OP_DELETE:
            self.nodes.pop(name, None)
            self.cidrs.pop(name, None)
        else:
            try:
                self.nodes[name] = parse_node(name, json.loads(delta.object_json))
            except (ValueError, TypeError) as exc:
                log.warning("node ignored: not a valid object", node=name, error=str(exc))
                return
            self._stale.add(name)
        self._wake.set()

    async def _on_ipcache(self, subject: str, entry: identity_pb2.IpcacheEntry) -> None:
        """Another node's pod address: a change to one outside every known pod CIDR is applied."""
        try:
            prefix = str(ipaddress.ip_network(entry.prefix.strip(), strict=False))
        except ValueError:
            return  # the ipcache sync logs bad prefixes
        host = "" if entry.deleted or not entry.identity or not entry.pod else entry.node
        before = self.pod_addresses.get(prefix, "")
        if host and host != self._node:
            self.pod_addresses[prefix] = host
        else:
            self.pod_addresses.pop(prefix, None)
        after = self.pod_addresses.get(prefix, "")
        if before != after and (
            not self.loaded.is_set() or outside_cidrs(self.nodes, self.cidrs, {prefix: before or after})
        ):
            self._wake.set()

    async def run(self) -> None:
        """Apply on every change, and everything again each ``interval`` seconds."""
        await self.loaded.wait()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            if not self._wake.is_set():
                self._stale |= set(self.nodes) | {self._node}  # the periodic resync: ask ipam again
                self.masqueraded = None  # and write the rules again
            self._wake.clear()
            try:
                await self.reconcile()
            except Exception as exc:  # a kernel or ipam error: logged, retried at the next resync
                log.error("node routes not applied", error=str(exc))

    async def reconcile(self) -> RoutingResult:
        for name in sorted(self._stale & (set(self.nodes) | {self._node})):
            try:
                self.cidrs[name] = tuple(await self._ipam.node_cidrs(name))
                self._stale.discard(name)
            except Exception as exc:  # ipam away: the Node's own podCIDRs stand in, asked again later
                log.warning("node pod cidrs not known", node=name, error=str(exc))
        self._stale &= set(self.nodes) | {self._node}
        desired, skipped = plan(
            self._node,
            self.nodes,
            self.cidrs,
            self.mode,
            tunnel_port=self._port,
            tunnel_vni=self._vni,
            pod_addresses=self.pod_addresses,
        )
        if skipped != self.skipped:
            for line in skipped:
                log.warning("pod cidr not routed", detail=line)
        self.skipped = skipped
        self.result = await asyncio.to_thread(self._routing.apply, desired)
        if desired != self.applied:
            log.info(
                "node routes applied",
                mode=self.mode,
                routes=len(desired.routes),
                removed=self.result.removed,
                failed=len(self.result.failed),
            )
        self.applied = desired
        if self._masquerade is not None:
            masq = masquerade_plan(
                self._node,
                self.nodes,
                self.cidrs,
                self._masquerade_enabled,
                self._non_masquerade,
                self.pod_addresses,
            )
            if masq != self.masqueraded:
                try:
                    await asyncio.to_thread(self._masquerade.apply, masq)
                    self.masqueraded, self.masquerade_error = masq, ""
                except OSError as exc:
                    self.masquerade_error = str(exc)
                    log.error("masquerade not applied", error=str(exc))
        return self.result
