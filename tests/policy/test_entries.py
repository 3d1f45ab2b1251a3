"""Packed entries: codes round-trip, the mapping reads like a dict, runs replace exactly one remote."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.labels import LabelSet
from services.policy.engine.entries import (
    MAX_IDENTITY,
    EntrySet,
    KeySet,
    code,
    decode_key,
    key_code,
    verdict_of,
)
from services.policy.engine.identity import Identity
from services.policy.engine.model import Direction, EntryKey, IpProto, Verdict
from services.policy.engine.policyengine import PolicyEngine

keys = st.builds(
    EntryKey,
    st.sampled_from(list(Direction)),
    st.integers(0, MAX_IDENTITY),
    st.sampled_from(list(IpProto)),
    st.integers(0, 65535),
    st.integers(0, 65535),
)
entry_maps = st.dictionaries(keys, st.sampled_from(list(Verdict)), max_size=40)


@given(keys, st.sampled_from(list(Verdict)))
def test_a_code_decodes_to_its_key_and_verdict(key: EntryKey, verdict: Verdict) -> None:
    c = code(key, verdict)
    assert decode_key(c) == key
    assert verdict_of(c) is verdict
    assert c & ~1 == key_code(key)


@given(keys, keys)
def test_codes_order_by_remote_identity_first(a: EntryKey, b: EntryKey) -> None:
    if a.identity < b.identity:
        assert key_code(a) < key_code(b)


@given(entry_maps)
def test_an_entry_set_reads_like_the_dict_it_packs(entries: dict[EntryKey, Verdict]) -> None:
    packed = EntrySet.of(entries)
    assert len(packed) == len(entries)
    assert set(packed) == set(entries)
    assert dict(packed.items()) == entries
    assert packed == entries and entries == packed
    for key, verdict in entries.items():
        assert key in packed and packed[key] is verdict
    absent = EntryKey(Direction.INGRESS, 1, IpProto.TCP, 1, 1)
    if absent not in entries:
        assert absent not in packed and packed.get(absent) is None
        with pytest.raises(KeyError):
            packed[absent]


@given(entry_maps, st.integers(0, 5), entry_maps)
def test_with_runs_replaces_one_remotes_entries_and_keeps_the_rest(
    entries: dict[EntryKey, Verdict], remote: int, replacement: dict[EntryKey, Verdict]
) -> None:
    new_run = {EntryKey(k.direction, remote, k.protocol, k.port_low, k.port_high): v for k, v in replacement.items()}
    expected = {k: v for k, v in entries.items() if k.identity != remote} | new_run
    got = EntrySet.of(entries).with_runs({remote: sorted(code(k, v) for k, v in new_run.items())})
    assert dict(got.items()) == expected
    assert list(got.codes) == sorted(got.codes)
    low, high = got.run(remote)
    assert {decode_key(c) for c in got.codes[low:high]} == set(new_run)


def test_remote_lists_one_directions_entries_of_one_identity() -> None:
    entries = {
        EntryKey(Direction.INGRESS, 7, IpProto.TCP, 80, 80): Verdict.ALLOW,
        EntryKey(Direction.EGRESS, 7, IpProto.UDP, 53, 53): Verdict.DENY,
        EntryKey(Direction.INGRESS, 8, IpProto.ANY, 0, 0): Verdict.ALLOW,
    }
    packed = EntrySet.of(entries)
    assert packed.remote(Direction.INGRESS, 7) == [(EntryKey(Direction.INGRESS, 7, IpProto.TCP, 80, 80), Verdict.ALLOW)]
    assert packed.remote(Direction.EGRESS, 7) == [(EntryKey(Direction.EGRESS, 7, IpProto.UDP, 53, 53), Verdict.DENY)]
    assert packed.remote(Direction.EGRESS, 8) == []


def test_a_key_set_holds_exactly_its_keys() -> None:
    a = EntryKey(Direction.INGRESS, 3, IpProto.TCP, 443, 443)
    b = EntryKey(Direction.EGRESS, 2, IpProto.ANY, 0, 0)
    removed = KeySet([key_code(a), key_code(b)])
    assert set(removed) == {a, b} and a in removed and b in removed
    assert EntryKey(Direction.INGRESS, 3, IpProto.TCP, 80, 80) not in removed
    assert len(removed) == 2


def test_an_identity_the_codes_cannot_hold_is_refused_with_the_limit() -> None:
    engine = PolicyEngine()
    too_big = Identity(MAX_IDENTITY + 1, LabelSet(()))
    with pytest.raises(ValueError, match=str(MAX_IDENTITY)):
        engine.upsert_identity(too_big)
    assert MAX_IDENTITY + 1 not in engine.identities()
