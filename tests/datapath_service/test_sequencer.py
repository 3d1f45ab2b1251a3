"""Order sequencing, chunk reassembly, translation and diff application: pure tables.

Orders are built as the bus carries them (protobuf) and translated as the consumer does.
"""

from __future__ import annotations

import pytest

from palisade.v1 import common_pb2, policy_pb2
from services.datapath import types as dt
from services.datapath.errors import OrderError
from services.datapath.orders import Apply, NeedResync, Sequencer, merge_diffs
from services.datapath.realizer import IdentityPolicy
from services.datapath.wire import diff_from_proto, entry_from_proto, entry_to_proto, order_from_proto
from testkit.builders import policy_entry
from testkit.controlplane import EGR, ING


def diff(identity: int, add=(), remove=(), full=False, ingress=True) -> common_pb2.IdentityPolicyDiff:
    return common_pb2.IdentityPolicyDiff(
        identity=identity,
        enforcement=common_pb2.Enforcement(ingress=ingress),
        add=list(add),
        remove=list(remove),
        full=full,
    )


def order(
    seq: int, *diffs: common_pb2.IdentityPolicyDiff, chunk=0, chunks=0, fetch=False, removed=(), replace=False
) -> dt.Order:
    return order_from_proto(
        policy_pb2.RegenerationOrder(
            node="n1",
            sequence=seq,
            revision=100 + seq,
            diffs=list(diffs),
            chunk=chunk,
            chunks=chunks,
            fetch=fetch,
            removed_identities=list(removed),
            replace=replace,
        )
    )


def kinds(actions: list[Apply | NeedResync]) -> list[str]:
    out = []
    for a in actions:
        out.append(f"apply {a.batch.sequence}" if isinstance(a, Apply) else f"resync {a.reason}")
    return out


@pytest.mark.parametrize(
    ("arrivals", "expected"),
    [
        ([1, 2, 3], [["apply 1"], ["apply 2"], ["apply 3"]]),
        ([1, 1, 2], [["apply 1"], [], ["apply 2"]]),  # redelivery is ignored
        ([1, 3], [["apply 1"], ["resync gap"]]),
        ([0], [[]]),  # covered by the resync the sequencer started from
    ],
)
def test_sequence_numbers(arrivals: list[int], expected: list[list[str]]) -> None:
    seq = Sequencer()
    assert seq.resynced(0) == []
    assert [kinds(seq.offer(order(n))) for n in arrivals] == expected


def test_orders_after_a_gap_are_held_and_applied_on_top_of_the_resync() -> None:
    seq = Sequencer()
    seq.resynced(5)
    assert kinds(seq.offer(order(8))) == ["resync gap"]
    assert kinds(seq.offer(order(9))) == ["resync gap"]
    # The resync reflects sequence 7: 8 and 9 still apply, in order.
    assert kinds(seq.resynced(7)) == ["apply 8", "apply 9"]
    assert seq.last == 9


def test_held_orders_older_than_the_resync_are_dropped() -> None:
    seq = Sequencer()
    seq.resynced(1)
    seq.offer(order(3))
    assert kinds(seq.resynced(4)) == []
    assert seq.last == 4


def test_a_gap_remaining_after_the_resync_asks_again() -> None:
    seq = Sequencer()
    seq.resynced(1)
    seq.offer(order(6))
    assert kinds(seq.resynced(3)) == ["resync gap"]


def test_orders_before_the_first_resync_wait_for_it() -> None:
    seq = Sequencer()
    assert seq.offer(order(4)) == []
    assert seq.offer(order(5)) == []
    assert kinds(seq.resynced(4)) == ["apply 5"]


def test_fetch_orders_resync() -> None:
    seq = Sequencer()
    seq.resynced(1)
    actions = seq.offer(order(2, fetch=True))
    assert actions == [NeedResync("fetch", 2)]


def test_chunks_apply_once_complete_in_any_arrival_order() -> None:
    seq = Sequencer()
    seq.resynced(1)
    a = policy_entry(ING, 300, 80)
    b = policy_entry(ING, 301, 443)
    assert seq.offer(order(2, diff(256, add=[b]), chunk=1, chunks=2)) == []
    actions = seq.offer(order(2, diff(256, add=[a], full=True), chunk=0, chunks=2))
    assert kinds(actions) == ["apply 2"]
    assert isinstance(actions[0], Apply)
    (merged,) = actions[0].batch.diffs
    assert merged.full
    assert list(merged.add) == [entry_from_proto(a), entry_from_proto(b)]


