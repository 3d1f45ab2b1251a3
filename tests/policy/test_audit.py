"""Audit overlays (pure): what policies in audit mode add to an identity's map beside its enforced policy."""

from __future__ import annotations

from typing import Any

import pytest

from services.policy.engine.analyze import build_model
from services.policy.engine.audit import delta, full_engine, overlays
from services.policy.engine.model import Direction, EntryKey, IpProto, Verdict
from services.policy.engine.parse import parse_policy
from tests.policy.test_preview import PODS, deny_cnp, docs, from_app, knp

ING = Direction.INGRESS


def run(enforced: list[dict[str, Any]], audited: list[dict[str, Any]]) -> tuple[dict[str, int], dict[int, Any]]:
    model = build_model(docs(PODS + enforced))
    ident = {k: p.identity for k, p in model.pods.items()}
    full = full_engine(model.engine, [parse_policy(d) for d in audited])
    return ident, overlays(model.engine, full)


def key(remote: int, port: int) -> EntryKey:
    return EntryKey(ING, remote, IpProto.TCP, port, port)


@pytest.mark.parametrize(
    ("enforced", "audited", "expect"),
    [
        # only audited policies select db: audit-only default deny, their allows as audited allows
        (
            [],
            [knp("db", "db", ingress=[from_app("web", 5432)])],
            {"ingress": True, "entries": {("web", 5432): "allow"}},
        ),
        # an enforced policy already enforces db's ingress: the audited allows add nothing
        ([knp("db", "db", ingress=[from_app("api", 5432)])], [knp("db2", "db", ingress=[from_app("web", 5432)])], None),
        # an audited deny: kept in its own key space even beside an enforced allow of the same key
        (
            [knp("db", "db", ingress=[{}])],
            [deny_cnp("no-pg", "db", 5432)],
            {"ingress": False, "entries": {(pod, 5432): "deny" for pod in ("web", "api", "db")}},
        ),
        # the same deny enforced: nothing to audit
        ([deny_cnp("no-pg", "db", 5432)], [deny_cnp("no-pg2", "db", 5432)], None),
        # no audited policy: no overlay
        ([knp("db", "db", ingress=[from_app("web", 5432)])], [], None),
    ],
)
def test_overlay(enforced: list[dict[str, Any]], audited: list[dict[str, Any]], expect: dict[str, Any] | None) -> None:
    ident, found = run(enforced, audited)
    db = ident["shop/db"]
    assert set(found) <= {db}
    got = found.get(db)
    if expect is None:
        assert got is None
        return
    assert got is not None and got.ingress == expect["ingress"] and not got.egress
    names = {name: ident[f"shop/{name}"] for name in ("web", "api", "db")}
    verdicts = {"allow": Verdict.ALLOW, "deny": Verdict.DENY}
    want = {key(names[who], port): verdicts[v] for (who, port), v in expect["entries"].items()}
    assert dict(got.entries) == want


def test_delta_removes_with_the_verdict_that_names_the_key_space() -> None:
    _, found = run([], [knp("db", "db", ingress=[from_app("web", 5432)])])
    (over,) = found.values()
    add, remove = delta(None, over)
    assert add == dict(over.entries) and remove == {}
    add, remove = delta(over, None)
    assert add == {} and remove == dict(over.entries)
    assert delta(over, over) == ({}, {})
