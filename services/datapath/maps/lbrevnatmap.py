"""Reverse NAT: a hash from service id to its frontend, so replies carry the ClusterIP and port.

A connection's conntrack entry names the service id it was opened to; a reply
entering the client gets the frontend's address and port as its source.
"""

from __future__ import annotations

import ctypes
import socket

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Frontend

NAME = "lb_revnat"


class LbRevNatKey(ctypes.Structure):
    # struct lb_revnat_key in bpf/palisade.c
    _fields_ = [("id", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


class LbRevNatValue(ctypes.Structure):
    # struct lb_revnat_value in bpf/palisade.c; address and port in network order.
    _fields_ = [
        ("addr", ctypes.c_uint8 * 16),
        ("port", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


C_STRUCTS = ((LbRevNatKey, "lb_revnat_key"), (LbRevNatValue, "lb_revnat_value"))


def spec(sizes: MapSizes) -> MapSpec:
    # One per service id (ids are 16-bit).
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(LbRevNatKey), ctypes.sizeof(LbRevNatValue), sizes.lb_services)


class LbRevNatMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def write(self, service_id: int, frontend: Frontend) -> None:
        value = LbRevNatValue(port=socket.htons(frontend.port))
        value.family = addresses.put(value.addr, frontend.address)
        self.map.update(LbRevNatKey(id=service_id), value)

    def delete(self, service_id: int) -> bool:
        return self.map.delete(LbRevNatKey(id=service_id))

    def ids(self) -> set[int]:
        return {int(k.id) for k in self.map.keys(LbRevNatKey)}
