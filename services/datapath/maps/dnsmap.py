"""DNS steering: which endpoints' DNS traffic goes to the node's DNS proxy (bpf/dns.h).

Key: (endpoint, destination port, protocol) of a DNS rule; value: the proxy's port. A packet
``from_container`` passed whose key is here is handed to the proxy's socket (bpf_sk_assign) and
marked :data:`PROXY_MARK`, which the node's routing delivers locally (:mod:`dnsrouting`). The proxy
owns the entries; they stay pinned while it restarts, and a packet that finds no proxy socket then
is dropped (the client retries) rather than sent past the proxy.
"""

from __future__ import annotations

import ctypes

from services.common import fqdn
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "dns_steering"

#: The only destination port the program hands to dns_steer (a pre-check in handle(): the full
#: steering inline would pass the verifier's complexity limit in from_container).
DNS_PORT = fqdn.DNS_PORT
#: skb->mark of a steered packet; the node's policy routing delivers it to the local stack.
PROXY_MARK = 0x0A00
#: The bits of the mark Palisade owns.
PROXY_MARK_MASK = 0x0F00


class DnsSteerKey(ctypes.Structure):
    # struct dns_steer_key in bpf/dns.h; port in host order
    _fields_ = [
        ("ep_id", ctypes.c_uint32),
        ("port", ctypes.c_uint16),
        ("protocol", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class DnsSteerValue(ctypes.Structure):
    # struct dns_steer_value in bpf/dns.h; proxy_port in host order
    _fields_ = [
        ("proxy_port", ctypes.c_uint16),
        ("pad", ctypes.c_uint16),
    ]


C_STRUCTS = ((DnsSteerKey, "dns_steer_key"), (DnsSteerValue, "dns_steer_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(DnsSteerKey), ctypes.sizeof(DnsSteerValue), sizes.dns_steer)


class DnsSteerMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def set(self, ep_id: int, port: int, protocol: int, proxy_port: int) -> None:
        self.map.update(DnsSteerKey(ep_id=ep_id, port=port, protocol=protocol), DnsSteerValue(proxy_port=proxy_port))

    def delete(self, ep_id: int, port: int, protocol: int) -> bool:
        return self.map.delete(DnsSteerKey(ep_id=ep_id, port=port, protocol=protocol))

    def dump(self) -> dict[tuple[int, int, int], int]:
        """(endpoint, port, protocol) -> proxy port."""
        return {
            (int(k.ep_id), int(k.port), int(k.protocol)): int(v.proxy_port)
            for k, v in self.map.items(DnsSteerKey, DnsSteerValue)
        }
