"""The rollout benchmark's diff part on a small cluster: it measures a real preview."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.bench_rollout import bench_diff
from testkit.harness import ROOT


def test_the_diff_bench_previews_an_edit_that_changes_pairs_and_judges_every_flow() -> None:
    out = bench_diff(60, 120, 3000)
    assert out["policies"] == 60 and out["flows"] == 3000
    assert 0 < out["flow_keys"] <= 3000
    assert out["pairs_changed"] > 0  # the edited policy names other ports: its pairs change
    assert out["probes"] > 0


def test_the_bench_prints_its_summary_without_the_datapath_part() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_rollout", "--quick", "--no-datapath"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["summary"]
    assert [r["metric"] for r in rows] == [
        "diff: aggregate the recorded flows",
        "diff: preview (copy, edit, pairs and flows)",
    ]
    assert all(isinstance(r["value"], float) and r["unit"] == "s" for r in rows)
