"""A dev cluster's EndpointSlice controller: the slices Kubernetes would keep for each Service.

Pure. In a dev cluster (``make run``) nothing runs kube-controller-manager, so the
manifest source derives the slices itself, as the controller does
(``pkg/controller/endpointslice``): for each Service with a selector, the pods of
its namespace whose labels match, that have an address (the pod is running: ipam
gave it one), grouped by the ports each pod resolves, one slice per group and
address family. A named ``targetPort`` is resolved in each pod's container ports
(a pod without that port is left out of that port's slices); a numeric or absent
one is the number. A Service whose slices the folder defines itself keeps those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
from collections.abc import Callable, Mapping
from typing import Any

from services.common.k8sobjects import SERVICE_NAME_LABEL, as_list, as_map, slice_service
from services.watcher.kinds import Kind, KindInfo, lookup
from services.watcher.objects import KObject, ObjectKey, from_api

MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "palisade-dev-cluster"
ORIGIN = "(dev cluster)"
#: (kind, namespace, name) -> the uid a manifest source gives an object it makes
UidOf = Callable[[KindInfo, str, str], str]

#: (namespace, pod) -> the pod's addresses
PodAddresses = Mapping[tuple[str, str], tuple[str, ...]]


def _resolve(target: Any, port: int, protocol: str, pod: Mapping[str, Any]) -> int | None:
    if target is None or target == "":
        return port
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in as_list(as_map(pod.get("spec")).get("containers")):
        for cp in map(as_map, as_list(as_map(container).get("ports"))):
            if cp.get("name") == target and str(cp.get("protocol") or "TCP").upper() == protocol:
                number = cp.get("containerPort")
                return number if isinstance(number, int) else None
    return None


def _slices_for(service: KObject, pods: list[KObject], addresses: PodAddresses) -> list[dict[str, Any]]:
    spec = as_map(service.body.get("spec"))
    ns, name = service.key.namespace, service.key.name
    # group key: (family, ((port name, number, protocol), ...)) -> endpoints
    groups: dict[tuple[str, tuple[tuple[str, int, str], ...]], list[dict[str, Any]]] = {}
    for pod in sorted(pods, key=lambda p: p.key.name):
        ips = addresses.get((ns, pod.key.name), ())
        if not ips:
            continue
        resolved = []
        for sp in map(as_map, as_list(spec.get("ports"))):
            if not isinstance(sp.get("port"), int):
                continue
            protocol = str(sp.get("protocol") or "TCP").upper()
            number = _resolve(sp.get("targetPort"), int(sp["port"]), protocol, pod.body)
            if number is not None:
                resolved.append((str(sp.get("name") or ""), number, protocol))
        terminating = bool(as_map(pod.body.get("metadata")).get("deletionTimestamp"))
        for ip in ips:
            family = "IPv4" if ipaddress.ip_address(ip).version == 4 else "IPv6"
            groups.setdefault((family, tuple(resolved)), []).append(
                {
                    "addresses": [ip],
                    "conditions": {"ready": not terminating, "serving": not terminating, "terminating": terminating},
                    "nodeName": as_map(pod.body.get("spec")).get("nodeName") or "",
                    "targetRef": {"kind": "Pod", "namespace": ns, "name": pod.key.name},
                }
            )
    out = []
    for (family, ports), endpoints in sorted(groups.items()):
        digest = hashlib.sha256(json.dumps([family, ports]).encode()).hexdigest()[:8]
        out.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-{digest}",
                    "namespace": ns,
                    "labels": {SERVICE_NAME_LABEL: name, MANAGED_BY_LABEL: MANAGED_BY},
                },
                "addressType": family,
                "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
                "endpoints": endpoints,
            }
        )
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SliceInputs:
    """What a set of objects gives the controller to work from: the Services whose slices it keeps,
    the pods of each namespace, and the slices the objects define themselves. Taken once per change
    of the objects, so a change of the pods' addresses alone costs the Services' slices, not a pass
    over every object."""

    services: tuple[KObject, ...]
    pods_by_ns: Mapping[str, tuple[KObject, ...]]
    slices: Mapping[ObjectKey, KObject]


def slice_inputs(objects: Mapping[ObjectKey, KObject]) -> SliceInputs:
    slices = {key: obj for key, obj in objects.items() if key.kind is Kind.ENDPOINT_SLICE}
    defined = {(key.namespace, slice_service(obj.body)) for key, obj in slices.items()}
    pods_by_ns: dict[str, list[KObject]] = {}
    services = []
    for key, obj in objects.items():
        if key.kind is Kind.POD:
            pods_by_ns.setdefault(key.namespace, []).append(obj)
        elif key.kind is Kind.SERVICE and (key.namespace, key.name) not in defined:
            spec = as_map(obj.body.get("spec"))
            # No selector: the user keeps the slices (Kubernetes does not manage them).
            if as_map(spec.get("selector")) and spec.get("type") != "ExternalName":
                services.append(obj)
    return SliceInputs(tuple(services), {ns: tuple(pods) for ns, pods in pods_by_ns.items()}, slices)


def endpoint_slices(inputs: SliceInputs, addresses: PodAddresses, uid: UidOf) -> dict[ObjectKey, KObject]:
    """The slices the controller keeps for ``inputs``' Services, given the pods' ``addresses``."""
    info = lookup("discovery.k8s.io/v1", "EndpointSlice")
    assert info is not None
    out: dict[ObjectKey, KObject] = {}
    for service in inputs.services:
        ns = service.key.namespace
        selector = as_map(as_map(service.body.get("spec")).get("selector"))
        members = [
            pod
            for pod in inputs.pods_by_ns.get(ns, ())
            if all(as_map(as_map(pod.body.get("metadata")).get("labels")).get(k) == v for k, v in selector.items())
        ]
        for body in _slices_for(service, members, addresses):
            body["metadata"]["uid"] = uid(info, ns, body["metadata"]["name"])
            obj = from_api(info, body, origin=ORIGIN)
            out[obj.key] = obj
    return out


def with_endpoint_slices(
    objects: Mapping[ObjectKey, KObject], addresses: PodAddresses, uid: UidOf
) -> dict[ObjectKey, KObject]:
    """``objects`` plus the slices the controller would keep for their Services."""
    return {**objects, **endpoint_slices(slice_inputs(objects), addresses, uid)}
