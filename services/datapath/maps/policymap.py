"""The policy map: one LPM trie shared by all endpoints, in the style of Cilium's policymap.

Key bytes, in trie order: endpoint id, remote identity, direction, protocol,
verdict, a zero pad byte (96 fixed bits), then the destination port in network
order (16 bits). A port range becomes the aligned power-of-two blocks that
cover it, one trie prefix each (at most 30 for 16 bits); "all ports" is one
prefix of length 96. Wildcards are stored literally (identity 0, protocol 0)
and the program looks each combination up separately.

The verdict is part of the key so an allow and a deny over the same ports are
two prefixes: neither shadows the other, and the program looks up deny
prefixes first, so deny wins regardless of which is more specific.

The value records the port range of the entry that owns the prefix, so a dump
re-assembles entries exactly, including adjacent ranges. An entry whose every
block is also a block of another entry of the same (endpoint, direction,
identity, protocol, verdict) adds nothing and folds into it in the dump.

A prefix two entries of one group share (``1000-2047`` and ``1024-2047`` both
hold the block ``1024/6``) is owned by the first of them in sort order, as
:func:`encode` writes it. :func:`encode_delta` keeps exactly that when entries
come and go, so a delta leaves the map as a full :func:`encode` of the result
would: removing one of the two keeps the shared prefix, now owned by the other.
"""

from __future__ import annotations

import ctypes
import dataclasses
import socket
from collections.abc import Iterable, Mapping

from services.datapath.maps.bpf import BPF_F_NO_PREALLOC, MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import (
    IDENTITY_ANY,
    MAX_PORT,
    Direction,
    Enforcement,
    L4Proto,
    PolicyEntry,
    PolicyKey,
    Reason,
    Verdict,
)

NAME = "policy"
FIXED_BITS = 96
PORT_BITS = 16
FULL_PREFIX = FIXED_BITS + PORT_BITS


