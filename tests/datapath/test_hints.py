"""Lookup hints: the program skips the policy lookups an endpoint's entries cannot answer.

Every (direction, verdict, shape) is written incrementally onto an endpoint whose hints
said nothing of it, and must decide traffic at once; a full sync narrows the hints again.
"""

from __future__ import annotations

import pytest

from services.datapath.maps import enforcementmap
from services.datapath.maps.enforcementmap import HINTS_SHIFT, HINTS_VALID, hint_bit, hints
from services.datapath.types import (
    IDENTITY_ANY,
    Direction,
    Enforcement,
    L4Proto,
    Verdict,
)
from testkit.datapathnode import Node
from testkit.traffic import DENY_TIMEOUT, tcp_exchange
from tests.datapath.entries import entry


@pytest.mark.parametrize(
    ("direction", "verdict", "identity", "protocol", "bit"),
    [
        (Direction.INGRESS, Verdict.DENY, 1001, L4Proto.TCP, 0),
        (Direction.INGRESS, Verdict.DENY, 1001, L4Proto.ANY, 1),
        (Direction.INGRESS, Verdict.DENY, IDENTITY_ANY, L4Proto.UDP, 2),
        (Direction.INGRESS, Verdict.DENY, IDENTITY_ANY, L4Proto.ANY, 3),
        (Direction.INGRESS, Verdict.ALLOW, 1001, L4Proto.TCP, 4),
        (Direction.EGRESS, Verdict.DENY, 7, L4Proto.ICMP, 8),
        (Direction.EGRESS, Verdict.ALLOW, IDENTITY_ANY, L4Proto.ANY, 15),
    ],
)
def test_hint_bits(direction: Direction, verdict: Verdict, identity: int, protocol: L4Proto, bit: int) -> None:
    assert hint_bit(direction, verdict, identity, protocol) == 1 << (HINTS_SHIFT + bit)


def test_hints_are_the_union_and_never_touch_the_enforcement_bits() -> None:
    groups = [(Direction.INGRESS, Verdict.ALLOW, 5, L4Proto.TCP)] * 3 + [
        (Direction.EGRESS, Verdict.DENY, 0, L4Proto.ANY)
    ]
    assert hints(groups) == (1 << (HINTS_SHIFT + 4)) | (1 << (HINTS_SHIFT + 11))
    assert hints([]) == 0
    everything = hints(
        (d, v, i, p) for d in Direction for v in Verdict for i in (0, 1) for p in (L4Proto.ANY, L4Proto.TCP)
    )
    assert everything & (enforcementmap.ENFORCE_MASK | HINTS_VALID) == 0
    # 16 shape bits for enforced entries; entries of audited policies have one bit of their own
    assert everything & enforcementmap.AUDIT_ENTRIES
    assert bin(everything).count("1") == 17
    assert hints([(Direction.INGRESS, Verdict.AUDIT_ALLOW, 5, L4Proto.TCP)]) == enforcementmap.AUDIT_ENTRIES


