"""Service frontends: a hash from (ClusterIP, port, protocol, slot) to the service or one backend.

Cilium's layout: slot 0 holds the service (its id, which is also its reverse NAT
index, the number of backends, the ClientIP affinity timeout and the revision of its
backend set); slots 1..count
hold the ids of its backends (``lbbackendmap``). The program picks a slot at random
for a new connection. A service with count 0 is rejected at once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import socket
from collections.abc import Iterator

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Frontend, L4Proto

NAME = "lb_services"
FLAG_AFFINITY = 1


class LbServiceKey(ctypes.Structure):
    # struct lb_service_key in bpf/palisade.c; address and port in network order.
    _fields_ = [
        ("addr", ctypes.c_uint8 * 16),
        ("port", ctypes.c_uint16),
        ("slot", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 2),
    ]


class SlotWord(ctypes.Union):
    # The first word of struct lb_service_value (an anonymous union in C, as Cilium's lb4_service):
    # a backend slot's backend id, the service slot's revision (the word no service slot used).
    _fields_ = [("backend_id", ctypes.c_uint32), ("revision", ctypes.c_uint32)]


class LbServiceValue(ctypes.Structure):
    # struct lb_service_value in bpf/palisade.c
    _anonymous_ = ("word",)
    _fields_ = [
        ("word", SlotWord),
        ("count", ctypes.c_uint16),
        ("rev_nat", ctypes.c_uint16),
        ("affinity_s", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


C_STRUCTS = ((LbServiceKey, "lb_service_key"), (LbServiceValue, "lb_service_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(LbServiceKey), ctypes.sizeof(LbServiceValue), sizes.lb_services)


def make_key(frontend: Frontend, slot: int = 0) -> LbServiceKey:
    key = LbServiceKey(slot=slot, protocol=frontend.protocol.number, port=socket.htons(frontend.port))
    key.family = addresses.put(key.addr, frontend.address)
    return key


@dataclasses.dataclass(frozen=True)
class Master:
    """Slot 0: the service itself."""

    id: int
    count: int
    affinity_timeout: int
    #: Changes whenever a backend leaves the service: a connection's entry (``lbctmap``) written at
    #: this revision still has a live backend, so the program rewrites from the entry alone.
    revision: int = 0


class LbServiceMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def write_master(self, frontend: Frontend, master: Master) -> None:
        value = LbServiceValue(
            count=master.count,
            rev_nat=master.id,
            affinity_s=master.affinity_timeout,
            flags=FLAG_AFFINITY if master.affinity_timeout else 0,
            revision=master.revision,
        )
        self.map.update(make_key(frontend), value)

    def write_slot(self, frontend: Frontend, slot: int, backend_id: int) -> None:
        self.map.update(make_key(frontend, slot), LbServiceValue(backend_id=backend_id))

    def delete(self, frontend: Frontend, slot: int = 0) -> bool:
        return self.map.delete(make_key(frontend, slot))

    def read(self) -> Iterator[tuple[Frontend, int, LbServiceValue]]:
        """Every slot as (frontend, slot, value)."""
        for key, value in self.map.items(LbServiceKey, LbServiceValue):
            frontend = Frontend(
                addresses.get(key.addr, int(key.family)),
                socket.ntohs(int(key.port)),
                L4Proto.from_number(int(key.protocol)),
            )
            yield frontend, int(key.slot), value
