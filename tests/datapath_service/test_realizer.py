"""The realizer over the in-memory datapath: it owns realized state and hands the facade exact deltas."""

from __future__ import annotations

import asyncio
import errno
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest

from palisade.v1 import policy_pb2
from services.datapath import types as dt
from services.datapath.endpoint import Endpoint
from services.datapath.fake import FakeDatapath
from services.datapath.maps import policymap
from services.datapath.orders import Reporter
from services.datapath.realizer import IdentityPolicy, Realizer
from services.datapath.state import EndpointRecord

WEB, DB = 300, 301


class Recording(FakeDatapath):
    """The fake datapath, remembering what each policy write was given; writes for ``broken`` endpoints fail."""

    writes: list[tuple[str, int, int, int]]
    broken: set[int]

    def _check_writable(self, ep_id: int) -> None:
        if ep_id in self.broken:
            raise OSError(errno.ENOSPC, "policy map full")

    def apply_policy(
        self,
        ep_id: int,
        enforcement: dt.Enforcement,
        add: Iterable[dt.PolicyEntry] = (),
        remove: Iterable[dt.PolicyEntry] = (),
        keep: Iterable[dt.PolicyEntry] = (),
    ) -> dt.PolicyChange:
        add, remove, keep = list(add), list(remove), list(keep)
        self.writes.append(("delta", len(add), len(remove), len(keep)))
        self._check_writable(ep_id)
        return super().apply_policy(ep_id, enforcement, add, remove, keep)

    def sync_policy(
        self, ep_id: int, enforcement: dt.Enforcement, entries: Iterable[dt.PolicyEntry]
    ) -> dt.PolicyChange:
        entries = list(entries)
        self.writes.append(("sync", len(entries), 0, 0))
        self._check_writable(ep_id)
        return super().sync_policy(ep_id, enforcement, entries)


class Sink:
    def __init__(self) -> None:
        self.realized: list[dt.Realized] = []

    def add(self, items: Iterable[dt.Realized], arrived: float | None = None) -> None:
        self.realized.extend(items)

    def deleted(self, endpoint_id: int, identity: int, pod: str) -> None:
        pass


def allow(remote: int, low: int, high: int = 0) -> dt.PolicyEntry:
    return dt.PolicyEntry(dt.PolicyKey(dt.Direction.INGRESS, remote, dt.L4Proto.TCP, low, high))


def record(ep_id: int, identity: int) -> EndpointRecord:
    return EndpointRecord(
        id=ep_id,
        namespace="x",
        pod=f"p{ep_id}",
        netns=f"/run/netns/p{ep_id}",
        netns_owned=True,
        host_ifname=f"lxc{ep_id}",
        host_ifindex=100 + ep_id,
        addresses=(dt.Address(ip=f"10.0.0.{ep_id}", cidr="10.0.0.0/24", gateway="10.0.0.1", family=4),),
        labels=(),
        identity_owned=False,
        identity=identity,
    )


@pytest.fixture
def dp() -> Iterator[Recording]:
    base = f"/fake/{secrets.token_hex(4)}"
    fake = Recording.open(base)
    assert isinstance(fake, Recording)
    fake.writes = []
    fake.broken = set()
    yield fake
    fake.teardown()


async def realizer_with(dp: Recording, *endpoints: Endpoint, sink: Sink | None = None) -> Realizer:
    table = {ep.id: ep for ep in endpoints}
    for ep in endpoints:
        dp.attach_endpoint(
            dt.EndpointSpec(ep.id, ep.record.host_ifindex, ep.record.host_ifname, ep.record.ips, ep.identity)
        )
    realizer = Realizer(datapath=dp, endpoints=table, reporter=sink or Sink())
    big = tuple(allow(1000 + i, 1, 65535) for i in range(300))
    await realizer.apply_resync(dt.ResyncState(1, 10, (dt.PolicySnapshot(DB, dt.Enforcement(ingress=True), big),)))
    dp.writes.clear()
    return realizer


