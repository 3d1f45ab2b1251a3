"""Connection tracking of IPv4 flows: ``ctmap``'s entries with a 20-byte key (see there)."""

from __future__ import annotations

import ctypes

from services.datapath.maps.bpf import MapSpec, MapType
from services.datapath.maps.ctmap import Ct4Key, CtValue
from services.datapath.maps.sizes import MapSizes

NAME = "conntrack4"

C_STRUCTS = ((Ct4Key, "ct4_key"),)


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.LRU_HASH, ctypes.sizeof(Ct4Key), ctypes.sizeof(CtValue), sizes.conntrack)
