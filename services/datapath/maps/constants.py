"""The numbers the program shares with Python, generated into the program's build.

Python is the source. Each number is defined once, beside the code that reads or writes the
field holding it: ``types`` for directions, verdicts and reasons, each map's module for its
flags and slots, ``addresses`` for the family byte. The loader hands every one to the compiler
as a ``-D`` define (:func:`defines`, part of the template hash like every cflag) and appends,
beside the struct layout asserts, one ``_Static_assert`` per number (:func:`asserts`) plus the
:data:`INVARIANTS` the program's code relies on (a mask, a bit field). The program defines none
of them: a definition in ``palisade.c`` or a header it includes that says otherwise, or a
Python value the program's code cannot hold, fails the build.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from services.datapath.maps import (
    addresses,
    ctmap,
    deliverymap,
    dnsmap,
    enforcementmap,
    ipcachemap,
    lbservicemap,
    metricsmap,
    policymap,
    snatmap,
)
from services.datapath.types import IDENTITY_HOST, Direction, Reason, Verdict

_U32 = 0xFFFF_FFFF
_I32 = 0x7FFF_FFFF
#: Numbers held in one-byte fields (directions, verdicts and reasons in keys and events, families,
#: ct_value.flags, snat_key.kind).
_BYTE_FIELDS = ("DIR_", "VERDICT_", "REASON_", "FAMILY_", "CT_F_", "SNAT_FORWARD", "SNAT_REVERSE")


@dataclasses.dataclass(frozen=True)
class Shared:
    """One number as the program names it, with its value and where Python defines it."""

    name: str
    value: int
    #: The Python definition, named in the build error when the program says otherwise.
    origin: str

    def __post_init__(self) -> None:
        if not 0 <= self.value <= _U32:
            raise ValueError(f"{self.name} ({self.origin}) = {self.value}: the program's fields hold 0..{_U32}")

    @property
    def literal(self) -> str:
        """The value as a C literal; unsigned past int's range (as ``1u << 31`` was)."""
        return f"{self.value}U" if self.value > _I32 else str(self.value)


def shared() -> tuple[Shared, ...]:
    """Every number the program shares with the map modules (read when called)."""
    return (
        *(Shared(f"DIR_{d.name}", d.wire, f"types.Direction.{d.name}.wire") for d in Direction),
        *(Shared(f"VERDICT_{v.name}", v.wire, f"types.Verdict.{v.name}.wire") for v in Verdict),
        *(Shared(f"REASON_{r.name}", r.wire, f"types.Reason.{r.name}.wire") for r in Reason),
        Shared("REASON_EVENT_LOST", metricsmap.EVENT_LOST, "metricsmap.EVENT_LOST"),
        Shared("METRICS_DIR_SLOTS", metricsmap.DIRECTION_SLOTS, "metricsmap.DIRECTION_SLOTS"),
        Shared("METRICS_SLOTS", metricsmap.SLOTS, "metricsmap.SLOTS"),
        Shared("METRICS_LOST_SLOT", metricsmap.LOST_SLOT, "metricsmap.LOST_SLOT"),
        Shared("ENFORCE_INGRESS", enforcementmap.ENFORCE_INGRESS, "enforcementmap.ENFORCE_INGRESS"),
        Shared("ENFORCE_EGRESS", enforcementmap.ENFORCE_EGRESS, "enforcementmap.ENFORCE_EGRESS"),
        Shared("AUDIT_INGRESS", enforcementmap.AUDIT_INGRESS, "enforcementmap.AUDIT_INGRESS"),
        Shared("AUDIT_EGRESS", enforcementmap.AUDIT_EGRESS, "enforcementmap.AUDIT_EGRESS"),
        Shared("AUDIT_ENTRIES", enforcementmap.AUDIT_ENTRIES, "enforcementmap.AUDIT_ENTRIES"),
        Shared("HINTS_SHIFT", enforcementmap.HINTS_SHIFT, "enforcementmap.HINTS_SHIFT"),
        Shared("HINTS_GROUP_BITS", enforcementmap.HINTS_GROUP_BITS, "enforcementmap.HINTS_GROUP_BITS"),
        Shared("HINTS_GROUP_EGRESS", enforcementmap.HINTS_GROUP_EGRESS, "enforcementmap.HINTS_GROUP_EGRESS"),
        Shared("HINTS_GROUP_ALLOW", enforcementmap.HINTS_GROUP_ALLOW, "enforcementmap.HINTS_GROUP_ALLOW"),
        Shared(
            "HINTS_SHAPE_ANY_IDENTITY",
            enforcementmap.HINTS_SHAPE_ANY_IDENTITY,
            "enforcementmap.HINTS_SHAPE_ANY_IDENTITY",
        ),
        Shared(
            "HINTS_SHAPE_ANY_PROTOCOL",
            enforcementmap.HINTS_SHAPE_ANY_PROTOCOL,
            "enforcementmap.HINTS_SHAPE_ANY_PROTOCOL",
        ),
        Shared("HINTS_VALID", enforcementmap.HINTS_VALID, "enforcementmap.HINTS_VALID"),
        Shared("FAMILY_V4", addresses.FAMILY_V4, "addresses.FAMILY_V4"),
        Shared("FAMILY_V6", addresses.FAMILY_V6, "addresses.FAMILY_V6"),
        Shared("CT_F_VIA_HOST", ctmap.FLAG_VIA_HOST, "ctmap.FLAG_VIA_HOST"),
        Shared("CT_F_SNAT", ctmap.FLAG_SNAT, "ctmap.FLAG_SNAT"),
        Shared("CT_F_HAIRPIN", ctmap.FLAG_HAIRPIN, "ctmap.FLAG_HAIRPIN"),
        Shared("SNAT_FORWARD", snatmap.FORWARD, "snatmap.FORWARD"),
        Shared("SNAT_REVERSE", snatmap.REVERSE, "snatmap.REVERSE"),
        Shared("SNAT_PORT_MIN", snatmap.PORT_MIN, "snatmap.PORT_MIN"),
        Shared("SNAT_PORT_MAX", snatmap.PORT_MAX, "snatmap.PORT_MAX"),
        Shared("SVC_FLAG_AFFINITY", lbservicemap.FLAG_AFFINITY, "lbservicemap.FLAG_AFFINITY"),
        Shared("IPCACHE_HEADER_BITS", ipcachemap.HEADER_BITS, "ipcachemap.HEADER_BITS"),
        Shared("POLICY_FULL_PREFIX", policymap.FULL_PREFIX, "policymap.FULL_PREFIX"),
        Shared("EP_GENERATION", deliverymap.GENERATION, "deliverymap.GENERATION"),
        Shared("HOST_ID", IDENTITY_HOST, "types.IDENTITY_HOST"),
        Shared("DNS_PORT", dnsmap.DNS_PORT, "dnsmap.DNS_PORT"),
        Shared("DNS_PROXY_MARK", dnsmap.PROXY_MARK, "dnsmap.PROXY_MARK"),
        Shared("DNS_PROXY_MARK_MASK", dnsmap.PROXY_MARK_MASK, "dnsmap.PROXY_MARK_MASK"),
    )


