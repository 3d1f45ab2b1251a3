"""Encoding orders: whole, chunked within the size limit, or left for the datapath to fetch."""

from __future__ import annotations

import dataclasses

import pytest

from palisade.v1 import common_pb2
from services.policy import wire
from services.policy.engine.model import Direction, EntryKey, IpProto, Verdict
from services.policy.engine.orders import OrderDiff, PlannedOrder
from services.policy.wire import DiffProtos, diff_to_proto, encode


def diff(identity: int, entries: int) -> OrderDiff:
    added = {
        EntryKey(Direction.INGRESS, 70000 + port, IpProto.TCP, port, port): Verdict.ALLOW
        for port in range(1, entries + 1)
    }
    return OrderDiff(identity, ingress_enforced=True, egress_enforced=False, add=added)


def order(*diffs: OrderDiff, removed: tuple[int, ...] = ()) -> PlannedOrder:
    return PlannedOrder("n1", sequence=9, revision=33, diffs=diffs, removed=removed, caused_at=12.5)


def test_small_order_is_sent_whole() -> None:
    (msg,) = encode(order(diff(256, 3), removed=(300,)), max_bytes=4096, max_chunks=4)
    assert (msg.node, msg.sequence, msg.revision, msg.chunks, msg.fetch) == ("n1", 9, 33, 0, False)
    assert [d.identity for d in msg.diffs] == [256]
    assert list(msg.removed_identities) == [300]
    assert msg.caused_at.ToNanoseconds() == 12_500_000_000


@pytest.mark.parametrize("max_bytes", [1500, 2500, 4000])
def test_large_order_is_chunked_within_the_limit_without_splitting_an_identity(max_bytes: int) -> None:
    diffs = tuple(diff(256 + i, 20) for i in range(12))
    messages = encode(order(*diffs, removed=(999,)), max_bytes=max_bytes, max_chunks=100)
    assert len(messages) > 1
    assert all(m.ByteSize() <= max_bytes for m in messages)
    assert [m.chunk for m in messages] == list(range(len(messages)))
    assert {(m.sequence, m.revision, m.chunks) for m in messages} == {(9, 33, len(messages))}
    assert [d for m in messages for d in m.diffs] == [diff_to_proto(d) for d in diffs]
    assert [list(m.removed_identities) for m in messages] == [[999]] + [[]] * (len(messages) - 1)


def test_too_many_chunks_means_fetch() -> None:
    diffs = tuple(diff(256 + i, 20) for i in range(12))
    (msg,) = encode(order(*diffs), max_bytes=1500, max_chunks=2)
    assert msg.fetch and not msg.diffs and (msg.sequence, msg.revision) == (9, 33)


def test_one_identity_larger_than_the_limit_means_fetch() -> None:
    (msg,) = encode(order(diff(256, 2), diff(257, 400)), max_bytes=2048, max_chunks=100)
    assert msg.fetch and not msg.diffs


def test_a_diff_is_encoded_as_its_entries_sorted_with_its_enforcement() -> None:
    (msg,) = encode(order(diff(256, 2)), max_bytes=4096, max_chunks=4)
    (encoded,) = msg.diffs
    assert encoded.enforcement == common_pb2.Enforcement(ingress=True, egress=False) and not encoded.full
    assert [(e.key.remote_identity, e.key.protocol, e.key.port_low, e.verdict) for e in encoded.add] == [
        (70001, common_pb2.PROTOCOL_TCP, 1, common_pb2.VERDICT_ALLOW),
        (70002, common_pb2.PROTOCOL_TCP, 2, common_pb2.VERDICT_ALLOW),
    ]


def test_diffs_that_differ_only_in_identity_are_converted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subjects sharing one rule set share their diff's entries: a cluster-wide change converts
    them once, and each identity still gets exactly its own diff's protobuf."""
    shared = diff(256, 3)
    same = [dataclasses.replace(shared, identity=i) for i in range(257, 261)]
    other_flags = dataclasses.replace(shared, identity=261, egress_enforced=True)
    other_entries = diff(262, 3)  # equal entries, another object: converted on its own
    conversions: list[int] = []

    def counting(d: OrderDiff) -> common_pb2.IdentityPolicyDiff:
        conversions.append(d.identity)
        return diff_to_proto(d)

    monkeypatch.setattr(wire, "diff_to_proto", counting)
    protos = DiffProtos()
    everything = (shared, *same, other_flags, other_entries)
    first = encode(order(*everything), max_bytes=1 << 20, max_chunks=4, converted=protos)
    again = encode(order(*everything[::-1]), max_bytes=1 << 20, max_chunks=4, converted=protos)
    assert conversions == [256, 261, 262]
    assert list(first[0].diffs) == [diff_to_proto(d) for d in everything]
    assert list(again[0].diffs) == [diff_to_proto(d) for d in everything[::-1]]
