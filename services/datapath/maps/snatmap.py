"""Source ports given to clashing connections: an LRU hash, both directions of each.

Two connections of one client that differ only before DNAT (one through a ClusterIP, one
straight to the backend, from the same client port) are one tuple to the backend. As
netfilter's NAT does for a clashing tuple, the program gives the later one a source port of
its own (``SNAT_PORT_MIN``..``SNAT_PORT_MAX``) and marks its conntrack entry ``CT_F_SNAT``.
A forward entry keys the connection as the client sent it (after DNAT) and holds the port
given; a reverse entry keys it with the port given and holds the client's. The program
trusts an entry only while both agree and the given tuple's conntrack entry lives, so
nothing needs collecting: stale entries are harmless and the LRU reclaims them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import socket

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "snat"
#: snat_key.kind
FORWARD = 1
REVERSE = 2
#: The ports the program gives (SNAT_PORT_MIN / SNAT_PORT_MAX in bpf/palisade.c): above the
#: kernel's default ephemeral range, so the client's own connections seldom pick them.
PORT_MIN = 61000
PORT_MAX = 65535


class SnatKey(ctypes.Structure):
    # struct snat_key in bpf/palisade.c; addresses and ports in network order.
    _fields_ = [
        ("saddr", ctypes.c_uint8 * 16),
        ("daddr", ctypes.c_uint8 * 16),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("ep_id", ctypes.c_uint32),
        ("rev_nat", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("kind", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class SnatValue(ctypes.Structure):
    # struct snat_value in bpf/palisade.c
    _fields_ = [
        ("port", ctypes.c_uint16),
        ("pad", ctypes.c_uint16),
    ]


C_STRUCTS = ((SnatKey, "snat_key"), (SnatValue, "snat_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.LRU_HASH, ctypes.sizeof(SnatKey), ctypes.sizeof(SnatValue), sizes.snat)


@dataclasses.dataclass(frozen=True)
class SnatEntry:
    """A connection given a port: as its client sent it (after DNAT), and the port it leaves with."""

    ep_id: int
    protocol: int
    client: str
    client_port: int
    destination: str
    destination_port: int
    #: The service the connection was opened to (0: straight to the destination).
    service_id: int
    given_port: int


class SnatMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def entries(self) -> list[SnatEntry]:
        """The forward entries (each connection once)."""
        out = []
        for k, v in self.map.items(SnatKey, SnatValue):
            if int(k.kind) != FORWARD:
                continue
            family = int(k.family)
            out.append(
                SnatEntry(
                    ep_id=int(k.ep_id),
                    protocol=int(k.protocol),
                    client=addresses.get(k.saddr, family),
                    client_port=socket.ntohs(int(k.sport)),
                    destination=addresses.get(k.daddr, family),
                    destination_port=socket.ntohs(int(k.dport)),
                    service_id=int(k.rev_nat),
                    given_port=socket.ntohs(int(v.port)),
                )
            )
        return out

    def flush(self, ep_id: int | None = None) -> int:
        count = 0
        for key, _ in list(self.map.items(SnatKey, SnatValue)):
            if ep_id is None or int(key.ep_id) == ep_id:
                count += self.map.delete(key)
        return count