# One case per (direction, verdict, shape) that decides a -> b on TCP 8080: ingress at b, egress at a.
SHAPES = [(identity_any, any_proto) for identity_any in (False, True) for any_proto in (False, True)]


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.parametrize("direction", [Direction.INGRESS, Direction.EGRESS])
@pytest.mark.parametrize("verdict", [Verdict.ALLOW, Verdict.DENY])
@pytest.mark.parametrize(("identity_any", "any_proto"), SHAPES)
def test_an_entry_of_a_shape_the_hints_lacked_decides_at_once(
    net: Node, direction: Direction, verdict: Verdict, identity_any: bool, any_proto: bool
) -> None:
    dp, a, b = net.dp, net.a, net.b
    subject, peer = (b, a) if direction == Direction.INGRESS else (a, b)
    enforcement = Enforcement(ingress=True) if direction == Direction.INGRESS else Enforcement(egress=True)
    # The hints start without the bit: no entry at all (default deny) for the allow cases, an
    # allow-all (no deny entry) for the deny cases.
    base = [entry(direction, IDENTITY_ANY, L4Proto.ANY)] if verdict == Verdict.DENY else []
    other = a if subject is b else b
    dp.sync_policy(other.ep_id, Enforcement(), [])
    try:
        dp.sync_policy(subject.ep_id, enforcement, base)
        before = dp.enforcement.raw()[subject.ep_id]
        assert before & HINTS_VALID
        assert tcp_exchange(a.name, b.v4, 8080, timeout=DENY_TIMEOUT if verdict == Verdict.ALLOW else 5.0) == (
            verdict == Verdict.DENY
        )

        added = entry(
            direction,
            IDENTITY_ANY if identity_any else peer.identity,
            L4Proto.ANY if any_proto else L4Proto.TCP,
            0 if any_proto else 8080,
            deny=verdict == Verdict.DENY,
        )
        bit = hint_bit(direction, verdict, added.key.remote_identity, added.key.protocol)
        assert not before & bit
        dp.apply_policy(subject.ep_id, enforcement, add=[added])
        assert dp.enforcement.raw()[subject.ep_id] & bit
        allowed = verdict == Verdict.ALLOW
        assert tcp_exchange(a.name, b.v4, 8080, timeout=5.0 if allowed else DENY_TIMEOUT) == allowed

        dp.sync_policy(subject.ep_id, enforcement, base)
        assert dp.enforcement.raw()[subject.ep_id] == before, "a full sync narrows the hints again"
    finally:
        for pod in (a, b):
            dp.sync_policy(pod.ep_id, Enforcement(), [])


@pytest.mark.root
@pytest.mark.bcc
def test_open_makes_hints_exact(net: Node) -> None:
    """Hints left wide (an agent stopped between widening and narrowing) or missing (an agent before
    hints) are recomputed from the policy map."""
    dp, a, b = net.dp, net.a, net.b
    policy = [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)]
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), policy)
    exact = dp.enforcement.raw()[b.ep_id]
    assert exact == enforcementmap.ENFORCE_INGRESS | HINTS_VALID | hint_bit(
        Direction.INGRESS, Verdict.ALLOW, a.identity, L4Proto.TCP
    )
    for left in (enforcementmap.ENFORCE_INGRESS, exact | (0xFFFF << HINTS_SHIFT)):
        dp.enforcement.map.update(
            enforcementmap.EnforcementKey(ep_id=b.ep_id), enforcementmap.EnforcementValue(flags=left)
        )
        dp._sync_hints()
        assert dp.enforcement.raw()[b.ep_id] == exact
    assert tcp_exchange(a.name, b.v4, 8080)
    assert not tcp_exchange(a.name, b.v4, 8081, timeout=DENY_TIMEOUT)
    dp.sync_policy(b.ep_id, Enforcement(), [])


@pytest.mark.root
@pytest.mark.bcc
def test_an_incremental_write_keeps_hints_another_writer_added(net: Node, bpf_base: str) -> None:
    """Hints are read from the kernel on every write, not remembered: a second writer of the same
    pins (a restarted agent overlapping the old one) widened them, and they stay wide."""
    from services.datapath.datapath import Datapath

    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    other = Datapath.open(bpf_base)
    try:
        deny = entry(Direction.INGRESS, IDENTITY_ANY, L4Proto.ANY, deny=True)
        other.apply_policy(b.ep_id, Enforcement(ingress=True), add=[deny])
    finally:
        other.close()
    # An entry of a shape the hints lack, so this write sets them.
    dp.apply_policy(b.ep_id, Enforcement(ingress=True), add=[entry(Direction.INGRESS, IDENTITY_ANY, L4Proto.TCP, 8081)])
    assert dp.enforcement.raw()[b.ep_id] & hint_bit(Direction.INGRESS, Verdict.DENY, IDENTITY_ANY, L4Proto.ANY)
    assert not tcp_exchange(a.name, b.v4, 8081, timeout=DENY_TIMEOUT), "the other writer's deny holds"
    dp.sync_policy(b.ep_id, Enforcement(), [])
