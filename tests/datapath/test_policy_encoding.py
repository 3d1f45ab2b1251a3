"""The policy map encoding (pure, no privileges): port ranges as LPM prefixes, dumps, verdicts."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.datapath.loader import (
    C_STRUCTS,
    SOURCE_PATH,
    ProgramConfig,
    expand_includes,
    program_source,
    template_hash,
)
from services.datapath.maps import policymap
from services.datapath.maps.policymap import (
    Prefix,
    decode,
    encode,
    encode_delta,
    evaluate,
    from_key,
    group_of,
    normalize,
    range_to_blocks,
    to_key,
)
from services.datapath.types import (
    Direction,
    Enforcement,
    L4Proto,
    PolicyEntry,
    PolicyKey,
    Reason,
    Verdict,
)

ports = st.integers(min_value=0, max_value=65535)


@st.composite
def port_ranges(draw: st.DrawFn) -> tuple[int, int]:
    a, b = draw(ports), draw(ports)
    return min(a, b), max(a, b)


@given(port_ranges())
def test_blocks_cover_exactly_the_range(bounds: tuple[int, int]) -> None:
    low, high = bounds
    blocks = range_to_blocks(low, high)
    covered: list[int] = []
    for start, bits in blocks:
        size = 1 << (16 - bits)
        assert start % size == 0, "blocks are aligned, as trie prefixes must be"
        covered.extend(range(start, start + size))
    assert covered == list(range(low, high + 1))
    assert len(blocks) <= 2 * 16 - 2


@pytest.mark.parametrize(
    ("low", "high", "count"),
    [(0, 65535, 1), (80, 80, 1), (1024, 2047, 1), (1, 65535, 16), (1, 65534, 30), (8000, 8100, 4)],
)
def test_block_counts(low: int, high: int, count: int) -> None:
    assert len(range_to_blocks(low, high)) == count


@st.composite
def entries(draw: st.DrawFn) -> PolicyEntry:
    proto = draw(st.sampled_from(list(L4Proto)))
    low, high = draw(port_ranges()) if proto.has_ports else (0, 0)
    key = PolicyKey(
        direction=draw(st.sampled_from(list(Direction))),
        remote_identity=draw(st.sampled_from([0, 2, 256, 1001])),
        protocol=proto,
        port_low=low,
        port_high=high if low else 0,
    )
    return PolicyEntry(key, draw(st.sampled_from(list(Verdict))))


def _disjoint_per_group(items: list[PolicyEntry]) -> list[PolicyEntry]:
    """Keep entries whose ranges do not overlap another kept entry of the same group."""
    kept: list[PolicyEntry] = []
    for e in items:
        group = (e.key.direction, e.key.remote_identity, e.key.protocol, e.verdict)
        lo, hi = e.key.port_range
        if all(
            (k.key.direction, k.key.remote_identity, k.key.protocol, k.verdict) != group
            or hi < k.key.port_range[0]
            or lo > k.key.port_range[1]
            for k in kept
        ):
            kept.append(e)
    return kept


@given(st.lists(entries(), max_size=12))
def test_decode_inverts_encode_for_non_overlapping_entries(items: list[PolicyEntry]) -> None:
    items = _disjoint_per_group(normalize(items))
    assert decode(encode(7, items)) == sorted(items)


def test_adjacent_ranges_stay_separate_entries() -> None:
    a = PolicyEntry(PolicyKey(Direction.INGRESS, 5, L4Proto.TCP, 1000, 1999))
    b = PolicyEntry(PolicyKey(Direction.INGRESS, 5, L4Proto.TCP, 2000, 2999))
    assert decode(encode(1, [a, b])) == [a, b]


def reference_verdict(
    items: list[PolicyEntry], enforcement: Enforcement, direction: Direction, identity: int, proto: int, port: int
) -> Verdict:
    """The semantics in plain words: deny beats allow, and holds even where the direction is not
    enforced (which otherwise allows all); 0 identity/ANY protocol/0 port are wildcards. Audit: a
    packet that passes is reported as audit when an audited deny covers it, or when only audited
    policies enforce its direction and no audited allow covers it; audit never drops."""

    def matches(e: PolicyEntry) -> bool:
        k = e.key
        lo, hi = k.port_range
        return (
            k.direction is direction
            and k.remote_identity in (0, identity)
            and k.protocol.number in (0, proto)
            and lo <= port <= hi
        )

    hits = {e.verdict for e in items if matches(e)}
    if Verdict.DENY in hits:
        return Verdict.DENY
    audit = Verdict.AUDIT in hits
    if not enforcement.enforced(direction):
        audit = audit or (enforcement.audited(direction) and Verdict.AUDIT_ALLOW not in hits)
        return Verdict.AUDIT if audit else Verdict.ALLOW
    if Verdict.ALLOW not in hits:
        return Verdict.DENY
    return Verdict.AUDIT if audit else Verdict.ALLOW


@settings(max_examples=200)
@given(
    st.lists(entries(), max_size=10),
    st.sampled_from(list(Direction)),
    st.sampled_from([2, 256, 1001, 4242]),
    st.sampled_from([1, 6, 17, 58, 132]),
    ports,
    st.booleans(),
    st.booleans(),
)
def test_lookup_order_matches_the_reference(
    items: list[PolicyEntry],
    direction: Direction,
    identity: int,
    proto: int,
    port: int,
    enforced: bool,
    audited: bool,
) -> None:
    """The four-lookup LPM order (as in the C program) agrees with the plain semantics, overlaps and
    entries of audited policies included."""
    port = port if proto in (6, 17, 132) else 0
    enforcement = Enforcement(ingress=enforced, egress=enforced, audit_ingress=audited, audit_egress=audited)
    got, reason = evaluate(
        encode(3, items),
        enforcement,
        ep_id=3,
        direction=direction,
        remote_identity=identity,
        protocol=proto,
        port=port,
    )
    assert got is reference_verdict(items, enforcement, direction, identity, proto, port)
    # an audit names the drop it stands for: default deny or an audited deny rule
    assert reason.is_drop == (got in (Verdict.DENY, Verdict.AUDIT))
    if not enforced and got is not Verdict.AUDIT:
        assert reason is (Reason.POLICY_DENY if got is Verdict.DENY else Reason.NOT_ENFORCED)


def test_key_bytes_round_trip_and_port_is_network_order() -> None:
    prefix = Prefix(9, Direction.EGRESS, 1001, L4Proto.UDP, Verdict.DENY, 0x1F00, 8)
    key = to_key(prefix)
    assert key.prefixlen == policymap.FIXED_BITS + 8
    assert bytes(key)[16:18] == b"\x1f\x00"
    assert from_key(key) == prefix


def test_normalize_keeps_one_verdict_per_key_deny_winning() -> None:
    k1 = PolicyKey(Direction.INGRESS, 5, L4Proto.TCP, 80)
    # Both verdicts for one key collapse to deny, which is what the datapath would do anyway.
    assert normalize([PolicyEntry(k1, Verdict.DENY), PolicyEntry(k1, Verdict.ALLOW)]) == [PolicyEntry(k1, Verdict.DENY)]


def apply_delta(
    prefixes: policymap.PrefixMap, writes: policymap.PrefixMap, deletes: list[Prefix]
) -> policymap.PrefixMap:
    out = {**prefixes, **writes}
    for prefix in deletes:
        del out[prefix]
    return out


@settings(max_examples=300)
@given(st.lists(entries(), max_size=10), st.lists(entries(), max_size=10))
def test_a_delta_leaves_the_map_as_a_full_encode_would(before: list[PolicyEntry], after: list[PolicyEntry]) -> None:
    """Whatever entries share port blocks, writing only the delta equals re-encoding the result."""
    old, new = set(normalize(before)), set(normalize(after))
    added, removed = new - old, old - new
    groups = {group_of(e) for e in added | removed}
    keep = [e for e in old & new if group_of(e) in groups]
    writes, deletes = encode_delta(4, added, removed, keep)
    assert apply_delta(encode(4, old), writes, deletes) == encode(4, new)
    # Nothing is written that was already there, nothing deleted that stays.
    full = encode(4, old)
    assert all(full.get(p) != v for p, v in writes.items())
    assert not set(deletes) & set(encode(4, new))


def test_removing_one_of_two_entries_sharing_a_block_keeps_the_block() -> None:
    wide = PolicyEntry(PolicyKey(Direction.INGRESS, 5, L4Proto.TCP, 1000, 2047))
    narrow = PolicyEntry(PolicyKey(Direction.INGRESS, 5, L4Proto.TCP, 1024, 2047))
    shared = Prefix(1, Direction.INGRESS, 5, L4Proto.TCP, Verdict.ALLOW, 1024, 6)
    both = encode(1, [wide, narrow])
    assert both[shared] == (1000, 2047)  # the first in sort order owns it

    # Without naming the other entry (keep), the shared block would go; with it, it changes owner.
    writes, deletes = encode_delta(1, [], [wide], keep=[narrow])
    assert writes == {shared: (1024, 2047)} and shared not in deletes
    assert apply_delta(both, writes, deletes) == encode(1, [narrow])
    writes, deletes = encode_delta(1, [], [narrow], keep=[wide])
    assert (writes, deletes) == ({}, [])  # the block stays with its owner


def test_a_one_entry_delta_encodes_that_entry_only() -> None:
    big = [PolicyEntry(PolicyKey(Direction.INGRESS, 1000 + i, L4Proto.TCP, 1, 65535)) for i in range(500)]
    extra = PolicyEntry(PolicyKey(Direction.INGRESS, 77, L4Proto.UDP, 53))
    writes, deletes = encode_delta(2, [extra], [], keep=big)  # other groups: ignored
    assert writes == encode(2, [extra]) and deletes == []


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(0, 0, (0, 0)), (0, 80, (0, 0)), (80, 0, (80, 80)), (80, 90, (80, 90))],
)
def test_policy_key_normalizes_ports(low: int, high: int, expected: tuple[int, int]) -> None:
    key = PolicyKey(Direction.INGRESS, 1, L4Proto.TCP, low, high)
    assert (key.port_low, key.port_high) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"protocol": L4Proto.ICMP, "port_low": 8},
        {"protocol": L4Proto.TCP, "port_low": 90, "port_high": 80},
        {"protocol": L4Proto.TCP, "port_low": 70000},
        {"remote_identity": -1},
    ],
)
def test_policy_key_rejects_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PolicyKey(Direction.INGRESS, **kwargs)  # type: ignore[arg-type]


def test_program_source_pins_every_shared_struct() -> None:
    source = program_source()
    for struct, name in C_STRUCTS:
        assert f"struct {name} {{" in source, name
        assert f"sizeof(struct {name}) == " in source
        anonymous = getattr(struct, "_anonymous_", ())
        for field in struct._fields_:
            # An anonymous union has no name in C: its members are pinned, at the union's offset.
            kind = field[1]
            members = (
                [m[0] for m in kind._fields_]
                if issubclass(kind, ctypes.Union) and field[0] in anonymous
                else [field[0]]
            )
            for member in members:
                assert f"__builtin_offsetof(struct {name}, {member})" in source, (name, member)


def test_template_hash_follows_source_and_config() -> None:
    source = program_source()
    base = template_hash(source, ProgramConfig().cflags("/sys/fs/bpf/x"))
    assert base == template_hash(source, ProgramConfig().cflags("/sys/fs/bpf/x"))
    others = {
        template_hash(source, ProgramConfig().cflags("/sys/fs/bpf/y")),
        template_hash(source, ProgramConfig(world_identity=9).cflags("/sys/fs/bpf/x")),
        template_hash(source + " ", ProgramConfig().cflags("/sys/fs/bpf/x")),
    }
    assert base not in others and len(others) == 3


def test_program_source_holds_its_local_headers_in_place(tmp_path: Path) -> None:
    # bcc rewrites map calls in its main file only, and the template hash is taken over this text:
    # a header's code must be in it, marked with the header's name and lines for compiler messages.
    source = program_source()
    assert '#line 1 "lb_sctp.h"' in source and "crc32c_port_delta" in source
    assert '#include "lb_sctp.h"' not in source
    main = tmp_path / "main.c"
    main.write_text('#include <linux/bpf.h>\n#include "a.h"\nint x;\n')
    (tmp_path / "a.h").write_text('#include "b.h"\nint a;')
    (tmp_path / "b.h").write_text("int b;\n")
    before = expand_includes(main)
    assert before == (
        '#include <linux/bpf.h>\n#line 1 "a.h"\n#line 1 "b.h"\nint b;\n'
        '#line 2 "a.h"\nint a;\n#line 3 "main.c"\nint x;\n'
    )
    (tmp_path / "b.h").write_text("int b2;\n")
    flags = ProgramConfig().cflags("/sys/fs/bpf/x")
    assert template_hash(expand_includes(main), flags) != template_hash(before, flags)  # a header's change
    (tmp_path / "b.h").write_text('#include "a.h"\n')
    with pytest.raises(ValueError, match="includes itself"):
        expand_includes(main)


def test_every_header_beside_the_program_is_part_of_its_source() -> None:
    # The program is in parts (bpf/*.h); each is put into the source the template hash is taken over.
    # A header the program stopped including, or one added without an include, fails here.
    source = program_source()
    headers = sorted(SOURCE_PATH.parent.glob("*.h"))
    assert len(headers) > 1
    for header in headers:
        assert f'#line 1 "{header.name}"' in source, f"{header.name} is not included by {SOURCE_PATH.name}"
        assert f'#include "{header.name}"' not in source


def test_a_change_to_any_header_changes_the_template_hash(tmp_path: Path) -> None:
    for path in SOURCE_PATH.parent.iterdir():
        if path.suffix in (".c", ".h"):
            shutil.copy(path, tmp_path / path.name)
    main = tmp_path / SOURCE_PATH.name
    flags = ProgramConfig().cflags("/sys/fs/bpf/x")
    base = template_hash(expand_includes(main), flags)
    for header in sorted(tmp_path.glob("*.h")):
        text = header.read_text()
        header.write_text(text + "/* changed */\n")
        assert template_hash(expand_includes(main), flags) != base, f"{header.name} is outside the template hash"
        header.write_text(text)
    assert template_hash(expand_includes(main), flags) == base


def test_every_protocol_number_round_trips() -> None:
    for proto in L4Proto:
        assert L4Proto.from_number(proto.number) is proto
    with pytest.raises(ValueError):
        L4Proto.from_number(47)
