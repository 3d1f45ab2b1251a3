"""A subject's policy entries, packed: one sorted array of 64-bit codes.

At scale the engine holds millions of entries (every subject times every remote a
broad rule names, such as ``toEntities: cluster``). As a dict of key objects one
entry costs over 100 bytes and a microsecond to build; packed, 8 bytes and an
integer operation. A *code* is, from the top bit down::

    remote identity (27) | direction (1) | protocol (3) | port_low (16) | port_high (16) | deny (1)

A *key code* is a code with the deny bit clear. The order is identity-major, so
one remote identity's entries are a contiguous run: an identity change replaces
that run without looking at the rest (Cilium keeps its per-endpoint policy map
keyed the same way, identity first).

:class:`EntrySet` is a read-only ``Mapping[EntryKey, Verdict]`` over such an
array: the engine's consumers (wire encoding, lookups, traces, tests) read it as
before, and the engine works on the codes.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import ItemsView, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from services.policy.engine.model import Direction, EntryKey, IpProto, Verdict

IDENTITY_BITS = 27
#: The largest remote identity a code holds (ipam's ranges end at ``(1 << 25) - 1``).
MAX_IDENTITY = (1 << IDENTITY_BITS) - 1

_ID_SHIFT = 37
_DIR_SHIFT = 36
_PROTO_SHIFT = 33
_LOW_SHIFT = 17
_HIGH_SHIFT = 1
DENY_BIT = 1

_PROTOCOLS = (IpProto.ANY, IpProto.ICMP, IpProto.TCP, IpProto.UDP, IpProto.ICMPV6, IpProto.SCTP)
_PROTO_CODE = {p: n for n, p in enumerate(_PROTOCOLS)}
_DIRECTIONS = (Direction.INGRESS, Direction.EGRESS)
_DIR_BIT = {Direction.INGRESS: 0, Direction.EGRESS: 1}


def rule_part(direction: Direction, protocol: IpProto, port_low: int, port_high: int) -> int:
    """A key code without its identity: OR it with :func:`identity_part` of each remote."""
    return (
        _DIR_BIT[direction] << _DIR_SHIFT
        | _PROTO_CODE[protocol] << _PROTO_SHIFT
        | port_low << _LOW_SHIFT
        | port_high << _HIGH_SHIFT
    )


def identity_part(identity: int) -> int:
    return identity << _ID_SHIFT


def key_code(key: EntryKey) -> int:
    return key.identity << _ID_SHIFT | rule_part(key.direction, key.protocol, key.port_low, key.port_high)


def code(key: EntryKey, verdict: Verdict) -> int:
    return key_code(key) | (DENY_BIT if verdict is Verdict.DENY else 0)


def decode_key(c: int) -> EntryKey:
    return EntryKey(
        _DIRECTIONS[c >> _DIR_SHIFT & 1],
        c >> _ID_SHIFT,
        _PROTOCOLS[c >> _PROTO_SHIFT & 7],
        c >> _LOW_SHIFT & 0xFFFF,
        c >> _HIGH_SHIFT & 0xFFFF,
    )


def verdict_of(c: int) -> Verdict:
    return Verdict.DENY if c & DENY_BIT else Verdict.ALLOW


def merge(allow: set[int], deny: set[int]) -> list[int]:
    """Sorted codes from the key codes allowed and denied: deny wins."""
    out = [k | DENY_BIT for k in deny]
    out.extend(allow - deny if deny else allow)
    out.sort()
    return out


def changes(before: Iterable[int], after: Iterable[int]) -> tuple[set[int], list[int]]:
    """From codes ``before`` to codes ``after``: the codes added, and the key codes removed
    (a key whose verdict changed is in both, as a diff applies them: remove, then add)."""
    old, new = set(before), set(after)
    return new - old, [c & ~DENY_BIT for c in old - new]


class EntrySet(Mapping[EntryKey, Verdict]):
    """Entries as a sorted ``array('Q')`` of codes, one per key; immutable once built."""

    __slots__ = ("codes",)

    def __init__(self, codes: array[int] | Iterable[int] = ()) -> None:
        self.codes: array[int] = codes if isinstance(codes, array) else array("Q", codes)

    @classmethod
    def of(cls, entries: Mapping[EntryKey, Verdict]) -> EntrySet:
        """From any mapping (an :class:`EntrySet` is returned as it is)."""
        if isinstance(entries, EntrySet):
            return entries
        return cls(sorted(code(k, v) for k, v in entries.items()))

    @classmethod
    def build(cls, allow: set[int], deny: set[int]) -> EntrySet:
        return cls(array("Q", merge(allow, deny)))

    # --- Mapping ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self) -> Iterator[EntryKey]:
        return map(decode_key, self.codes)

    def __getitem__(self, key: EntryKey) -> Verdict:
        found = self._find(key_code(key)) if isinstance(key, EntryKey) else None
        if found is None:
            raise KeyError(key)
        return verdict_of(found)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, EntryKey) and self._find(key_code(key)) is not None

    def items(self) -> ItemsView[EntryKey, Verdict]:
        return _Items(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EntrySet):
            return self.codes == other.codes
        if isinstance(other, Mapping):
            return len(self) == len(other) and all(other.get(k) is v for k, v in self.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EntrySet({dict(self.items())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (EntrySet, (self.codes,))

    # --- by remote identity ----------------------------------------------------------------

    def run(self, identity: int) -> tuple[int, int]:
        """Index range of ``identity``'s codes."""
        codes = self.codes
        low = bisect_left(codes, identity << _ID_SHIFT)
        return low, bisect_left(codes, (identity + 1) << _ID_SHIFT, low)

    def remote(self, direction: Direction, identity: int) -> list[tuple[EntryKey, Verdict]]:
        """The entries of one direction naming ``identity`` (0: the wildcard entries)."""
        low, high = self.run(identity)
        bit = _DIR_BIT[direction]
        return [(decode_key(c), verdict_of(c)) for c in self.codes[low:high] if c >> _DIR_SHIFT & 1 == bit]

    def with_runs(self, runs: Mapping[int, list[int]]) -> EntrySet:
        """A copy with each identity's run replaced by the given sorted codes (of that identity)."""
        out = self.codes[:]
        # From the highest identity down, so the runs below keep their positions.
        for identity in sorted(runs, reverse=True):
            low, high = self.run(identity)
            out[low:high] = array("Q", runs[identity])
        return EntrySet(out)

    def _find(self, kc: int) -> int | None:
        codes = self.codes
        i = bisect_left(codes, kc)
        if i < len(codes) and codes[i] | DENY_BIT == kc | DENY_BIT:
            return codes[i]
        return None


class _Items(ItemsView[EntryKey, Verdict]):
    _mapping: EntrySet

    def __iter__(self) -> Iterator[tuple[EntryKey, Verdict]]:
        for c in self._mapping.codes:
            yield decode_key(c), verdict_of(c)


class KeySet(AbstractSet[EntryKey]):
    """Entry keys as a sorted ``array('Q')`` of key codes (a diff's removals)."""

    __slots__ = ("codes",)

    def __init__(self, codes: Iterable[int] = ()) -> None:
        self.codes: array[int] = codes if isinstance(codes, array) else array("Q", sorted(codes))

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self) -> Iterator[EntryKey]:
        return map(decode_key, self.codes)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, EntryKey):
            return False
        kc = key_code(key)
        i = bisect_left(self.codes, kc)
        return i < len(self.codes) and self.codes[i] == kc

    def __repr__(self) -> str:
        return f"KeySet({set(self)!r})"
