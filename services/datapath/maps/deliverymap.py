"""The delivery map: where a packet to a local pod's address can be put directly.

Key: ``{family, address}`` of a pod on this node. Value: the host veth it is
delivered through, the Ethernet addresses the host's forwarding would give the
packet (the pod's, as destination; the host veth's, as source) and the
generation of the programs attached there. ``from_container`` looks a passed
packet's destination up here and, on a hit, tail-calls ``deliver`` (the
destination's ingress policy, then ``bpf_redirect_peer``; see bpf/palisade.c).

The agent writes an address's entry after the endpoint's programs are attached,
and only when it knows the pod's Ethernet address (the host's neighbour entry on
the veth, which Palisade's own veths always have), and removes it before the
endpoint goes. An address without an entry is reached through the host.

``generation``: a program delivers only to a veth running its own generation
(``EP_GENERATION`` in the C source, passed by the loader from :data:`GENERATION`):
``deliver`` runs the destination's ingress half with its own program's maps,
so a destination still running an older agent's programs must be reached
through the host, where those programs run. Bump it with any change to the
layout of a map the ingress half uses.
"""

from __future__ import annotations

import ctypes
import dataclasses

from services.datapath.maps import addresses
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "delivery"
#: The generation of this agent's programs.
GENERATION = 1


class DeliveryKey(ctypes.Structure):
    # struct delivery_key in bpf/palisade.c; addr in network order, IPv4 in the first 4 bytes.
    _fields_ = [
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
        ("addr", ctypes.c_uint8 * 16),
    ]


class DeliveryValue(ctypes.Structure):
    # struct delivery_value in bpf/palisade.c
    _fields_ = [
        ("ifindex", ctypes.c_uint32),
        ("generation", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("dmac", ctypes.c_uint8 * 6),
        ("smac", ctypes.c_uint8 * 6),
        ("pad2", ctypes.c_uint16),
    ]


C_STRUCTS = ((DeliveryKey, "delivery_key"), (DeliveryValue, "delivery_value"))


def spec(sizes: MapSizes) -> MapSpec:
    # An entry per pod address: no more than the endpoints map's keys.
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(DeliveryKey), ctypes.sizeof(DeliveryValue), sizes.endpoints)


def key_of(ip: str) -> DeliveryKey:
    key = DeliveryKey()
    key.family = addresses.put(key.addr, ip)
    return key


def _mac_bytes(mac: str) -> bytes:
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(f"Ethernet address {mac!r} is not 6 bytes")
    return raw


def _mac_text(raw: ctypes.Array[ctypes.c_uint8]) -> str:
    return ":".join(f"{b:02x}" for b in bytes(raw))


@dataclasses.dataclass(frozen=True)
class DeliveryTarget:
    """A pod address delivered to directly, as the map holds it."""

    ip: str
    ifindex: int
    #: The pod's Ethernet address (the packet's destination) and the host veth's (its source).
    pod_mac: str
    host_mac: str
    generation: int = GENERATION


class DeliveryMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def write(self, target: DeliveryTarget) -> None:
        value = DeliveryValue(ifindex=target.ifindex, generation=target.generation)
        ctypes.memmove(value.dmac, _mac_bytes(target.pod_mac), 6)
        ctypes.memmove(value.smac, _mac_bytes(target.host_mac), 6)
        self.map.update(key_of(target.ip), value)

    def remove(self, ip: str, ifindex: int) -> None:
        """Remove ``ip``'s entry if it delivers through ``ifindex`` (the address may be another
        endpoint's by now: a recycled pod IP)."""
        key = key_of(ip)
        current = self.map.lookup(key, DeliveryValue)
        if current is not None and current.ifindex == ifindex:
            self.map.delete(key)

    def targets(self) -> list[DeliveryTarget]:
        out = []
        for key, value in self.map.items(DeliveryKey, DeliveryValue):
            ip = addresses.get(key.addr, int(key.family))
            out.append(
                DeliveryTarget(ip, int(value.ifindex), _mac_text(value.dmac), _mac_text(value.smac), value.generation)
            )
        return sorted(out, key=lambda t: (t.ifindex, t.ip))
