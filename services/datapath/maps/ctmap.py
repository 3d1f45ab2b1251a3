"""Connection tracking: LRU hashes of flows seen per endpoint, one per family.

An entry is keyed by the flow's first packet as seen at one endpoint's veth
(addresses, ports, protocol), the endpoint and the direction the connection was
opened in. Replies are found by looking up the reversed tuple with the opposite
direction. The value keeps the policy epoch of the entry's last verdict (see
``statemap``) and when it expires (monotonic ns).

IPv6 flows live in this module's map (``conntrack``, a 44-byte key), IPv4 flows
in ``ct4map``'s (``conntrack4``, a 20-byte key: every lookup hashes and compares
the whole key). Programs before the IPv4 map kept both families here;
:meth:`CtMap.migrate` copies such IPv4 entries, so connections outlive the upgrade.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import socket
import time
from collections.abc import Iterator

from services.datapath.maps import addresses
from services.datapath.maps.bpf import BPF_NOEXIST, BpfError, MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Direction

NAME = "conntrack"
#: ct_value.flags (CT_F_* in the program): opened through the host (its replies go back that way).
FLAG_VIA_HOST = 1
#: Left with a source port Palisade gave it (see snatmap).
FLAG_SNAT = 2
#: A pod's connection to itself through a ClusterIP (CT_F_HAIRPIN): keyed as the pod receives it.
FLAG_HAIRPIN = 4


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


class Ct4Key(ctypes.Structure):
    # struct ct4_key in bpf/palisade.c; addresses and ports in network order.
    _fields_ = [
        ("saddr", ctypes.c_uint8 * 4),
        ("daddr", ctypes.c_uint8 * 4),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("ep_id", ctypes.c_uint32),
        ("protocol", ctypes.c_uint8),
        ("direction", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class CtValue(ctypes.Structure):
    # struct ct_value in bpf/palisade.c
    _fields_ = [
        ("expires_ns", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("remote_identity", ctypes.c_uint32),
        ("closing", ctypes.c_uint8),
        # FLAG_* (CT_F_* in the program)
        ("flags", ctypes.c_uint8),
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
    #: The source port is one Palisade gave the connection (another flow held its tuple).
    given_port: bool = False


def to_entry(key: CtKey | Ct4Key, value: CtValue) -> CtEntry:
    family = addresses.FAMILY_V4 if isinstance(key, Ct4Key) else int(key.family)
    return CtEntry(
        ep_id=int(key.ep_id),
        direction=Direction.from_wire(int(key.direction)),
        protocol=int(key.protocol),
        source_ip=addresses.get(key.saddr, family),
        destination_ip=addresses.get(key.daddr, family),
        source_port=socket.ntohs(int(key.sport)),
        destination_port=socket.ntohs(int(key.dport)),
        expires_ns=int(value.expires_ns),
        epoch=int(value.epoch),
        remote_identity=int(value.remote_identity),
        closing=bool(value.closing),
        service_id=int(value.rev_nat),
        given_port=bool(int(value.flags) & FLAG_SNAT),
    )


def to_v4_key(key: CtKey) -> Ct4Key:
    """The IPv4 map's key for an IPv4 entry of the shared layout."""
    return Ct4Key(
        saddr=(ctypes.c_uint8 * 4)(*key.saddr[:4]),
        daddr=(ctypes.c_uint8 * 4)(*key.daddr[:4]),
        sport=key.sport,
        dport=key.dport,
        ep_id=key.ep_id,
        protocol=key.protocol,
        direction=key.direction,
    )


class CtMap:
    """Both families' entries: ``v4`` is ``conntrack4``, ``v6`` is ``conntrack``."""

    def __init__(self, v4: PinnedMap, v6: PinnedMap) -> None:
        self.v4 = v4
        self.v6 = v6

    def _items(self) -> Iterator[tuple[PinnedMap, CtKey | Ct4Key, CtValue]]:
        for k4, v4 in self.v4.items(Ct4Key, CtValue):
            yield self.v4, k4, v4
        for k6, v6 in self.v6.items(CtKey, CtValue):
            yield self.v6, k6, v6

    def entries(self, ep_id: int | None = None) -> list[CtEntry]:
        return [to_entry(k, v) for _, k, v in self._items() if ep_id is None or int(k.ep_id) == ep_id]

    def flush(self, ep_id: int | None = None) -> int:
        """Delete every entry (of one endpoint); established flows are then checked as new."""
        count = 0
        for pinned, key, _ in list(self._items()):
            if ep_id is None or int(key.ep_id) == ep_id:
                count += pinned.delete(key)
        return count

    def gc(self, now_ns: int | None = None) -> int:
        """Delete expired entries (the LRU also evicts under pressure)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        count = 0
        for pinned, key, value in list(self._items()):
            if int(value.expires_ns) < now:
                count += pinned.delete(key)
        return count

    def migrate(self, release: bool) -> int:
        """Copy IPv4 entries from the IPv6 map, where programs before the IPv4 map kept them, into
        the IPv4 map, where the IPv4 map has none for the key yet (one there is newer: the current
        program wrote it); returns how many were copied. ``release`` also removes them from the
        IPv6 map: only once no older program, which reads them there, is attached."""
        copied = 0
        for key, value in list(self.v6.items(CtKey, CtValue)):
            if int(key.family) != addresses.FAMILY_V4:
                continue
            try:
                self.v4.update(to_v4_key(key), value, BPF_NOEXIST)
                copied += 1
            except BpfError as exc:
                if exc.errno != errno.EEXIST:
                    raise
            if release:
                self.v6.delete(key)
        return copied
