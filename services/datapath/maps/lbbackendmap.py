"""Service backends: a hash from backend id to the pod address and target port.

A backend id belongs to one service: a backend removed from its service loses its
id, so connections that had it (``lbctmap``) pick another live backend.
"""

from __future__ import annotations

import ctypes
import socket

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Backend

NAME = "lb_backends"


class LbBackendKey(ctypes.Structure):
    # struct lb_backend_key in bpf/palisade.c
    _fields_ = [("id", ctypes.c_uint32)]


class LbBackendValue(ctypes.Structure):
    # struct lb_backend_value in bpf/palisade.c; address and port in network order.
    _fields_ = [
        ("addr", ctypes.c_uint8 * 16),
        ("port", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


C_STRUCTS = ((LbBackendKey, "lb_backend_key"), (LbBackendValue, "lb_backend_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(LbBackendKey), ctypes.sizeof(LbBackendValue), sizes.lb_backends)


class LbBackendMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def write(self, backend_id: int, backend: Backend) -> None:
        value = LbBackendValue(port=socket.htons(backend.port))
        value.family = addresses.put(value.addr, backend.address)
        self.map.update(LbBackendKey(id=backend_id), value)

    def delete(self, backend_id: int) -> bool:
        return self.map.delete(LbBackendKey(id=backend_id))

    def read(self) -> dict[int, Backend]:
        return {
            int(k.id): Backend(addresses.get(v.addr, int(v.family)), socket.ntohs(int(v.port)))
            for k, v in self.map.items(LbBackendKey, LbBackendValue)
        }
