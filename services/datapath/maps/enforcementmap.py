"""Per-endpoint enforcement flags: a hash from endpoint id to the enforced directions.

An endpoint without an entry, or a direction without its bit, is allow-all.
"""

from __future__ import annotations

import ctypes

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Enforcement

NAME = "enforcement"
ENFORCE_INGRESS = 1
ENFORCE_EGRESS = 2


class EnforcementKey(ctypes.Structure):
    # struct enforcement_key in bpf/palisade.c
    _fields_ = [("ep_id", ctypes.c_uint32)]


class EnforcementValue(ctypes.Structure):
    # struct enforcement_value in bpf/palisade.c
    _fields_ = [("flags", ctypes.c_uint32)]


C_STRUCTS = ((EnforcementKey, "enforcement_key"), (EnforcementValue, "enforcement_value"))


def spec(sizes: MapSizes) -> MapSpec:
    """One slot per endpoint."""
    return MapSpec(NAME, MapType.HASH, ctypes.sizeof(EnforcementKey), ctypes.sizeof(EnforcementValue), sizes.endpoints)


def to_flags(enforcement: Enforcement) -> int:
    return (ENFORCE_INGRESS if enforcement.ingress else 0) | (ENFORCE_EGRESS if enforcement.egress else 0)


def from_flags(flags: int) -> Enforcement:
    return Enforcement(ingress=bool(flags & ENFORCE_INGRESS), egress=bool(flags & ENFORCE_EGRESS))


class EnforcementMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def lookup(self, ep_id: int) -> Enforcement | None:
        value = self.map.lookup(EnforcementKey(ep_id=ep_id), EnforcementValue)
        return None if value is None else from_flags(int(value.flags))

    def get(self, ep_id: int) -> Enforcement:
        """The endpoint's enforcement; none recorded means allow-all both ways."""
        return self.lookup(ep_id) or Enforcement()

    def set(self, ep_id: int, enforcement: Enforcement) -> None:
        self.map.update(EnforcementKey(ep_id=ep_id), EnforcementValue(flags=to_flags(enforcement)))

    def delete(self, ep_id: int) -> None:
        self.map.delete(EnforcementKey(ep_id=ep_id))

    def dump(self) -> dict[int, Enforcement]:
        return {int(k.ep_id): from_flags(int(v.flags)) for k, v in self.map.items(EnforcementKey, EnforcementValue)}
