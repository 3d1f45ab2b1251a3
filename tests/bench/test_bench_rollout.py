"""The rollout benchmark's diff part on a small cluster: it measures a real preview."""

from __future__ import annotations

from bench.bench_rollout import bench_diff
from tests.bench.runs import run_bench


def test_the_diff_bench_previews_an_edit_that_changes_pairs_and_judges_every_flow() -> None:
    out = bench_diff(60, 120, 3000)
    assert out["policies"] == 60 and out["flows"] == 3000
    assert 0 < out["flow_keys"] <= 3000
    assert out["pairs_changed"] > 0  # the edited policy names other ports: its pairs change
    assert out["probes"] > 0


def test_the_bench_prints_its_summary_without_the_datapath_part() -> None:
    rows = run_bench("bench_rollout", "--quick", "--no-datapath", timeout=240)["summary"]
    assert [r["metric"] for r in rows] == [
        "diff: aggregate the recorded flows",
        "diff: preview (copy, edit, pairs and flows)",
    ]
    assert all(isinstance(r["value"], float) and r["unit"] == "s" for r in rows)
