"""What ipam needs from Kubernetes objects: pods, namespaces and nodes out of K8sDelta. Pure.

The watcher publishes each object as JSON in ``K8sDelta.object_json``; a DELETE
is a tombstone. This module turns deltas into typed changes and a pod into the
facts that decide its identity and ipcache entries; it does no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
from collections.abc import Mapping
from typing import Any

from palisade.v1 import common_pb2, identity_pb2, k8s_pb2
from services.common.errors import Code
from services.common.labels import LabelSet, pod_identity_labels
from services.ipam.errors import IpamError

#: Pod phases after which a pod holds no address and no identity (as for Cilium endpoints).
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})

_PROTOCOLS = {
    "TCP": common_pb2.PROTOCOL_TCP,
    "UDP": common_pb2.PROTOCOL_UDP,
    "SCTP": common_pb2.PROTOCOL_SCTP,
}


class ObjectKind(enum.StrEnum):
    POD = "pod"
    NAMESPACE = "namespace"
    NODE = "node"


_KINDS = {
    k8s_pb2.K8S_KIND_POD: ObjectKind.POD,
    k8s_pb2.K8S_KIND_NAMESPACE: ObjectKind.NAMESPACE,
    k8s_pb2.K8S_KIND_NODE: ObjectKind.NODE,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One object created/changed (``obj`` set) or deleted (``obj`` None)."""

    kind: ObjectKind
    namespace: str
    name: str
    obj: Mapping[str, Any] | None


class BadObject(ValueError):
    """A delta whose object cannot be used; the message names the object and the field."""


def decode(delta: k8s_pb2.K8sDelta) -> Change | None:
    """The change a delta carries, or None for kinds ipam does not use."""
    kind = _KINDS.get(delta.kind)
    if kind is None:
        return None
    where = f"{kind} {delta.namespace + '/' if delta.namespace else ''}{delta.name}"
    if delta.op == k8s_pb2.DELTA_OP_DELETE:
        return Change(kind, delta.namespace, delta.name, None)
    if delta.op != k8s_pb2.DELTA_OP_UPSERT:
        raise BadObject(f"{where}: delta op {delta.op} is neither UPSERT nor DELETE")
    try:
        obj = json.loads(delta.object_json or b"{}")
    except ValueError as exc:
        raise BadObject(f"{where}: object_json is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise BadObject(f"{where}: object_json is not a JSON object")
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict):
        raise BadObject(f"{where}: metadata is not an object")
    name = delta.name or str(meta.get("name") or "")
    namespace = delta.namespace or str(meta.get("namespace") or "")
    if not name:
        raise BadObject(f"{where}: object has no metadata.name")
    if kind == ObjectKind.POD and not namespace:
        namespace = "default"
    return Change(kind, namespace, name, obj)


@dataclasses.dataclass(frozen=True, slots=True)
class NamedPort:
    port: int
    protocol: common_pb2.Protocol.ValueType


@dataclasses.dataclass(frozen=True, slots=True)
class Pod:
    """The parts of a Pod that decide its identity and ipcache entries."""

    namespace: str
    name: str
    uid: str
    node: str
    phase: str
    host_network: bool
    #: Addresses from status.podIPs / status.podIP, normalized, IPv4 first.
    ips: tuple[str, ...]
    named_ports: tuple[tuple[str, NamedPort], ...]
    #: The object, kept to recompute identity labels when the namespace changes.
    obj: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def owner(self) -> str:
        return pod_owner(self.namespace, self.name)

    @property
    def active(self) -> bool:
        """Whether the pod should hold an identity: scheduled, not finished, on the pod network."""
        return bool(self.node) and self.phase not in TERMINAL_PHASES and not self.host_network

    def identity_labels(self, namespace: Mapping[str, Any] | None, cluster: str) -> LabelSet:
        return pod_identity_labels(self.obj, namespace, cluster=cluster)


def pod_owner(namespace: str, name: str) -> str:
    """The owner string of a pod's identity reference and IPAM allocation."""
    return f"pod/{namespace}/{name}"


def parse_owner(owner: str) -> tuple[str, str] | None:
    """(namespace, name) of a ``pod/<ns>/<name>`` owner."""
    parts = owner.split("/")
    if len(parts) == 3 and parts[0] == "pod" and parts[1] and parts[2]:
        return parts[1], parts[2]
    return None


def _ips(status: Mapping[str, Any]) -> tuple[str, ...]:
    raw = [p.get("ip") for p in status.get("podIPs") or [] if isinstance(p, dict)]
    if not raw and status.get("podIP"):
        raw = [status["podIP"]]
    out = []
    for value in raw:
        try:
            out.append(ipaddress.ip_address(str(value)))
        except ValueError:
            continue
    return tuple(str(ip) for ip in sorted(set(out), key=lambda ip: (ip.version, int(ip))))


def _named_ports(spec: Mapping[str, Any]) -> tuple[tuple[str, NamedPort], ...]:
    out: dict[str, NamedPort] = {}
    for container in spec.get("containers") or []:
        if not isinstance(container, dict):
            continue
        for port in container.get("ports") or []:
            if not isinstance(port, dict) or not port.get("name"):
                continue
            try:
                number = int(port.get("containerPort") or 0)
            except (TypeError, ValueError):
                continue
            proto = _PROTOCOLS.get(str(port.get("protocol") or "TCP").upper(), common_pb2.PROTOCOL_TCP)
            out.setdefault(str(port["name"]), NamedPort(number, proto))
    return tuple(sorted(out.items()))


def named_ports_from_proto(ports: Mapping[str, identity_pb2.NamedPort]) -> tuple[tuple[str, NamedPort], ...]:
    """Named ports given over the API, sorted by name; PROTOCOL_ANY means TCP, as in a pod spec.

    Raises INVALID_ARGUMENT naming the port that cannot be a container port.
    """
    out = []
    allowed = set(_PROTOCOLS.values())
    for name, port in sorted(ports.items()):
        if not name:
            raise IpamError("named_ports: a port has an empty name", Code.INVALID_ARGUMENT)
        if not 0 < port.port <= 65535:
            raise IpamError(f"named_ports[{name}]: port {port.port} is outside 1-65535", Code.INVALID_ARGUMENT)
        protocol = port.protocol or common_pb2.PROTOCOL_TCP
        if protocol not in allowed:
            raise IpamError(
                f"named_ports[{name}]: protocol {port.protocol} is not a container port protocol (TCP, UDP, SCTP)",
                Code.INVALID_ARGUMENT,
            )
        out.append((name, NamedPort(port.port, protocol)))
    return tuple(out)


def parse_pod(change: Change) -> Pod:
    obj = change.obj or {}
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    host_network = bool(spec.get("hostNetwork"))
    return Pod(
        namespace=change.namespace,
        name=change.name,
        uid=str(meta.get("uid") or ""),
        node=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or ""),
        host_network=host_network,
        ips=_ips(status) if not host_network else (),
        named_ports=_named_ports(spec),
        obj=obj,
    )


def host_prefix(ip: str) -> str:
    """The ipcache prefix of one address: ``/32`` or ``/128``."""
    addr = ipaddress.ip_address(ip)
    return f"{addr}/{32 if addr.version == 4 else 128}"
