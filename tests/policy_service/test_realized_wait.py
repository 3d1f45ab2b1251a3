"""A wait for a revision checks the realized table after every batch of reports: cheaply, same answer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.engine.realized import Endpoint, EndpointKey, RealizedTable, Report


def settled_by_scan(table: RealizedTable, revision: int) -> bool:
    """The definition: nobody behind, or somebody failed to realize it."""
    behind = table.behind(revision)
    return not behind or any(lag.error for lag in behind)


class CountingTable(RealizedTable):
    """Counts the endpoints a query looks at."""

    looked = 0

    def is_behind(self, ep: Endpoint, revision: int) -> bool:
        self.looked += 1
        return super().is_behind(ep, revision)


def cluster(table: RealizedTable, nodes: int, pods: int) -> list[tuple[str, str, int]]:
    """``pods`` endpoints per node, one identity per pod slot, all changed at revision 2."""
    endpoints = [(f"n{n}", f"ns/p{n}-{p}", 256 + p) for n in range(nodes) for p in range(pods)]
    for node, pod, identity in endpoints:
        table.upsert_endpoint(node, pod, identity, 1)
        table.report(Report(node, 0, identity, 1, pod), 1)
    table.record_changes(2, {(node, identity) for node, _, identity in endpoints}, 0.0)
    return endpoints


@pytest.mark.parametrize("shuffled", [False, True])
def test_a_whole_wait_looks_at_each_endpoint_a_few_times_not_once_per_check(shuffled: bool) -> None:
    table = CountingTable()
    nodes, pods = 200, 25
    endpoints = cluster(table, nodes, pods)
    order = list(range(nodes))
    if shuffled:
        random.Random(7).shuffle(order)
    left: list[EndpointKey] | None = None
    checks = looked = 0
    for n in order:
        # A node's report of all its endpoints, then the waiter's check (as after every batch).
        for node, pod, identity in endpoints[n * pods : (n + 1) * pods]:
            table.report(Report(node, 0, identity, 2, pod), 2)
        before = table.looked
        done, left = table.settled(2, left)
        looked += table.looked - before
        checks += 1
        assert done == settled_by_scan(table, 2)
    assert done and checks == nodes
    # A scan per check looks at every endpoint up to the first one behind: in the table's own
    # order, 25 + 50 + ... + 5,000 (half a million). The wait's list is built once, shrinks from
    # its end and is confirmed empty by one more scan: each endpoint about three times.
    assert looked <= 3 * nodes * pods + checks


def test_a_failure_settles_the_wait_at_once_and_a_later_success_unsettles_it() -> None:
    table = RealizedTable()
    cluster(table, 3, 2)
    done, left = table.settled(2)
    assert not done and left
    table.report(Report("n2", 0, 257, 2, "ns/p2-1", error="map full"), 2)
    assert table.settled(2, left) == (True, []) and settled_by_scan(table, 2)
    table.report(Report("n2", 0, 257, 2, "ns/p2-1"), 2)
    assert not table.settled(2, left)[0] and not settled_by_scan(table, 2)


ops = st.lists(
    st.tuples(
        st.sampled_from(["report", "fail", "remove", "gone", "back", "change", "add"]),
        st.integers(0, 3),  # node
        st.integers(0, 3),  # pod
        st.integers(1, 4),  # revision
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 4))
def test_settled_agrees_with_the_scan_whatever_happens(script: list[tuple[str, int, int, int]], wanted: int) -> None:
    table = RealizedTable()
    cluster(table, 4, 4)
    left: list[EndpointKey] | None = None
    for op, n, p, revision in script:
        node, pod, identity = f"n{n}", f"ns/p{n}-{p}", 256 + p
        if op in ("report", "fail") and table.identity_of(node, pod) is not None:
            table.report(Report(node, 0, identity, revision, pod, error="no" if op == "fail" else ""), 4)
        elif op == "remove":
            table.remove_endpoint(node, pod)
        elif op in ("gone", "back"):
            table.set_gone(node, op == "gone")
        elif op == "change":
            table.record_changes(revision, [(node, identity)], 0.0)
        elif op == "add":
            table.upsert_endpoint(node, pod, identity, revision)
        done, left = table.settled(wanted, left)
        assert done == settled_by_scan(table, wanted), (op, node, pod, revision)
