"""Service connections: an LRU hash from a connection as the client sent it to its backend.

Keyed by (client address and port, ClusterIP and port, protocol, endpoint), the
value keeps the backend id and the service id for the life of the connection,
with the same idle lifetimes as ``ctmap``, and the backend's address and port with
the service's revision (``lbservicemap``) they were read at: while the service
still has that revision no backend has left it, and a packet is rewritten from the
entry alone; after, the backend is looked up by id again (kept if still there,
else the connection gets another live backend). A map pinned with the older layout
(no address, no revision) is read, replaced and its entries written again with
their backends' addresses (:meth:`LbCtMap.adopt`), so established connections keep
their backends across the upgrade.
"""

from __future__ import annotations

import ctypes
import dataclasses
import socket
from collections.abc import Mapping

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Backend

NAME = "lb_conntrack"


class LbCtKey(ctypes.Structure):
    # struct lb_ct_key in bpf/palisade.c; addresses and ports in network order.
    _fields_ = [
        ("saddr", ctypes.c_uint8 * 16),
        ("vaddr", ctypes.c_uint8 * 16),
        ("sport", ctypes.c_uint16),
        ("vport", ctypes.c_uint16),
        ("ep_id", ctypes.c_uint32),
        ("family", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 2),
    ]


class LbCtValue(ctypes.Structure):
    # struct lb_ct_value in bpf/palisade.c
    _fields_ = [
        ("expires_ns", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("rev_nat", ctypes.c_uint16),
        ("closing", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("addr", ctypes.c_uint8 * 16),
        ("port", ctypes.c_uint16),
        ("pad2", ctypes.c_uint16),
        ("revision", ctypes.c_uint32),
    ]


C_STRUCTS = ((LbCtKey, "lb_ct_key"), (LbCtValue, "lb_ct_value"))


class LegacyLbCtValue(ctypes.Structure):
    # struct lb_ct_value before it kept the backend's address and the service's revision
    _fields_ = [
        ("expires_ns", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("rev_nat", ctypes.c_uint16),
        ("closing", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


@dataclasses.dataclass(frozen=True)
class Legacy:
    """The entries of a map pinned with the older layout, read before it is replaced."""

    entries: list[tuple[LbCtKey, LegacyLbCtValue]]


def read_legacy(pinned: PinnedMap) -> Legacy | None:
    """The entries of ``pinned`` if it has the older layout (None: any other layout)."""
    if (pinned.spec.key_size, pinned.spec.value_size) != (ctypes.sizeof(LbCtKey), ctypes.sizeof(LegacyLbCtValue)):
        return None
    return Legacy(list(pinned.items(LbCtKey, LegacyLbCtValue)))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.LRU_HASH, ctypes.sizeof(LbCtKey), ctypes.sizeof(LbCtValue), sizes.lb_conntrack)


@dataclasses.dataclass(frozen=True)
class LbCtEntry:
    ep_id: int
    protocol: int
    client: str
    client_port: int
    frontend: str
    frontend_port: int
    backend_id: int
    service_id: int
    expires_ns: int
    #: The backend the entry rewrites to (as read at ``revision``).
    backend: str = ""
    backend_port: int = 0
    revision: int = 0


class LbCtMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def adopt(self, legacy: Legacy, backends: Mapping[int, Backend], revisions: Mapping[int, int]) -> int:
        """Write an older map's entries in this layout: each with its backend's address and port
        (``backends``: by backend id) and its service's current revision (``revisions``: by
        service id). An entry whose backend or service is gone is left out: its connection picks a
        live backend on its next packet, as it would have. Returns how many were written."""
        written = 0
        for key, old in legacy.entries:
            backend = backends.get(int(old.backend_id))
            revision = revisions.get(int(old.rev_nat))
            if backend is None or revision is None:
                continue
            value = LbCtValue(
                expires_ns=old.expires_ns,
                backend_id=old.backend_id,
                rev_nat=old.rev_nat,
                closing=old.closing,
                port=socket.htons(backend.port),
                revision=revision,
            )
            addresses.put(value.addr, backend.address)
            self.map.update(key, value)
            written += 1
        return written

    def entries(self) -> list[LbCtEntry]:
        out = []
        for k, v in self.map.items(LbCtKey, LbCtValue):
            family = int(k.family)
            out.append(
                LbCtEntry(
                    ep_id=int(k.ep_id),
                    protocol=int(k.protocol),
                    client=addresses.get(k.saddr, family),
                    client_port=socket.ntohs(int(k.sport)),
                    frontend=addresses.get(k.vaddr, family),
                    frontend_port=socket.ntohs(int(k.vport)),
                    backend_id=int(v.backend_id),
                    service_id=int(v.rev_nat),
                    expires_ns=int(v.expires_ns),
                    backend=addresses.get(v.addr, family),
                    backend_port=socket.ntohs(int(v.port)),
                    revision=int(v.revision),
                )
            )
        return out
