"""ClientIP session affinity: an LRU hash from (client address, service id) to the backend it last used.

An entry older than the service's timeout, or naming a backend id that no longer
exists, is ignored and replaced on the client's next new connection.
"""

from __future__ import annotations

import ctypes

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "lb_affinity"


class LbAffinityKey(ctypes.Structure):
    # struct lb_affinity_key in bpf/palisade.c
    _fields_ = [
        ("client", ctypes.c_uint8 * 16),
        ("rev_nat", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class LbAffinityValue(ctypes.Structure):
    # struct lb_affinity_value in bpf/palisade.c
    _fields_ = [
        ("last_ns", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


C_STRUCTS = ((LbAffinityKey, "lb_affinity_key"), (LbAffinityValue, "lb_affinity_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(
        NAME, MapType.LRU_HASH, ctypes.sizeof(LbAffinityKey), ctypes.sizeof(LbAffinityValue), sizes.lb_affinity
    )


class LbAffinityMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def forget_service(self, service_id: int) -> int:
        """Drop a deleted service's entries (its id may be given to another service)."""
        stale = [k for k in self.map.keys(LbAffinityKey) if int(k.rev_nat) == service_id]
        return sum(self.map.delete(k) for k in stale)
