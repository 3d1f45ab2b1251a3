"""The ipcache: an LPM trie from IPv4/IPv6 prefix to security identity.

Both families share one trie: a family byte (and padding) precede the address,
so the trie prefix length is 32 + the address prefix length. The program looks
up the remote address of a packet that is not a local endpoint's; addresses
found nowhere get the world identity.
"""

from __future__ import annotations

import ctypes
import ipaddress

from services.datapath.maps import addresses
from services.datapath.maps.bpf import BPF_F_NO_PREALLOC, MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "ipcache"
#: Bits of the key before the address (family + padding).
HEADER_BITS = 32

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class IPCacheKey(ctypes.Structure):
    # struct ipcache_key in bpf/palisade.c; addr is in network order, IPv4 in the first 4 bytes.
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
        ("addr", ctypes.c_uint8 * 16),
    ]


class IPCacheValue(ctypes.Structure):
    # struct ipcache_value in bpf/palisade.c
    _fields_ = [
        ("identity", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
    ]


C_STRUCTS = ((IPCacheKey, "ipcache_key"), (IPCacheValue, "ipcache_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(
        NAME,
        MapType.LPM_TRIE,
        ctypes.sizeof(IPCacheKey),
        ctypes.sizeof(IPCacheValue),
        sizes.ipcache,
        BPF_F_NO_PREALLOC,
    )


def parse_prefix(prefix: str) -> Network:
    """A prefix or a bare address (a host prefix); host bits must be zero."""
    return ipaddress.ip_network(prefix, strict=True)


def make_key(network: Network) -> IPCacheKey:
    key = IPCacheKey()
    key.prefixlen = HEADER_BITS + network.prefixlen
    key.family = addresses.put(key.addr, str(network.network_address))
    return key


def parse_key(key: IPCacheKey) -> Network:
    addr = addresses.get(key.addr, int(key.family))
    return ipaddress.ip_network(f"{addr}/{key.prefixlen - HEADER_BITS}")


class IPCacheMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def upsert(self, prefix: str, identity: int) -> None:
        self.map.update(make_key(parse_prefix(prefix)), IPCacheValue(identity=identity))

    def delete(self, prefix: str) -> bool:
        return self.map.delete(make_key(parse_prefix(prefix)))

    def lookup(self, ip: str) -> int | None:
        """The identity of the longest prefix holding ``ip``, as the program sees it."""
        addr = ipaddress.ip_address(ip)
        value = self.map.lookup(make_key(ipaddress.ip_network(addr)), IPCacheValue)
        return None if value is None else int(value.identity)

    def dump(self) -> dict[str, int]:
        return {str(parse_key(k)): int(v.identity) for k, v in self.map.items(IPCacheKey, IPCacheValue)}
