"""One local endpoint: its durable record, where its policy stands, and how it is named.

An :class:`Endpoint` is mutated only by the endpoint manager's task: the manager
changes its record (create, relabel, restore), the realizer its policy state and
:attr:`Endpoint.realized` (what its map holds).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import ipaddress
from collections.abc import Mapping

from services.datapath.netns import PodLink
from services.datapath.state import EndpointRecord
from services.datapath.types import EndpointSpec, EndpointState, Enforcement, PolicyEntry, PolicyKey


@dataclasses.dataclass(frozen=True)
class RealizedPolicy:
    """What an endpoint's map holds, as last written or read back. Written only by the realizer."""

    enforcement: Enforcement
    #: Shared with the desired policy it was written from (never mutated).
    entries: Mapping[PolicyKey, PolicyEntry]
    #: :attr:`IdentityPolicy.version` of that desired policy (0: read back from the kernel).
    version: int = 0


@dataclasses.dataclass
class Endpoint:
    """One local pod. Mutated only by the manager's task."""

    record: EndpointRecord
    state: EndpointState = EndpointState.WAITING
    error: str = ""
    realized_revision: int = 0
    #: The revision a policy map write failed to realize (0 unless FAILED by a write; reported with ``error``).
    failed_revision: int = 0
    #: What the map holds (None: unknown, the next write syncs fully).
    realized: RealizedPolicy | None = None

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def identity(self) -> int:
        return self.record.identity

    @property
    def enforcement(self) -> Enforcement:
        """The enforcement the map holds (none while unknown)."""
        return self.realized.enforcement if self.realized is not None else Enforcement()


@dataclasses.dataclass(frozen=True)
class EndpointRef:
    """How a request names an endpoint: by id, or by namespace/pod."""

    id: int = 0
    namespace: str = ""
    pod: str = ""
    container_id: str = ""

    def __str__(self) -> str:
        if self.id:
            return f"endpoint {self.id}"
        return f"pod {self.namespace}/{self.pod}" if self.pod else f"container {self.container_id}"


def host_ifname(namespace: str, pod: str) -> str:
    """The host-side veth name of a pod: ``lxc`` + 12 hex digits of a hash, like Cilium (<= 15 chars)."""
    return "lxc" + hashlib.sha256(f"{namespace}/{pod}".encode()).hexdigest()[:12]


def netns_name(namespace: str, pod: str) -> str:
    """Name of a namespace the datapath creates; unambiguous as namespaces cannot contain '_'."""
    return f"pal_{namespace}_{pod}"


@functools.lru_cache(maxsize=8192)
def host_prefix(ip: str) -> str:
    """The ipcache prefix of one address (/32 or /128). Cached: every ipcache event asks it of
    every local endpoint's addresses (:meth:`EndpointManager.local_prefixes`)."""
    return f"{ip}/{ipaddress.ip_address(ip).max_prefixlen}"


def spec_of(record: EndpointRecord) -> EndpointSpec:
    """What the BPF facade needs to attach the endpoint."""
    return EndpointSpec(
        id=record.id,
        ifindex=record.host_ifindex,
        host_ifname=record.host_ifname,
        ips=tuple(record.ips),
        identity=record.identity,
        host_mac=record.host_mac if record.link_owned else "",
        pod_mac=record.mac if record.link_owned else "",
    )


def link_of(record: EndpointRecord) -> PodLink:
    """The pod network of an endpoint, as its record remembers it."""
    return PodLink(
        record.netns,
        record.netns_owned,
        record.host_ifname,
        record.host_ifindex,
        ips=record.ips,
        link_owned=record.link_owned,
        pod_ifname=record.ifname,
        pod_mac=record.mac,
    )
