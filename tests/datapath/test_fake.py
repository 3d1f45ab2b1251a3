"""The in-memory FakeDatapath (no privileges): same API and verdicts as the kernel datapath."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from services.datapath.datapath import Datapath, DatapathAPI, UnknownEndpoint
from services.datapath.fake import FakeDatapath
from services.datapath.types import (
    Direction,
    EndpointSpec,
    Enforcement,
    L4Proto,
    Reason,
    Verdict,
)
from tests.datapath.entries import entry

A = EndpointSpec(1, 11, "lxca", ("10.0.0.1", "fd00::1"), 1001)
B = EndpointSpec(2, 12, "lxcb", ("10.0.0.2",), 1002)


def _implements_api(dp: Datapath) -> DatapathAPI:
    return dp  # mypy checks the real facade against the L4Proto here


@pytest.fixture
def fake() -> Iterator[FakeDatapath]:
    base = f"/fake/{secrets.token_hex(4)}"
    dp = FakeDatapath.open(base)
    dp.attach_endpoint(A)
    dp.attach_endpoint(B)
    yield dp
    FakeDatapath.open(base).teardown()


def test_fake_satisfies_the_protocol(fake: FakeDatapath) -> None:
    assert isinstance(fake, DatapathAPI)


def test_verdicts_follow_identity_port_and_deny(fake: FakeDatapath) -> None:
    fake.sync_policy(
        B.id,
        Enforcement(ingress=True),
        [
            entry(Direction.INGRESS, A.identity, L4Proto.TCP, 8000, 8100),
            entry(Direction.INGRESS, 0, L4Proto.TCP, 8080, deny=True),
        ],
    )
    assert fake.evaluate(B.id, Direction.INGRESS, "10.0.0.1", L4Proto.TCP, 8000) == (
        Verdict.ALLOW,
        Reason.POLICY_ALLOW,
    )
    assert fake.evaluate(B.id, Direction.INGRESS, "10.0.0.1", L4Proto.TCP, 8080)[1] is Reason.POLICY_DENY
    assert fake.evaluate(B.id, Direction.INGRESS, "10.0.0.1", L4Proto.UDP, 8000)[1] is Reason.DEFAULT_DENY
    assert fake.evaluate(B.id, Direction.EGRESS, "10.0.0.1", L4Proto.UDP, 1)[1] is Reason.NOT_ENFORCED
    assert fake.evaluate(B.id, Direction.INGRESS, "192.0.2.9", L4Proto.TCP, 8000)[1] is Reason.DEFAULT_DENY


def test_relabel_and_ipcache_resolution(fake: FakeDatapath) -> None:
    fake.ipcache_upsert("192.0.2.0/24", 16777217)
    fake.ipcache_upsert("192.0.2.128/25", 16777218)
    assert fake.resolve_identity("192.0.2.200") == 16777218
    assert fake.resolve_identity("192.0.2.1") == 16777217
    assert fake.resolve_identity("198.51.100.1") == 2
    assert fake.resolve_identity("fd00::1") == A.identity
    fake.set_identity(A.id, 4242)
    assert fake.resolve_identity("10.0.0.1") == 4242
    with pytest.raises(UnknownEndpoint):
        fake.set_identity(99, 5)
    assert fake.ipcache_delete("192.0.2.128/25")
    assert not fake.ipcache_delete("192.0.2.128/25")
    assert fake.ipcache_dump() == {"192.0.2.0/24": 16777217}


def test_incremental_and_full_policy_with_dump(fake: FakeDatapath) -> None:
    tcp80 = entry(Direction.INGRESS, 1001, L4Proto.TCP, 80)
    udp53 = entry(Direction.INGRESS, 1001, L4Proto.UDP, 53)
    change = fake.apply_policy(B.id, Enforcement(ingress=True), add=[tcp80, udp53])
    assert change.added == 2 and change.enforcement_changed
    fake.apply_policy(B.id, Enforcement(ingress=True), remove=[udp53])
    assert fake.dump_policy(B.id) == (Enforcement(ingress=True), [tcp80])
    ranged = entry(Direction.INGRESS, 0, L4Proto.TCP, 1, 65535)
    change = fake.sync_policy(B.id, Enforcement(ingress=True), [ranged])
    assert (change.added, change.removed) == (16, 1)
    assert fake.dump_policy(B.id)[1] == [ranged]


def test_state_survives_close_and_reopen_until_teardown(fake: FakeDatapath) -> None:
    fake.sync_policy(B.id, Enforcement(egress=True), [])
    base = fake.base_dir
    fake.close()
    with pytest.raises(RuntimeError):
        fake.dump_policy(B.id)
    again = FakeDatapath.open(base)
    assert [(e.id, e.attached, e.enforcement) for e in again.pinned_endpoints()] == [
        (A.id, True, Enforcement()),
        (B.id, True, Enforcement(egress=True)),
    ]
    assert again.detach_endpoint(A.id) and not again.detach_endpoint(A.id)
    again.teardown()
    assert FakeDatapath.open(base).pinned_endpoints() == []


def test_simulated_flows_are_read_and_counted(fake: FakeDatapath) -> None:
    fake.sync_policy(B.id, Enforcement(ingress=True), [])
    event = fake.simulate_flow(B.id, Direction.INGRESS, "10.0.0.1", L4Proto.TCP, 8080)
    assert (event.verdict, event.reason, event.source_identity, event.destination_identity) == (
        Verdict.DENY,
        Reason.DEFAULT_DENY,
        A.identity,
        B.identity,
    )
    assert fake.read_flows(0) == [event]
    assert fake.read_flows(10) == []
    assert fake.counters().packets(endpoint_id=B.id, reason=Reason.DEFAULT_DENY) == 1
    assert fake.counters([A.id]).packets(endpoint_id=B.id) == 0
    assert fake.counters([B.id]).packets(endpoint_id=B.id, reason=Reason.DEFAULT_DENY) == 1
