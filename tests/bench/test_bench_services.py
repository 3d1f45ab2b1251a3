"""Smoke test of bench/bench_services.py: a --quick run measures every variant, checks each, cleans up."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bench.runs import run_bench

pytestmark = [pytest.mark.root, pytest.mark.bcc]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_quick_run_reports_every_variant_and_ratio() -> None:
    for tool in ("iperf3", "iptables-restore", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    data = run_bench("bench_services", "--quick", "--rounds", "1", "--levels", "100,1000", timeout=230)
    variants = {"direct", "clusterip-100", "iptables-100", "clusterip-1000", "iptables-1000"}
    assert set(data["medians"]) == variants
    for variant in variants:
        assert all(data["medians"][variant][m] > 0 for m in ("conn_rate", "udp_pps")), variant
    # Each variant proved the translation it claims: BPF's for ClusterIP, iptables' DNAT for kube-proxy.
    assert data["checks_passed"] is True, data["checks"]
    assert {c["variant"] for c in data["checks"]} == variants
    assert set(data["ratios"]) == {"100", "1000"}
    # Each level's ClusterIP / direct ratios carry their target; the programs' own cost is measured.
    targets = {r["metric"]: r["target"] for r in data["summary"] if "target" in r}
    assert len(targets) == 4 and all(t == {"op": ">=", "value": 0.95} for t in targets.values()), targets
    assert set(data["bpf_run_time"]) == {"direct", "clusterip-100", "clusterip-1000"}
    for variant, cost in data["bpf_run_time"].items():
        assert cost["udp_64b"]["ns_per_packet"] > 0 and cost["connections"]["ns_per_connection"] > 0, variant
    assert data["cleanup_ok"] is True, data["cleanup"]
