"""`make bench`'s report: targets listed first with their verdicts, every figure after."""

from __future__ import annotations

from typing import Any

import pytest

from bench.__main__ import summary_rows, target_lines
from bench.stats import target, target_met


def report(*rows: dict[str, Any]) -> dict[str, Any]:
    return {"benchmarks": {"engine": {"summary": list(rows)}, "other": {"error": "exit 1: boom"}}}


def test_targets_open_the_report_with_how_many_are_met() -> None:
    lines = target_lines(
        report(
            {"metric": "resolve", "value": 3.2, "unit": "s", "target": target("<=", 10.0)},
            {"metric": "ratio", "value": 0.87, "unit": "x", "target": target(">=", 0.95)},
            {"metric": "entries", "value": 5, "unit": ""},
        )
    )
    assert lines[0] == "## Targets" and "1 of 2 met." in lines
    assert "| engine | resolve | 3.2 s | ≤ 10.0 s: met |" in lines
    assert "| engine | ratio | 0.87 x | ≥ 0.95 x: **not met** |" in lines
    assert not any("entries" in line for line in lines)


def test_a_report_without_targets_has_no_target_section() -> None:
    assert target_lines(report({"metric": "entries", "value": 5, "unit": ""})) == []


def test_every_row_shows_its_target_and_an_error_its_message() -> None:
    rows = summary_rows(
        "engine", {"summary": [{"metric": "p99", "value": 25, "unit": "ms", "target": target("<=", 20)}]}
    )
    assert rows == [("engine", "p99", "25 ms", "≤ 20.0 ms: **not met**")]
    assert summary_rows("other", {"error": "exit 1: boom\nmore"}) == [("other", "error", "exit 1: boom", "")]


@pytest.mark.parametrize(
    ("value", "op", "bound", "met"),
    [(20.0, "<=", 20.0, True), (20.1, "<=", 20.0, False), (0.95, ">=", 0.95, True), (0.94, ">=", 0.95, False)],
)
def test_a_bound_itself_meets_its_target(value: float, op: str, bound: float, met: bool) -> None:
    assert target_met(value, target(op, bound)) is met


def test_an_unknown_comparison_is_refused() -> None:
    with pytest.raises(ValueError, match="'<=' or '>='"):
        target("<", 1.0)
