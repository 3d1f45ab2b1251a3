"""The endpoints map: local endpoints by host-veth ifindex and by pod address.

One hash holds two kinds of keys: ``{ifindex, 0, 0}`` (the program finds the
endpoint it runs for from ``skb->ifindex``) and ``{0, family, address}`` (the
program resolves a local peer's identity before consulting the ipcache). Both
carry the same value, so a relabel rewrites every key of the endpoint.
"""

from __future__ import annotations

import ctypes
import dataclasses

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "endpoints"


class EndpointKey(ctypes.Structure):
    # struct endpoint_key in bpf/palisade.c; addr in network order, IPv4 in the first 4 bytes.
    _fields_ = [
        ("ifindex", ctypes.c_uint32),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
        ("addr", ctypes.c_uint8 * 16),
    ]


class EndpointValue(ctypes.Structure):
    # struct endpoint_value in bpf/palisade.c
    _fields_ = [
        ("ep_id", ctypes.c_uint32),
        ("identity", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


C_STRUCTS = ((EndpointKey, "endpoint_key"), (EndpointValue, "endpoint_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(EndpointKey), ctypes.sizeof(EndpointValue), sizes.endpoints)


def ifindex_key(ifindex: int) -> EndpointKey:
    return EndpointKey(ifindex=ifindex)


def address_key(ip: str) -> EndpointKey:
    key = EndpointKey()
    key.family = addresses.put(key.addr, ip)
    return key


def key_address(key: EndpointKey) -> str:
    return addresses.get(key.addr, int(key.family))


@dataclasses.dataclass(frozen=True)
class EndpointEntry:
    """An endpoint as the map holds it."""

    id: int
    ifindex: int
    identity: int
    ips: tuple[str, ...]


class EndpointMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def write(self, record: EndpointEntry) -> None:
        """Write the address keys first, then the ifindex key the program starts from."""
        value = EndpointValue(ep_id=record.id, identity=record.identity, ifindex=record.ifindex)
        for ip in record.ips:
            self.map.update(address_key(ip), value)
        self.map.update(ifindex_key(record.ifindex), value)

    def remove(self, record: EndpointEntry) -> None:
        """Remove the ifindex key first so the program stops acting before addresses vanish."""
        self.map.delete(ifindex_key(record.ifindex))
        for ip in record.ips:
            current = self.map.lookup(address_key(ip), EndpointValue)
            # Another endpoint may own the address by now (a recycled pod IP).
            if current is not None and current.ep_id == record.id:
                self.map.delete(address_key(ip))

    def by_ifindex(self, ifindex: int) -> EndpointValue | None:
        return self.map.lookup(ifindex_key(ifindex), EndpointValue)

    def by_address(self, ip: str) -> EndpointValue | None:
        return self.map.lookup(address_key(ip), EndpointValue)

    def records(self) -> list[EndpointEntry]:
        """Every endpoint that has an ifindex key, with the addresses that point at it."""
        by_id: dict[int, tuple[int, int]] = {}
        ips: dict[int, list[str]] = {}
        for key, value in self.map.items(EndpointKey, EndpointValue):
            if key.ifindex:
                by_id[int(value.ep_id)] = (int(key.ifindex), int(value.identity))
            else:
                ips.setdefault(int(value.ep_id), []).append(key_address(key))
        return [
            EndpointEntry(ep_id, ifindex, identity, tuple(sorted(ips.get(ep_id, []))))
            for ep_id, (ifindex, identity) in sorted(by_id.items())
        ]
