"""Smoke test of bench/bench_datapath_cost.py: a --quick run measures every variant and metric."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bench.runs import run_bench

pytestmark = [pytest.mark.root, pytest.mark.bcc]

ROOT = Path(__file__).resolve().parents[2]
LEVELS = (10, 1000, 10000)
#: palisade-host: local delivery off, at the middle level only.
VARIANTS = {
    "none",
    "redirect",
    *(f"{kind}-{n}" for kind in ("palisade", "iptables") for n in LEVELS),
    "palisade-host-1000",
    # --compare-attach: the top level attached the other way (tcx, the default being tc).
    "palisade-other-10000",
}
METRICS = ("tcp_throughput", "udp_64b_rate", "connection_rate")


@pytest.mark.timeout(180)
def test_quick_run_reports_every_variant_and_metric() -> None:
    for tool in ("iperf3", "iptables-restore", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    data = run_bench("bench_datapath_cost", "--quick", "--compare-attach", timeout=170)
    assert "error" not in data, data["error"]

    assert set(data["medians"]) == VARIANTS
    for variant in VARIANTS:
        for metric in METRICS:
            samples = data["samples"][variant][metric]
            assert samples and all(x > 0 for x in samples), (variant, metric, samples)
            assert data["medians"][variant][metric] > 0, (variant, metric)
            assert data["ratios"][variant][metric] > 0, (variant, metric)
    assert data["ratios"]["none"] == dict.fromkeys(METRICS, 1.0)

    # Every filtering variant proved it filters, in both directions, before it was measured.
    assert data["checks_passed"] is True
    passed = {(c["variant"], c["check"]) for c in data["checks"] if c["passed"]}
    # The limit forwards by itself, past the host (else it would be no limit at all).
    assert ("redirect", "forwards-past-the-host") in passed
    for variant in VARIANTS - {"none", "redirect"}:
        assert (variant, "allowed-port-connects") in passed
        assert (variant, "ingress-denied-port-dropped") in passed
        assert (variant, "egress-denied-port-dropped") in passed
    assert data["cleanup_ok"] is True, data["cleanup"]

    # The programs' own run time, from the kernel's BPF statistics.
    for n in LEVELS:
        cost = data["bpf_run_time"][f"palisade-{n}"]
        assert cost["udp_64b"]["ns_per_packet"] > 0
        assert cost["connections"]["ns_per_connection"] > 0
        # ... and without traffic, every timed frame passed (not a drop timed).
        times = data["program_time"][f"palisade-{n}"]
        assert times["udp_established_ns_per_packet"] > 0 and times["tcp_reply_ns_per_packet"] > 0
        assert (f"palisade-{n}", "test-run frames pass") in passed

    labels = [row["metric"] for row in data["summary"]]
    assert "TCP throughput, Palisade 10k entries / no filter" in labels
    assert "New-connection rate, iptables 10k rules / no filter" in labels
    assert "64-byte UDP rate, Palisade 10k entries / bare redirect" in labels
    assert "64-byte UDP rate, Palisade 10k entries attached with tcx / attached with tc" in labels
    assert {p["name"] for p in data["plots"]} == {*(f"cost_{m}" for m in METRICS), "cost_bpf_run_time"}
    for plot in (p for p in data["plots"] if p["name"] != "cost_bpf_run_time"):
        assert plot["logx"] is True
        assert [x for x, _ in plot["series"]["Palisade (BPF)"]] == list(LEVELS)
        assert [x for x, _ in plot["series"]["iptables"]] == list(LEVELS)
