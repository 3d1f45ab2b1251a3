"""Encoding orders: whole, chunked within the size limit, or left for the datapath to fetch."""

from __future__ import annotations

import pytest

from palisade.v1 import common_pb2
from services.policy.engine.orders import PlannedOrder, encode


def diff(identity: int, entries: int) -> common_pb2.IdentityPolicyDiff:
    d = common_pb2.IdentityPolicyDiff(identity=identity, enforcement=common_pb2.Enforcement(ingress=True))
    for port in range(1, entries + 1):
        d.add.append(
            common_pb2.PolicyEntry(
                key=common_pb2.PolicyKey(
                    direction=common_pb2.DIRECTION_INGRESS,
                    remote_identity=70000 + port,
                    protocol=common_pb2.PROTOCOL_TCP,
                    port_low=port,
                    port_high=port,
                ),
                verdict=common_pb2.VERDICT_ALLOW,
            )
        )
    return d


def order(*diffs: common_pb2.IdentityPolicyDiff, removed: tuple[int, ...] = ()) -> PlannedOrder:
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
    assert [d for m in messages for d in m.diffs] == list(diffs)
    assert [list(m.removed_identities) for m in messages] == [[999]] + [[]] * (len(messages) - 1)


def test_too_many_chunks_means_fetch() -> None:
    diffs = tuple(diff(256 + i, 20) for i in range(12))
    (msg,) = encode(order(*diffs), max_bytes=1500, max_chunks=2)
    assert msg.fetch and not msg.diffs and (msg.sequence, msg.revision) == (9, 33)


def test_one_identity_larger_than_the_limit_means_fetch() -> None:
    (msg,) = encode(order(diff(256, 2), diff(257, 400)), max_bytes=2048, max_chunks=100)
    assert msg.fetch and not msg.diffs
