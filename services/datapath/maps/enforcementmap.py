"""Per-endpoint enforcement flags: a hash from endpoint id to the enforced directions.

An endpoint without an entry, or a direction without its bit, is allow-all.

The same value carries lookup hints: with ``HINTS_VALID`` set, one bit per
(direction, verdict, shape) says the endpoint's policy map may hold entries of
that shape, so the program skips the trie lookups that cannot match (a new flow
of an endpoint without deny entries or wildcards walks the trie once, not up to
eight times). Shapes: 0 (identity, protocol), 1 (identity, any protocol),
2 (any identity, protocol), 3 (any identity, any protocol). Hints may claim
more than the map holds, never less.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import IDENTITY_ANY, Direction, Enforcement, L4Proto, Verdict

NAME = "enforcement"
#: Enforced directions (ENFORCE_* in the program).
ENFORCE_INGRESS = 1
ENFORCE_EGRESS = 2
#: The direction is default deny only by policies in audit mode (see types.Enforcement).
AUDIT_INGRESS = 4
AUDIT_EGRESS = 8
ENFORCE_MASK = ENFORCE_INGRESS | ENFORCE_EGRESS | AUDIT_INGRESS | AUDIT_EGRESS
#: A hint: the endpoint's map may hold entries of audited policies (AUDIT and AUDIT_ALLOW keys);
#: without it the program makes no audit lookup.
AUDIT_ENTRIES = 16
#: Where the hint bits start (HINTS_* in the program).
HINTS_SHIFT = 8
#: Hint bits per (direction, verdict) group: one per shape.
HINTS_GROUP_BITS = 4
#: A group's index: this added for egress, this for allow (ingress deny is group 0).
HINTS_GROUP_EGRESS = 2
HINTS_GROUP_ALLOW = 1
#: A shape's index: this added for any identity, this for any protocol.
HINTS_SHAPE_ANY_IDENTITY = 2
HINTS_SHAPE_ANY_PROTOCOL = 1
HINTS_MASK = ((1 << (4 * HINTS_GROUP_BITS)) - 1) << HINTS_SHIFT | AUDIT_ENTRIES
#: The hint bits are set (an agent before hints left none: every lookup runs).
HINTS_VALID = 1 << 31


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
    return (
        (ENFORCE_INGRESS if enforcement.ingress else 0)
        | (ENFORCE_EGRESS if enforcement.egress else 0)
        | (AUDIT_INGRESS if enforcement.audit_ingress else 0)
        | (AUDIT_EGRESS if enforcement.audit_egress else 0)
    )


def from_flags(flags: int) -> Enforcement:
    return Enforcement(
        ingress=bool(flags & ENFORCE_INGRESS),
        egress=bool(flags & ENFORCE_EGRESS),
        audit_ingress=bool(flags & AUDIT_INGRESS),
        audit_egress=bool(flags & AUDIT_EGRESS),
    )


def hints_held(flags: int | None) -> int:
    """The hint bits of flags as the kernel holds them (none unless marked valid)."""
    return flags & HINTS_MASK if flags is not None and flags & HINTS_VALID else 0


def hint_bit(direction: Direction, verdict: Verdict, identity: int, protocol: L4Proto) -> int:
    """The hint bit of one policy entry (or trie prefix) of an endpoint (``HINTS_SHIFT`` applied)."""
    if verdict.audit:
        return AUDIT_ENTRIES
    group = (HINTS_GROUP_EGRESS if direction == Direction.EGRESS else 0) + (
        HINTS_GROUP_ALLOW if verdict == Verdict.ALLOW else 0
    )
    shape = (HINTS_SHAPE_ANY_IDENTITY if identity == IDENTITY_ANY else 0) + (
        HINTS_SHAPE_ANY_PROTOCOL if protocol == L4Proto.ANY else 0
    )
    return 1 << (HINTS_SHIFT + group * HINTS_GROUP_BITS + shape)


def hints(entries: Iterable[tuple[Direction, Verdict, int, L4Proto]]) -> int:
    """The hint bits of (direction, verdict, identity, protocol) groups: what lookups may match."""
    bits = 0
    for group in set(entries):
        bits |= hint_bit(*group)
    return bits


class EnforcementMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def flags(self, ep_id: int) -> int | None:
        """The endpoint's flags as the kernel holds them (hints included); None without an entry."""
        value = self.map.lookup(EnforcementKey(ep_id=ep_id), EnforcementValue)
        return None if value is None else int(value.flags)

    def lookup(self, ep_id: int) -> Enforcement | None:
        flags = self.flags(ep_id)
        return None if flags is None else from_flags(flags)

    def get(self, ep_id: int) -> Enforcement:
        """The endpoint's enforcement; none recorded means allow-all both ways."""
        return self.lookup(ep_id) or Enforcement()

    def set(self, ep_id: int, enforcement: Enforcement, hint_bits: int) -> None:
        flags = to_flags(enforcement) | hint_bits | HINTS_VALID
        self.map.update(EnforcementKey(ep_id=ep_id), EnforcementValue(flags=flags))

    def raw(self) -> dict[int, int]:
        """Every endpoint's flags as the kernel holds them (hints included)."""
        return {int(k.ep_id): int(v.flags) for k, v in self.map.items(EnforcementKey, EnforcementValue)}

    def delete(self, ep_id: int) -> None:
        self.map.delete(EnforcementKey(ep_id=ep_id))

    def dump(self) -> dict[int, Enforcement]:
        return {ep_id: from_flags(flags) for ep_id, flags in self.raw().items()}
