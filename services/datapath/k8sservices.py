"""Kubernetes Services and EndpointSlices into load-balancer frontends for one node.

Pure: parsed objects in, :class:`LbService` values out (the service handler of
Cilium's agent, ``pkg/k8s`` ServiceCache, in small). Rules, as kube-proxy applies them:

* every ClusterIP (``spec.clusterIPs``, both families) x every TCP, UDP or SCTP
  port is a frontend; headless (``None``) and ExternalName Services have none; a
  port of any other protocol is not load-balanced (reported by :func:`frontends`'
  ``skipped``);
* backends come from the EndpointSlices labelled ``kubernetes.io/service-name``
  with the Service's name, of the frontend's address family; a Service port
  takes the slice port of the same name (the slice carries the target port
  resolved for its pods, named target ports included);
* an endpoint serves if it is ready and not terminating (an absent condition
  counts as ready and not terminating); its first address is used;
* ``internalTrafficPolicy: Local`` keeps only endpoints on this node (none: the
  frontend rejects, as Kubernetes specifies);
* ``sessionAffinity: ClientIP`` uses ``sessionAffinityConfig.clientIP.timeoutSeconds``
  (default 10800).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from services.common.k8sobjects import as_list, as_map, endpoint_serves, slice_service
from services.datapath.types import Backend, Frontend, L4Proto, LbService

DEFAULT_AFFINITY_TIMEOUT = 10800
_PROTOCOLS = {"TCP": L4Proto.TCP, "UDP": L4Proto.UDP, "SCTP": L4Proto.SCTP}


@dataclasses.dataclass(frozen=True)
class ServicePort:
    name: str
    port: int
    protocol: str


@dataclasses.dataclass(frozen=True)
class ServiceInfo:
    """What of a Service the load-balancer uses."""

    namespace: str
    name: str
    cluster_ips: tuple[str, ...]
    ports: tuple[ServicePort, ...]
    affinity_timeout: int = 0
    local_only: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclasses.dataclass(frozen=True)
class SliceEndpoint:
    address: str
    node: str
    serving: bool


@dataclasses.dataclass(frozen=True)
class SliceInfo:
    """What of an EndpointSlice the load-balancer uses."""

    namespace: str
    name: str
    service: str
    family: int
    #: port name -> (number, protocol)
    ports: Mapping[str, tuple[int, str]]
    endpoints: tuple[SliceEndpoint, ...]

    @property
    def service_key(self) -> str:
        return f"{self.namespace}/{self.service}"


@dataclasses.dataclass(frozen=True)
class Frontends:
    """A Service's frontends on this node, with the backends each reaches."""

    services: tuple[LbService, ...]
    #: Ports that are not load-balanced, with why (for logs and ``service list``).
    skipped: tuple[str, ...] = ()


def parse_service(obj: Mapping[str, Any]) -> ServiceInfo:
    meta, spec = as_map(obj.get("metadata")), as_map(obj.get("spec"))
    ips: list[str] = []
    if spec.get("type") != "ExternalName":
        for ip in [*as_list(spec.get("clusterIPs")), spec.get("clusterIP")]:
            if not isinstance(ip, str) or ip in ("", "None"):
                continue
            try:
                normalized = str(ipaddress.ip_address(ip))
            except ValueError:
                continue
            if normalized not in ips:
                ips.append(normalized)
    ports = tuple(
        ServicePort(str(p.get("name") or ""), int(p.get("port") or 0), str(p.get("protocol") or "TCP").upper())
        for p in map(as_map, as_list(spec.get("ports")))
        if isinstance(p.get("port"), int)
    )
    timeout = 0
    if spec.get("sessionAffinity") == "ClientIP":
        configured = as_map(as_map(spec.get("sessionAffinityConfig")).get("clientIP")).get("timeoutSeconds")
        timeout = configured if isinstance(configured, int) and configured > 0 else DEFAULT_AFFINITY_TIMEOUT
    return ServiceInfo(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        cluster_ips=tuple(ips),
        ports=ports,
        affinity_timeout=timeout,
        local_only=spec.get("internalTrafficPolicy") == "Local",
    )


def parse_slice(obj: Mapping[str, Any]) -> SliceInfo:
    meta = as_map(obj.get("metadata"))
    family = {"IPv4": 4, "IPv6": 6}.get(str(obj.get("addressType")), 0)
    ports: dict[str, tuple[int, str]] = {}
    for p in map(as_map, as_list(obj.get("ports"))):
        if isinstance(p.get("port"), int):
            ports[str(p.get("name") or "")] = (int(p["port"]), str(p.get("protocol") or "TCP").upper())
    endpoints = []
    for ep in map(as_map, as_list(obj.get("endpoints"))):
        addresses = [a for a in as_list(ep.get("addresses")) if isinstance(a, str)]
        if not addresses:
            continue
        serving = endpoint_serves(ep)
        try:
            address = str(ipaddress.ip_address(addresses[0]))
        except ValueError:
            continue
        endpoints.append(SliceEndpoint(address, str(ep.get("nodeName") or ""), serving))
    return SliceInfo(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        service=slice_service(obj),
        family=family,
        ports=ports,
        endpoints=tuple(endpoints),
    )


def frontends(service: ServiceInfo, slices: Iterable[SliceInfo], node: str) -> Frontends:
    """The Service's frontends as this node serves them."""
    slices = [s for s in slices if s.service_key == service.key]
    out: list[LbService] = []
    skipped: list[str] = []
    for port in service.ports:
        protocol = _PROTOCOLS.get(port.protocol)
        if protocol is None:
            skipped.append(f"{service.key} port {port.port}/{port.protocol}: {port.protocol} is not load-balanced")
            continue
        for ip in service.cluster_ips:
            family = ipaddress.ip_address(ip).version
            backends: list[Backend] = []
            for sl in slices:
                target = sl.ports.get(port.name)
                if sl.family != family or target is None or target[1] != port.protocol:
                    continue
                for ep in sl.endpoints:
                    if not ep.serving or (service.local_only and ep.node != node):
                        continue
                    backends.append(Backend(ep.address, target[0]))
            frontend = Frontend(ip, port.port, protocol)
            out.append(LbService(frontend, tuple(sorted(set(backends))), service.affinity_timeout))
    return Frontends(tuple(out), tuple(skipped))