#: What the program's code assumes of the shared numbers, as (C expression, why).
INVARIANTS: tuple[tuple[str, str], ...] = (
    (
        "(METRICS_DIR_SLOTS & (METRICS_DIR_SLOTS - 1)) == 0",
        "METRICS_DIR_SLOTS must be a power of two: count() wraps reasons with a mask",
    ),
    ("METRICS_SLOTS == 2 * METRICS_DIR_SLOTS", "METRICS_SLOTS must hold both directions' slots"),
    ("(CT_F_VIA_HOST | CT_F_SNAT | CT_F_HAIRPIN) <= 0xff", "CT_F_* must fit ct_value.flags (u8)"),
    ("(ENFORCE_INGRESS | ENFORCE_EGRESS) < (1u << HINTS_SHIFT)", "ENFORCE_* must stay below the hint bits"),
    (
        "HINTS_SHIFT + 4 * HINTS_GROUP_BITS <= 31 && HINTS_VALID == (1u << 31)",
        "the four hint groups must sit between ENFORCE_* and HINTS_VALID (bit 31)",
    ),
    ("HINTS_GROUP_BITS == 4", "a hint group has one bit for each of policy_match()'s four lookups"),
    ("(DNS_PROXY_MARK & ~DNS_PROXY_MARK_MASK) == 0", "DNS_PROXY_MARK must lie within DNS_PROXY_MARK_MASK"),
    ("SNAT_PORT_MIN <= SNAT_PORT_MAX && SNAT_PORT_MAX <= 0xffff", "SNAT_PORT_MIN..SNAT_PORT_MAX must be ports"),
)


def defines(constants: Iterable[Shared]) -> list[str]:
    """The compiler flags defining ``constants``."""
    return [f"-D{c.name}={c.literal}" for c in constants]


def asserts(constants: Iterable[Shared]) -> list[str]:
    """C ``_Static_assert`` lines: each constant has its Python value, and the :data:`INVARIANTS` hold."""
    lines = [
        f'_Static_assert({c.name} == {c.literal}, "{c.name}: the program says otherwise than {c.origin} '
        f'({c.value}); define it only in Python");'
        for c in constants
    ]
    lines.extend(
        f'_Static_assert({c.name} <= 0xff, "{c.name} must fit the byte the program keeps it in");'
        for c in constants
        if c.name.startswith(_BYTE_FIELDS)
    )
    lines.extend(f'_Static_assert({expr}, "{why}");' for expr, why in INVARIANTS)
    return lines
