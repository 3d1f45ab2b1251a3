"""Which pod CIDR a node should have, in Cilium's priority order. Pure.

In Kubernetes mode, per address family: the node's ``spec.podCIDRs`` (or the
older ``spec.podCIDR``) wins, else the ``network.cilium.io/ipv4-pod-cidr``
annotation (or its older spelling ``io.cilium.network.ipv4-pod-cidr``; ``ipv6``
likewise), else a CIDR carved out of the cluster pool. In cluster-pool mode the
pool always decides. A value that does not parse is skipped (and reported), so
a typo falls through to the next source instead of breaking the node.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
from collections.abc import Iterable, Mapping
from typing import Any

from services.common.podcidr import IPNetwork
from services.ipam.config import IPAMMode

ANNOTATIONS = {
    4: ("network.cilium.io/ipv4-pod-cidr", "io.cilium.network.ipv4-pod-cidr"),
    6: ("network.cilium.io/ipv6-pod-cidr", "io.cilium.network.ipv6-pod-cidr"),
}


class CIDRSource(enum.StrEnum):
    NODE_SPEC = "spec"
    ANNOTATION = "annotation"
    POOL = "pool"


@dataclasses.dataclass(frozen=True, slots=True)
class NodeCIDR:
    cidr: IPNetwork
    source: CIDRSource

    @property
    def family(self) -> int:
        return self.cidr.version


@dataclasses.dataclass(frozen=True, slots=True)
class NodeRecord:
    """What etcd says a node has: one CIDR per family, IPv4 first."""

    node: str
    cidrs: tuple[NodeCIDR, ...]
    #: Mod revision of the record's key (0: not stored).
    mod_revision: int = 0

    def cidr(self, family: int) -> NodeCIDR | None:
        for c in self.cidrs:
            if c.family == family:
                return c
        return None

    @property
    def source(self) -> CIDRSource:
        return self.cidrs[0].source if self.cidrs else CIDRSource.POOL

    def to_json(self) -> bytes:
        return json.dumps({"cidrs": [{"cidr": str(c.cidr), "source": c.source.value} for c in self.cidrs]}).encode()

    @classmethod
    def from_json(cls, node: str, raw: bytes, mod_revision: int) -> NodeRecord:
        data = json.loads(raw)
        cidrs = tuple(NodeCIDR(ipaddress.ip_network(c["cidr"]), CIDRSource(c["source"])) for c in data.get("cidrs", []))
        return cls(node, tuple(sorted(cidrs, key=lambda c: c.family)), mod_revision)


def _parse(value: Any) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        return None


def _spec_cidrs(node: Mapping[str, Any]) -> list[Any]:
    spec = node.get("spec") or {}
    values = list(spec.get("podCIDRs") or [])
    if not values and spec.get("podCIDR"):
        values = [spec["podCIDR"]]
    return values


def from_node(node: Mapping[str, Any] | None, family: int) -> tuple[NodeCIDR | None, list[str]]:
    """The node object's own CIDR for ``family`` (spec, else annotation) and any problems seen."""
    if node is None:
        return None, []
    problems: list[str] = []
    values = _spec_cidrs(node)
    for value in values:
        net = _parse(value)
        if net is None:
            problems.append(f"spec.podCIDRs value {value!r} is not a CIDR")
        elif net.version == family:
            return NodeCIDR(net, CIDRSource.NODE_SPEC), problems
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    for name in ANNOTATIONS[family]:
        if name in annotations:
            net = _parse(annotations[name])
            if net is None or net.version != family:
                problems.append(f"annotation {name}={annotations[name]!r} is not an IPv{family} CIDR")
                continue
            return NodeCIDR(net, CIDRSource.ANNOTATION), problems
    return None, problems


def desired(
    node: Mapping[str, Any] | None, families: Iterable[int], mode: IPAMMode
) -> tuple[dict[int, NodeCIDR | None], list[str]]:
    """Per family, the CIDR the node object dictates, or None for "from the pool"."""
    out: dict[int, NodeCIDR | None] = {}
    problems: list[str] = []
    for family in families:
        if mode == IPAMMode.KUBERNETES:
            found, seen = from_node(node, family)
            out[family] = found
            problems += seen
        else:
            out[family] = None
    return out, problems
