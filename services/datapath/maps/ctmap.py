"""Connection tracking: an LRU hash of flows seen per endpoint.

An entry is keyed by the flow's first packet as seen at one endpoint's veth
(addresses, ports, protocol, family), the endpoint and the direction the
connection was opened in. Replies are found by looking up the reversed tuple
with the opposite direction. The value keeps the policy epoch of the entry's
last verdict (see ``statemap``) and when it expires (monotonic ns).
"""

from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import socket
import time

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Direction

NAME = "conntrack"
FAMILY_V4 = 4


class CtKey(ctypes.Structure):
    # struct ct_key in bpf/palisade.c; addresses and ports in network order.
    _fields_ = [
        ("saddr", ctypes.c_uint8 * 16),
        ("daddr", ctypes.c_uint8 * 16),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("ep_id", ctypes.c_uint32),
        ("family", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("direction", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class CtValue(ctypes.Structure):
    # struct ct_value in bpf/palisade.c
    _fields_ = [
        ("expires_ns", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("remote_identity", ctypes.c_uint32),
        ("closing", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("rev_nat", ctypes.c_uint16),
    ]


C_STRUCTS = ((CtKey, "ct_key"), (CtValue, "ct_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.LRU_HASH, ctypes.sizeof(CtKey), ctypes.sizeof(CtValue), sizes.conntrack)


@dataclasses.dataclass(frozen=True)
class CtEntry:
    ep_id: int
    #: The direction the connection was opened in, seen from the endpoint.
    direction: Direction
    protocol: int
    source_ip: str
    destination_ip: str
    source_port: int
    destination_port: int
    expires_ns: int
    epoch: int
    remote_identity: int
    closing: bool
    #: The service (reverse NAT id) the connection was opened to; 0 for none.
    service_id: int = 0


def _addr(raw: ctypes.Array[ctypes.c_uint8], family: int) -> str:
    return str(ipaddress.ip_address(bytes(raw[: 4 if family == FAMILY_V4 else 16])))


def to_entry(key: CtKey, value: CtValue) -> CtEntry:
    return CtEntry(
        ep_id=int(key.ep_id),
        direction=Direction.from_wire(int(key.direction)),
        protocol=int(key.protocol),
        source_ip=_addr(key.saddr, int(key.family)),
        destination_ip=_addr(key.daddr, int(key.family)),
        source_port=socket.ntohs(int(key.sport)),
        destination_port=socket.ntohs(int(key.dport)),
        expires_ns=int(value.expires_ns),
        epoch=int(value.epoch),
        remote_identity=int(value.remote_identity),
        closing=bool(value.closing),
        service_id=int(value.rev_nat),
    )


class CtMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def entries(self, ep_id: int | None = None) -> list[CtEntry]:
        return [to_entry(k, v) for k, v in self.map.items(CtKey, CtValue) if ep_id is None or int(k.ep_id) == ep_id]

    def flush(self, ep_id: int | None = None) -> int:
        """Delete every entry (of one endpoint); established flows are then checked as new."""
        count = 0
        for key in list(self.map.keys(CtKey)):
            if ep_id is None or int(key.ep_id) == ep_id:
                count += self.map.delete(key)
        return count

    def gc(self, now_ns: int | None = None) -> int:
        """Delete expired entries (the LRU also evicts under pressure)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        count = 0
        for key, value in list(self.map.items(CtKey, CtValue)):
            if int(value.expires_ns) < now:
                count += self.map.delete(key)
        return count