def test_a_replace_order_is_the_whole_state_even_after_a_gap() -> None:
    seq = Sequencer()
    seq.resynced(1)
    assert kinds(seq.offer(order(3))) == ["resync gap"]
    # The policy service restarted: its first order replaces everything, so 2 and 3 no longer matter.
    actions = seq.offer(order(5, diff(256, add=[policy_entry(ING, 300, 80)], full=True), replace=True))
    assert kinds(actions) == ["apply 5"]
    assert isinstance(actions[0], Apply) and actions[0].batch.replace
    assert seq.last == 5 and seq.gaps == 1
    assert kinds(seq.offer(order(6))) == ["apply 6"]
    assert kinds(seq.offer(order(4, replace=True))) == []  # older than what is applied

    resync = actions[0].batch.as_resync()
    assert (resync.sequence, resync.revision) == (5, 105)
    assert [(p.identity, p.enforcement.ingress, len(p.entries)) for p in resync.policies] == [(256, True, 1)]


def test_removed_identities_and_replace_survive_chunking() -> None:
    seq = Sequencer()
    seq.resynced(1)
    assert kinds(seq.offer(order(2, diff(256), chunk=1, chunks=2, replace=True))) == []
    actions = seq.offer(order(2, diff(257), chunk=0, chunks=2, removed=[300, 301], replace=True))
    assert isinstance(actions[0], Apply)
    batch = actions[0].batch
    assert (batch.removed, batch.replace, [d.identity for d in batch.diffs]) == ((300, 301), True, [257, 256])
    plain = seq.offer(order(3, removed=[257]))
    assert isinstance(plain[0], Apply) and plain[0].batch.removed == (257,) and not plain[0].batch.replace


def test_merge_diffs_keeps_one_diff_per_identity() -> None:
    parts = [
        diff(256, add=[policy_entry(ING, 1)]),
        diff(257, add=[policy_entry(ING, 2)]),
        diff(256, remove=[policy_entry(ING, 3)]),
    ]
    merged = merge_diffs(diff_from_proto(d) for d in parts)
    assert [d.identity for d in merged] == [256, 257]
    assert len(merged[0].add) == 1 and len(merged[0].remove) == 1


def test_identity_policy_diffs_and_full_replacement() -> None:
    p = IdentityPolicy.empty(256)
    p = p.apply(diff_from_proto(diff(256, add=[policy_entry(ING, 300, 80), policy_entry(ING, 301, 81)])), 1, 10)
    assert {e.key.remote_identity for e in p.entries.values()} == {300, 301}
    p = p.apply(
        diff_from_proto(diff(256, add=[policy_entry(ING, 302, 82)], remove=[policy_entry(ING, 300, 80)])), 2, 11
    )
    assert {e.key.remote_identity for e in p.entries.values()} == {301, 302}
    p = p.apply(
        diff_from_proto(
            diff(256, add=[policy_entry(ING, 303)], remove=[policy_entry(ING, 301, 81)], full=True, ingress=False)
        ),
        3,
        12,
    )
    assert {e.key.remote_identity for e in p.entries.values()} == {303}
    assert p.enforcement == dt.Enforcement(ingress=False, egress=False)
    assert (p.sequence, p.revision) == (3, 12)


@pytest.mark.parametrize("proto", [0, 1, 6, 17, 58, 132])
@pytest.mark.parametrize("verdict", [1, 2])
@pytest.mark.parametrize("direction", [ING, EGR])
def test_entry_round_trip(proto: int, verdict: int, direction: int) -> None:
    port = 8080 if proto in (6, 17, 132) else 0
    pb = policy_entry(direction, 4242, port, proto, verdict)
    if not port:
        pb.key.protocol = proto  # type: ignore[assignment]
    assert entry_to_proto(entry_from_proto(pb)) == pb


def test_bad_entries_are_named() -> None:
    bad = policy_entry(ING, 0, 0)
    bad.key.protocol = 99  # type: ignore[assignment]
    with pytest.raises(OrderError, match="proto=99"):
        entry_from_proto(bad)
    with pytest.raises(OrderError, match="verdict"):
        entry_from_proto(policy_entry(ING, 0, 0, verdict=0))