async def test_an_order_of_one_entry_hands_the_facade_one_entry(dp: Recording) -> None:
    a, b = Endpoint(record(1, DB)), Endpoint(record(2, DB))
    realizer = await realizer_with(dp, a, b)
    enforced = dt.Enforcement(ingress=True)
    order = dt.OrderBatch(2, 11, (dt.IdentityPolicyDiff(DB, enforced, add=(allow(WEB, 5432),)),))
    await realizer.apply_order(order)
    assert dp.writes == [("delta", 1, 0, 0), ("delta", 1, 0, 0)]  # per endpoint: the entry, nothing else
    assert a.state is b.state is dt.EndpointState.READY and a.realized_revision == 11

    removal = dt.IdentityPolicyDiff(DB, enforced, remove=(allow(WEB, 5432).key,))
    await realizer.apply_order(dt.OrderBatch(3, 12, (removal,)))
    assert dp.writes[2:] == [("delta", 0, 1, 0), ("delta", 0, 1, 0)]
    for ep in (a, b):
        assert dp.dump_policy(ep.id) == (enforced, sorted(realizer.policies[DB].entries.values()))


async def test_entries_sharing_a_block_are_named_and_the_map_matches_a_full_encode(dp: Recording) -> None:
    a = Endpoint(record(1, DB))
    realizer = await realizer_with(dp, a)
    enforced = dt.Enforcement(ingress=True)
    wide, narrow = allow(WEB, 1000, 2047), allow(WEB, 1024, 2047)
    await realizer.apply_order(dt.OrderBatch(2, 11, (dt.IdentityPolicyDiff(DB, enforced, add=(wide, narrow)),)))
    await realizer.apply_order(dt.OrderBatch(3, 12, (dt.IdentityPolicyDiff(DB, enforced, remove=(wide.key,)),)))
    assert dp.writes[-1] == ("delta", 0, 1, 1)  # the narrow one is kept: it shares wide's block
    desired = realizer.policies[DB].entries.values()
    assert dp._k.policy[a.id] == policymap.encode(a.id, desired)


async def test_a_map_that_missed_a_version_gets_the_difference_and_repair_fixes_drift(dp: Recording) -> None:
    a = Endpoint(record(1, DB))
    realizer = await realizer_with(dp, a)
    enforced = dt.Enforcement(ingress=True)
    for seq, port in ((2, 80), (3, 81)):
        diff = dt.IdentityPolicyDiff(DB, enforced, add=(allow(WEB, port),))
        realizer.policies[DB] = realizer.policies[DB].apply(diff, seq, 10 + seq)  # not realized in between
    await realizer.realize(a, full=False)
    assert dp.writes == [("delta", 2, 0, 0)]
    assert isinstance(realizer.policies[DB], IdentityPolicy) and a.realized is not None
    assert a.realized.version == realizer.policies[DB].version

    dp.sync_policy(a.id, dt.Enforcement(), [])  # behind the realizer's back
    assert await realizer.repair() == 1
    assert dp.dump_policy(a.id) == (enforced, sorted(realizer.policies[DB].entries.values()))
    assert await realizer.repair() == 0


async def test_a_failed_map_write_is_reported_with_its_error_and_repair_clears_it(dp: Recording) -> None:
    a, b = Endpoint(record(1, DB)), Endpoint(record(2, DB))
    sink = Sink()
    realizer = await realizer_with(dp, a, b, sink=sink)
    sink.realized.clear()
    dp.broken = {b.id}
    order = dt.IdentityPolicyDiff(DB, dt.Enforcement(ingress=True), add=(allow(WEB, 80),))
    await realizer.apply_order(dt.OrderBatch(2, 11, (order,)))
    assert b.state is dt.EndpointState.FAILED and "policy map full" in b.error
    assert {(r.endpoint_id, r.revision, bool(r.error)) for r in sink.realized} == {(a.id, 11, False), (b.id, 11, True)}
    (failed,) = [r for r in sink.realized if r.error]
    assert failed.error == b.error and failed.pod == "x/p2"

    dp.broken.clear()
    sink.realized.clear()
    assert await realizer.repair() == 1
    assert (b.state, b.error, b.failed_revision) == (dt.EndpointState.READY, "", 0)
    assert {(r.endpoint_id, r.revision, r.error) for r in sink.realized} >= {(b.id, 11, "")}


class Capture:
    def __init__(self) -> None:
        self.reports: list[policy_pb2.RealizedReport] = []
        #: The node named by each call, and set once a call came with no reports (a heartbeat).
        self.nodes: list[str] = []
        self.beats = asyncio.Event()

    async def resync(self, node: str, identities: Sequence[int] = ()) -> dt.ResyncState:
        return dt.ResyncState(0, 0)

    async def report(self, reports: Sequence[policy_pb2.RealizedReport], node: str = "") -> None:
        self.reports.extend(reports)
        self.nodes.append(node)
        if not reports:
            self.beats.set()


