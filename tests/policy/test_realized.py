"""Who is behind a revision: judged by the changes recorded for the endpoint's identity on its node.

Each case plays a script on a realized table (endpoints appearing, orders recorded, reports) and
asks which endpoints a wait for each revision still waits for. An endpoint that never reported is
behind the changes made since it appeared (its first policy among them), never every revision:
with bumps held back, an endpoint with nothing to realize may not report for a long time, and a
wait for a revision that changed nothing of it must not wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.engine.realized import RealizedTable, Report

NODE = "n1"
WEB, DB = 256, 257


@dataclass(frozen=True)
class Appear:
    """The ipcache names the pod on NODE, at committed revision ``since``."""

    pod: str
    identity: int
    since: int


@dataclass(frozen=True)
class Commit:
    """A commit at ``revision`` whose orders changed these identities' policy on NODE."""

    revision: int
    changed: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reported:
    pod: str
    identity: int
    revision: int


Step = Appear | Commit | Reported


def play(script: tuple[Step, ...]) -> RealizedTable:
    table = RealizedTable()
    for step in script:
        if isinstance(step, Appear):
            table.upsert_endpoint(NODE, step.pod, step.identity, step.since)
        elif isinstance(step, Commit):
            table.record_changes(step.revision, [(NODE, i) for i in step.changed], 0.0)
        else:
            table.report(Report(NODE, 0, step.identity, step.revision, step.pod), step.revision)
    return table


#: The db pod is there, has realized revision 2 (its identity's policy came at 2).
SETTLED = (Appear("x/db", DB, 1), Commit(2, (DB,)), Reported("x/db", DB, 2))
#: The same with a web pod alone.
ONE_WEB = (Appear("x/web", WEB, 1), Commit(2, (WEB,)), Reported("x/web", WEB, 2))

CASES = {
    # A new pod whose identity the node already holds (here: fetched by the datapath for it, so
    # no order carries it): its first policy is recorded at the commit that names it.
    "a pod of an identity held with no recorded change must realize the commit that names it": (
        (*SETTLED, Appear("x/web", WEB, 2), Commit(3)),
        {2: [], 3: ["x/web"], 4: ["x/web"]},
    ),
    # ... and once it reported that, revisions that change nothing of it do not wait for it.
    "after its first report, bumps do not hold it": (
        (*SETTLED, Appear("x/web", WEB, 2), Commit(3), Reported("x/web", WEB, 3), Commit(4), Commit(5)),
        {3: [], 5: []},
    ),
    # The case that hung `policy import --wait`: a pod that never reported, whose identity's policy
    # changed before it appeared and never since, while the import changed someone else.
    "a pod that never reported is not behind a change of another identity": (
        (*SETTLED, Appear("x/web", WEB, 2), Commit(3, (WEB,)), Appear("x/web-2", WEB, 3), Commit(4, (DB,))),
        {4: ["x/db", "x/web"]},
    ),
    "nor behind bumps that change nothing of it": (
        (*ONE_WEB, Appear("x/web-2", WEB, 2), Commit(3)),
        {2: [], 3: [], 9: []},
    ),
    # A pod whose identity comes new to the node: the order brings its whole policy, a change.
    "a pod of an identity new to the node waits for the order that brings its policy": (
        (*SETTLED, Appear("x/web", WEB, 2), Commit(3, (WEB,))),
        {2: [], 3: ["x/web"], 7: ["x/web"]},
    ),
    # Orders with no new revision (an ipcache change that moved none) still bring policies.
    "a pod whose identity's policy comes in a commit that moved no revision waits for it": (
        (*SETTLED, Appear("x/web", WEB, 2), Commit(2, (WEB,))),
        {1: [], 2: ["x/web"], 3: ["x/web"]},
    ),
    "a change of its identity after it appeared holds a pod that never reported": (
        (*ONE_WEB, Appear("x/web-2", WEB, 2), Commit(5, (WEB,))),
        {4: [], 5: ["x/web", "x/web-2"]},
    ),
    "a revision before a pod appeared never waits for it": (
        (*SETTLED, Appear("x/web", WEB, 4), Commit(5, (WEB,))),
        {2: [], 4: [], 5: ["x/web"]},
    ),
    "a reported pod is behind the changes of its identity after what it realized, up to the wait": (
        (*SETTLED, Commit(3), Commit(4, (DB,)), Commit(5)),
        {3: [], 4: ["x/db"], 5: ["x/db"]},
    ),
    "a report at or past the change settles it": (
        (*SETTLED, Commit(4, (DB,)), Reported("x/db", DB, 5)),
        {4: [], 5: []},
    ),
}