class PolicyMapKey(ctypes.Structure):
    # struct policy_key in bpf/palisade.c; dport is in network order, the rest host order.
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("ep_id", ctypes.c_uint32),
        ("identity", ctypes.c_uint32),
        ("direction", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("verdict", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("dport", ctypes.c_uint16),
        ("pad2", ctypes.c_uint16),
    ]


class PolicyMapValue(ctypes.Structure):
    # struct policy_value in bpf/palisade.c: the owning entry's range (0-0 = all ports).
    _fields_ = [
        ("port_low", ctypes.c_uint16),
        ("port_high", ctypes.c_uint16),
        ("flags", ctypes.c_uint32),
    ]


C_STRUCTS = ((PolicyMapKey, "policy_key"), (PolicyMapValue, "policy_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(
        NAME,
        MapType.LPM_TRIE,
        ctypes.sizeof(PolicyMapKey),
        ctypes.sizeof(PolicyMapValue),
        sizes.policy,
        BPF_F_NO_PREALLOC,
    )


@dataclasses.dataclass(frozen=True, order=True)
class Prefix:
    """One trie entry: a group (endpoint, direction, identity, protocol, verdict) and a port block."""

    ep_id: int
    direction: Direction
    identity: int
    protocol: L4Proto
    verdict: Verdict
    port: int
    #: Leading port bits that must match (0 = any port, 16 = exactly ``port``).
    port_bits: int

    def covers(self, port: int) -> bool:
        shift = PORT_BITS - self.port_bits
        return (port >> shift) == (self.port >> shift)


#: What the map holds for one endpoint: prefix -> owning entry's (port_low, port_high).
PrefixMap = dict[Prefix, tuple[int, int]]


def range_to_blocks(low: int, high: int) -> list[tuple[int, int]]:
    """The minimal aligned blocks ``(start, prefix_bits)`` covering ``low..high``. Pure."""
    if not 0 <= low <= high <= MAX_PORT:
        raise ValueError(f"bad port range {low}-{high}")
    blocks = []
    while low <= high:
        size = (low & -low) if low else MAX_PORT + 1
        while size > high - low + 1:
            size >>= 1
        blocks.append((low, PORT_BITS + 1 - size.bit_length()))
        low += size
    return blocks


def normalize(entries: Iterable[PolicyEntry]) -> list[PolicyEntry]:
    """One verdict per key, deny winning over allow (as it would in the datapath), sorted; entries of
    audited policies likewise among themselves (they have key spaces of their own). Pure."""
    by_key: dict[tuple[PolicyKey, bool], Verdict] = {}
    for entry in entries:
        slot = (entry.key, entry.verdict.audit)
        if by_key.get(slot) not in (Verdict.DENY, Verdict.AUDIT):
            by_key[slot] = entry.verdict
    return sorted(PolicyEntry(k, v) for (k, _), v in by_key.items())


#: Entries whose prefixes can coincide: same direction, remote identity, protocol and verdict.
Group = tuple[Direction, int, L4Proto, Verdict]


def group_of(entry: PolicyEntry) -> Group:
    key = entry.key
    return (key.direction, key.remote_identity, key.protocol, entry.verdict)


def prefixes_of(ep_id: int, entry: PolicyEntry) -> list[Prefix]:
    """The trie prefixes of one entry (one per aligned port block). Pure."""
    key = entry.key
    return [
        Prefix(ep_id, key.direction, key.remote_identity, key.protocol, entry.verdict, port, bits)
        for port, bits in range_to_blocks(*key.port_range)
    ]


def encode(ep_id: int, entries: Iterable[PolicyEntry]) -> PrefixMap:
    """The trie contents for one endpoint's entries. Pure and deterministic."""
    out: PrefixMap = {}
    for entry in sorted(set(entries)):
        for prefix in prefixes_of(ep_id, entry):
            out.setdefault(prefix, (entry.key.port_low, entry.key.port_high))
    return out


def encode_delta(
    ep_id: int, add: Iterable[PolicyEntry], remove: Iterable[PolicyEntry], keep: Iterable[PolicyEntry] = ()
) -> tuple[PrefixMap, list[Prefix]]:
    """The writes and deletes that take the trie from ``encode(keep + remove)`` to ``encode(keep + add)``. Pure.

    Only the prefixes of the added and removed entries are computed, so a one-entry
    change costs that entry's prefixes, whatever the size of the map. ``keep`` are the
    entries present before and after that share a :func:`group_of` with an added or
    removed one (others are ignored): a shared prefix changes owner instead of going
    away, and a prefix whose owner is unchanged is not rewritten.
    """
    add, remove = list(add), list(remove)
    touched = {p for entry in (*add, *remove) for p in prefixes_of(ep_id, entry)}
    groups = {group_of(entry) for entry in (*add, *remove)}
    kept = [entry for entry in keep if group_of(entry) in groups]

    def owners(entries: Iterable[PolicyEntry]) -> PrefixMap:
        out: PrefixMap = {}
        for entry in sorted(set(entries)):
            for prefix in prefixes_of(ep_id, entry):
                if prefix in touched:
                    out.setdefault(prefix, (entry.key.port_low, entry.key.port_high))
        return out

    before, after = owners([*kept, *remove]), owners([*kept, *add])
    writes = {p: owner for p, owner in after.items() if before.get(p) != owner}
    deletes = sorted(p for p in before if p not in after)
    return writes, deletes


def diff(
    current: Mapping[Prefix, tuple[int, int]], desired: Mapping[Prefix, tuple[int, int]]
) -> tuple[PrefixMap, list[Prefix]]:
    """Writes and deletes that turn ``current`` into ``desired`` (a full sync). Pure."""
    writes = {p: v for p, v in desired.items() if current.get(p) != v}
    stale = [p for p in current if p not in desired]
    return writes, stale


def decode(prefixes: Mapping[Prefix, tuple[int, int]]) -> list[PolicyEntry]:
    """Re-assemble entries from trie contents (inverse of :func:`encode`). Pure."""
    entries = {
        PolicyEntry(PolicyKey(p.direction, p.identity, p.protocol, low, high), p.verdict)
        for p, (low, high) in prefixes.items()
    }
    return sorted(entries)


def evaluate(
    prefixes: Mapping[Prefix, tuple[int, int]],
    enforcement: Enforcement,
    *,
    ep_id: int,
    direction: Direction,
    remote_identity: int,
    protocol: int,
    port: int,
) -> tuple[Verdict, Reason]:
    """The verdict the program reaches for a new flow, computed in Python. Pure.

    Lookup order (bpf/palisade.c ``policy_verdict``): deny prefixes for
    (identity, proto), (identity, any), (any, proto), (any, any) — any hit drops,
    enforced or not; then an unenforced direction allows; then the same four
    for allow — any hit passes; else default deny. ``port`` is 0 for protocols
    without ports.
    """
    combos = ((remote_identity, protocol), (remote_identity, 0), (IDENTITY_ANY, protocol), (IDENTITY_ANY, 0))

    def match(verdict: Verdict) -> bool:
        return any(
            p.ep_id == ep_id
            and p.direction is direction
            and p.verdict is verdict
            and p.identity == identity
            and p.protocol.number == proto
            and p.covers(port)
            for identity, proto in combos
            for p in prefixes
        )

    # Audit: what an enforced policy drops stays dropped; what passes is reported as audit when an
    # audited policy's deny matches, or its default deny (audit-only direction) finds no audit allow.
    if match(Verdict.DENY):
        return Verdict.DENY, Reason.POLICY_DENY
    audit = Reason.POLICY_DENY if match(Verdict.AUDIT) else None
    if not enforcement.enforced(direction):
        if audit is None and enforcement.audited(direction) and not match(Verdict.AUDIT_ALLOW):
            audit = Reason.DEFAULT_DENY
        return (Verdict.AUDIT, audit) if audit is not None else (Verdict.ALLOW, Reason.NOT_ENFORCED)
    if match(Verdict.ALLOW):
        return (Verdict.AUDIT, audit) if audit is not None else (Verdict.ALLOW, Reason.POLICY_ALLOW)
    return Verdict.DENY, Reason.DEFAULT_DENY


def to_key(prefix: Prefix) -> PolicyMapKey:
    return PolicyMapKey(
        prefixlen=FIXED_BITS + prefix.port_bits,
        ep_id=prefix.ep_id,
        identity=prefix.identity,
        direction=prefix.direction.wire,
        protocol=prefix.protocol.number,
        verdict=prefix.verdict.wire,
        dport=socket.htons(prefix.port),
    )


def from_key(key: PolicyMapKey) -> Prefix:
    bits = int(key.prefixlen) - FIXED_BITS
    mask = (0xFFFF << (PORT_BITS - bits)) & 0xFFFF
    return Prefix(
        ep_id=int(key.ep_id),
        direction=Direction.from_wire(int(key.direction)),
        identity=int(key.identity),
        protocol=L4Proto.from_number(int(key.protocol)),
        verdict=Verdict.from_wire(int(key.verdict)),
        port=socket.ntohs(int(key.dport)) & mask,
        port_bits=bits,
    )


class PolicyMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def write(self, prefixes: Mapping[Prefix, tuple[int, int]]) -> None:
        for prefix, (low, high) in prefixes.items():
            self.map.update(to_key(prefix), PolicyMapValue(port_low=low, port_high=high))

    def delete(self, prefixes: Iterable[Prefix]) -> None:
        for prefix in prefixes:
            self.map.delete(to_key(prefix))

    def read(self, ep_id: int | None = None) -> dict[int, PrefixMap]:
        """The kernel's prefixes per endpoint (one endpoint, or all): a walk of the whole trie."""
        out: dict[int, PrefixMap] = {}
        for key in list(self.map.keys(PolicyMapKey)):
            if ep_id is not None and key.ep_id != ep_id:
                continue
            value = self.map.lookup(key, PolicyMapValue)
            if value is None:
                continue
            prefix = from_key(key)
            out.setdefault(prefix.ep_id, {})[prefix] = (int(value.port_low), int(value.port_high))
        return out