async def test_the_reporter_carries_the_failure_to_the_policy_service() -> None:
    policy = Capture()
    reporter = Reporter("n1", policy)
    task = asyncio.create_task(reporter.run())
    try:
        reporter.add([dt.Realized(1, DB, 11, "x/a"), dt.Realized(2, DB, 11, "x/b", "writing the policy map failed")])
        await asyncio.wait_for(reporter.flushed(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [(r.endpoint_id, r.revision, r.error) for r in policy.reports] == [
        (1, 11, ""),
        (2, 11, "writing the policy map failed"),
    ]


async def test_an_idle_reporter_beats_with_its_node_name() -> None:
    """With nothing to report, the reporter still says the node is alive (an empty report naming it)."""
    policy = Capture()
    reporter = Reporter("n1", policy, heartbeat=0.05)
    task = asyncio.create_task(reporter.run())
    try:
        await asyncio.wait_for(policy.beats.wait(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert policy.reports == [] and policy.nodes[0] == "n1"


class Refusing(Capture):
    """Refuses the first report; ``meanwhile`` is done to the reporter while that call is in flight."""

    def __init__(self, meanwhile: Callable[[Reporter], None]) -> None:
        super().__init__()
        self.meanwhile = meanwhile
        self.reporter: Reporter | None = None
        self.refused = 0

    async def report(self, reports: Sequence[policy_pb2.RealizedReport], node: str = "") -> None:
        if reports and not self.refused:
            self.refused += 1
            assert self.reporter is not None
            self.meanwhile(self.reporter)
            raise ConnectionError("policy service away")
        await super().report(reports, node)


async def test_a_refused_report_is_sent_again_behind_what_arrived_meanwhile() -> None:
    """A failed delivery puts its reports back unless newer ones came; the retry sends the merge."""
    # A newer revision of endpoint 1 arrives while the refused call is out.
    policy = Refusing(lambda reporter: reporter.add([dt.Realized(1, DB, 12, "x/a")], arrived=0.0))
    reporter = policy.reporter = Reporter("n1", policy, backoff_max=0.05)
    realized: list[float] = []
    reporter.on_order_realized = realized.append
    task = asyncio.create_task(reporter.run())
    try:
        reporter.add([dt.Realized(1, DB, 11, "x/a"), dt.Realized(2, DB, 11, "x/b")], arrived=0.0)
        await asyncio.wait_for(reporter.flushed(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert policy.refused == 1
    assert [(r.endpoint_id, r.revision) for r in policy.reports] == [(1, 12), (2, 11)]
    assert len(realized) == 2 and reporter.delivered == 2


def delete_and_reuse(reporter: Reporter) -> None:
    """Endpoint 1 is deleted; so is endpoint 3, whose id a new endpoint takes at once."""
    reporter.deleted(1, DB, "x/a")
    reporter.deleted(3, DB, "x/c")
    reporter.add([dt.Realized(3, WEB, 12, "x/d")])


async def test_a_refused_report_of_an_endpoint_deleted_meanwhile_is_not_sent_again() -> None:
    """Sent after the endpoint's deletion, its live report would bring back an endpoint that never
    reports again, and WaitForRevision would wait on it for good (seen in a churn while the policy
    service changed leaders)."""
    policy = Refusing(delete_and_reuse)
    reporter = policy.reporter = Reporter("n1", policy, backoff_max=0.05)
    task = asyncio.create_task(reporter.run())
    try:
        reporter.add([dt.Realized(1, DB, 11, "x/a"), dt.Realized(2, DB, 11, "x/b"), dt.Realized(3, DB, 11, "x/c")])
        await asyncio.wait_for(reporter.flushed(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert policy.refused == 1
    # The deletions first, then the live reports: endpoint 2 as it was, id 3's new endpoint; never endpoint 1.
    assert [(r.endpoint_id, r.pod, r.revision, r.deleted) for r in policy.reports] == [
        (1, "x/a", 0, True),
        (3, "x/c", 0, True),
        (2, "x/b", 11, False),
        (3, "x/d", 12, False),
    ]