@pytest.mark.parametrize(("script", "behind"), list(CASES.values()), ids=list(CASES))
def test_who_is_behind(script: tuple[Step, ...], behind: dict[int, list[str]]) -> None:
    table = play(script)
    for revision, pods in behind.items():
        assert [lag.pod for lag in table.behind(revision)] == pods, f"waiting for revision {revision}"
        assert table.settled(revision) == (not pods, table.settled(revision)[1])


def test_each_pod_of_an_identity_no_order_brought_realizes_the_commit_that_names_it() -> None:
    """With no change of its identity recorded on the node, every new pod's first policy is the
    commit that names it (the first pod's report does not stand for the next pod's)."""
    table = play((*SETTLED, Appear("x/web", WEB, 2), Commit(3), Reported("x/web", WEB, 3)))
    table.upsert_endpoint(NODE, "x/web-2", WEB, 3)
    table.record_changes(3, [], 0.0)  # a commit that moved no revision
    assert [lag.pod for lag in table.behind(3)] == ["x/web-2"]
    table.report(Report(NODE, 0, WEB, 3, "x/web-2"), 3)
    assert table.behind(3) == []


def test_a_change_on_one_node_waits_for_that_nodes_endpoints_of_the_identity_only() -> None:
    """An identity spread over many nodes: a change recorded for (node, identity) holds the
    endpoints of that identity on that node, none elsewhere."""
    table = RealizedTable()
    for n in range(50):
        table.upsert_endpoint(f"n{n}", f"x/web-{n}", WEB, 1)
    table.record_changes(2, [(f"n{n}", WEB) for n in range(50)], 0.0)
    for n in range(50):
        table.report(Report(f"n{n}", 0, WEB, 2, f"x/web-{n}"), 2)
    table.record_changes(3, [("n7", WEB)], 0.0)
    assert [(lag.node, lag.pod) for lag in table.behind(3)] == [("n7", "x/web-7")]
    assert table.settled(3)[0] is False
    table.report(Report("n7", 0, WEB, 3, "x/web-7"), 3)
    assert table.behind(3) == [] and table.settled(3)[0] is True


Op = tuple[str, int, int, int]  # (what, node, pod, identity)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["ipcache", "remove", "report", "forget"]),
            st.integers(0, 2),
            st.integers(0, 3),
            st.sampled_from([WEB, DB, 258]),
        ),
        max_size=40,
    )
)
def test_the_per_node_index_follows_every_endpoint_move(ops: list[Op]) -> None:
    """Endpoints appearing, relabelled, removed, declared by a datapath and forgotten: the endpoints
    of each (node, identity) are always those the table holds with that node and identity."""
    table = RealizedTable()
    for what, n, p, identity in ops:
        node, pod = f"n{n}", f"x/p{p}"
        if what == "ipcache":
            table.upsert_endpoint(node, pod, identity, 1)
        elif what == "remove":
            table.remove_endpoint(node, pod)
        elif what == "report":
            table.report(Report(node, p + 1, identity, 1, pod), 1)
        else:
            table.forget(Report(node, p + 1, identity, 0, pod, deleted=True))
        for nn in range(3):
            for ident in (WEB, DB, 258):
                held = sorted(
                    (f"n{nn}", f"x/p{q}") for q in range(4) if table.identity_of(f"n{nn}", f"x/p{q}") == ident
                )
                assert table.endpoints_of(f"n{nn}", ident) == held
