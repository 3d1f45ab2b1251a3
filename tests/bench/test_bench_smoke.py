"""Smoke runs of the whole-stack benchmarks in --quick mode, and their probe logic."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench.bench_system import Attempt, verdict_time
from tests.bench.runs import run_bench


def run_quick(script: str) -> dict[str, Any]:
    out = run_bench(script.removesuffix(".py"), "--quick", timeout=240)
    for row in out["summary"]:
        assert set(row) - {"target"} == {"metric", "value", "unit"}
        assert isinstance(row["value"], int | float)
        if "target" in row:
            assert row["target"]["op"] in ("<=", ">=") and isinstance(row["target"]["value"], float)
    for plot in out["plots"]:
        assert plot["kind"] == "hist" and all(plot["series"].values())
    return out


def leftovers() -> set[str]:
    """The benchmarks' bpffs directories and pod namespaces (theirs only: tests run alongside)."""
    pins = {p.name for p in Path("/sys/fs/bpf").iterdir() if p.name.startswith("palisade-bench-")}
    netns = Path("/run/netns")
    names = {n.name for n in netns.iterdir()} if netns.is_dir() else set()
    return pins | {n for n in names if n.startswith(("pal_bcp", "pal_bsys", "pal_bxn"))}


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.timeout(240)
def test_control_plane_quick() -> None:
    before = leftovers()
    out = run_quick("bench_control_plane.py")
    services = out["services"]
    assert services["endpoints"] == 10 and services["changes"] == 5
    assert services["endpoints_ready_after_load"] == 10
    assert set(services["rss_mib_loaded"]) >= {"watcher", "ipam", "policy", "datapath"}
    assert all(v > 0 for v in services["rss_mib_loaded"].values())
    assert services["implementation_delay_ms"]["p50"] > 0
    assert out["engine"]["entries"] > 0 and out["policy_big"]["policy_rss_mib"] > 0
    assert all(out["engine"]["profile"][part] for part in ("full_recompute", "identity_add_x5"))
    targeted = {row["metric"] for row in out["summary"] if "target" in row}
    assert {"engine identity add p99", "engine process RSS at that scale"} <= targeted
    assert services["allocation"]["identity_new_per_s_c16"] > 0 and services["allocation"]["ip_allocate_per_s_c16"] > 0
    # CreateEndpoint's CPU over every process, and the mean latency that CPU allows on these cores.
    rows = {row["metric"]: row["value"] for row in out["summary"]}
    cpu = rows["CreateEndpoint CPU per create, all processes"]
    assert cpu == pytest.approx(sum(services["endpoint_create_cpu_ms"].values()), abs=0.01) and cpu > 0
    assert services["endpoint_create_cpu_ms"]["datapath"] > 0 and services["endpoint_create_cpu_ms"]["ipam"] > 0
    floor = rows[f"CreateEndpoint mean, CPU-bound floor (4 in flight, {os.cpu_count()} cores)"]
    assert floor == pytest.approx(4 * cpu / (os.cpu_count() or 1), abs=0.01)
    assert leftovers() <= before, "pins or namespaces left behind"


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.timeout(240)
def test_system_quick() -> None:
    before = leftovers()
    out = run_quick("bench_system.py")
    assert out["pods"] == 10 and out["changes"] == 5
    assert 0 < out["file_to_enforced_ms"]["p50"] < 10_000
    assert leftovers() <= before, "pins or namespaces left behind"


def attempts(*spec: tuple[float, bool | None]) -> list[Attempt]:
    """(start, ok) per attempt; ok None means still in flight."""
    return [Attempt(start, done=ok is not None, ok=bool(ok)) for start, ok in spec]


def test_allowed_is_the_first_success_once_earlier_attempts_are_done() -> None:
    assert verdict_time(attempts((0.0, False), (0.1, True), (0.2, True)), True, 0.5) == 0.1
    assert verdict_time(attempts((0.0, None), (0.1, True)), True, 0.5) is None  # 0.0 may still succeed
    assert verdict_time(attempts((0.0, False), (0.1, False)), True, 0.5) is None


def test_denied_needs_an_unbroken_run_of_failures_for_the_confirm_window() -> None:
    flipped = attempts((0.0, True), (0.1, True), (0.2, False), (0.4, False), (0.7, False), (0.8, None))
    assert verdict_time(flipped, False, 0.5) == 0.2
    assert verdict_time(flipped[:4], False, 0.5) is None  # not yet 0.5 s of failures
    flapping = attempts((0.0, True), (0.2, False), (0.3, True), (0.4, False), (1.0, False))
    assert verdict_time(flapping, False, 0.5) == 0.4
    pending = attempts((0.0, True), (0.2, None), (0.4, False), (0.8, False))
    assert verdict_time(pending, False, 0.5) is None  # 0.2 might still succeed


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.timeout(240)
def test_cni_quick() -> None:
    before = set(Path(tempfile.gettempdir()).glob("palisade-bench-cni-*"))
    out = run_quick("bench_cni.py")
    # Its working folder (three runtimes' state, the stack's data) goes with the run.
    assert set(Path(tempfile.gettempdir()).glob("palisade-bench-cni-*")) <= before
    for mode in ("standalone", "chained"):
        assert out[mode]["plugin_failures"] == 0
        assert out[mode]["add_ms"]["p50"] > 0 and out[mode]["del_ms"]["p50"] > 0
        assert out[mode]["sandboxes_per_s"] > 0
        # The rate's rounds ran the plugin itself (no timing wrapper); only the timed rounds' calls were timed.
        assert out[mode]["rate_sandboxes"] == out[mode]["timed_sandboxes"] == out[mode]["add_calls"] == 8
        share = out[mode]["datapath_share_ms"]
        assert share["add"] == round(out[mode]["add_ms"]["p50"] - out["plugin_own_ms"]["p50"], 3)
    assert 0 < out["plugin_own_ms"]["p50"] < out["standalone"]["add_ms"]["p50"]


@pytest.mark.timeout(240)
def test_tls_quick() -> None:
    out = run_quick("bench_tls.py")
    for key in ("orders_1k_latency_ms_p50", "orders_16k_per_s", "reports_latency_ms_p50", "reports_per_s"):
        assert out["tls"][key] > 0 and out["plain"][key] > 0, key
        assert out["ratios"][key] == round(out["tls"][key] / out["plain"][key], 3), key


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.timeout(240)
def test_cross_node_quick() -> None:
    """Both routing modes measured, each pair of each round, as ratios to the no-program baseline."""
    if shutil.which("iperf3") is None:
        pytest.skip("iperf3 is not installed")
    before = leftovers()
    out = run_quick("bench_cross_node.py")
    assert out["checks_passed"] is True, out.get("error")
    assert set(out["modes"]) == {"direct", "tunnel"}
    for mode in out["modes"].values():
        for variant in ("palisade", "bare"):
            for metric in ("tcp_throughput", "udp_64b_rate"):
                samples = mode["samples"][variant][metric]
                assert len(samples) == 1 and samples[0] > 0, (variant, metric, samples)  # --quick: one round
        assert all(r > 0 for r in mode["ratios"].values()), mode["ratios"]
    ratios = [r["metric"] for r in out["summary"] if r["unit"] == "ratio"]
    assert len(ratios) == 4 and all("Palisade / no program" in m for m in ratios), ratios
    assert leftovers() <= before, "pins or namespaces left behind"


def scale_runs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("palisade-bench-scale-*")}


@pytest.mark.timeout(240)
def test_scale_quick() -> None:
    before = scale_runs()
    out = run_quick("bench_scale.py")
    assert out["world"] == {"nodes": 20, "pods": 400, "namespaces": 10, "policies": 40}
    assert out["identities"] == 100  # 10 namespaces x 10 apps
    assert out["change_realized_ms"]["p50"] > 0 and out["change_applied_on_last_node_ms"]["p50"] > 0
    assert out["change_order_bytes"] > 0
    assert out["node_join_ms"]["p50"] > 0
    assert out["churn"]["pods_created"] == 100 and out["churn"]["manifest_to_ipcache_ms"]["p50"] > 0
    assert out["rss_policy_peak_mib"] > 0
    targeted = {row["metric"].split(" (")[0] for row in out["summary"] if "target" in row}
    assert targeted == {
        "policy change realized on every node p99",
        "node join",
        "policy service RSS peak",
    }
    assert scale_runs() <= before, "temporary directory left behind"


def test_policy_change_quick() -> None:
    """The policy service's own work for bench_scale's change (no stack, so no lock)."""
    out = run_quick("bench_policy_change.py")
    assert out["world"] == {"nodes": 20, "pods": 400, "namespaces": 10, "policies": 40}
    assert out["change_order_bytes"] > 0
    for key in ("change_commit_and_encode_cpu_s", "change_answer_status_cpu_s", "change_reports_cpu_s"):
        assert 0 <= out[key]["min"] <= out[key]["median"], key  # a tiny world can round to 0 s
    assert len(out["summary"]) == 3


def dns_bench_leftovers() -> set[str]:
    """bench_dnsproxy's bpffs directories and namespaces (``pb`` and four hex digits)."""
    pins = {p.name for p in Path("/sys/fs/bpf").iterdir() if re.fullmatch(r"palisade-pb[0-9a-f]{4}", p.name)}
    netns = Path("/run/netns")
    names = {n.name for n in netns.iterdir()} if netns.is_dir() else set()
    return pins | {n for n in names if re.fullmatch(r"pb[0-9a-f]{4}[ax]", n)}


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.timeout(240)
def test_dnsproxy_quick() -> None:
    """Every lookup answered through the proxy, each figure measured, the paced p99 against its target."""
    before = dns_bench_leftovers()
    out = run_bench("bench_dnsproxy", "--quick", timeout=200)
    assert "error" not in out, out["error"]
    rows = {row["metric"]: row for row in out["summary"]}
    assert rows["proxy latency added p99 at 1000/s"]["target"] == {"op": "<=", "value": 5.0}
    assert out["paced_answered"] > 0 and out["direct_paced_answered"] > 0
    assert out["learned_addresses"] >= out["paced_answered"]  # every proxied answer named a fresh address
    assert out["throughput_lookups_per_s"] > 0 and out["restart_gap_ms"] > 0
    first = out["first_connections"]
    assert first["connected"] > 0 and first["connected"] + first["failed"] == 200
    # The datapath's kill -9: lookups went on through the proxy (that none fails within a client's
    # retry is tests/datapath_service/test_dns_proxy_root.py's; these lookups wait 50 ms).
    assert out["datapath_kill_lookups"] > 0 and out["datapath_kill_proxied"] > 0
    assert out["datapath_kill_gap_ms"] > 0
    unanswered = rows["lookups unanswered within one retry across the datapath kill -9"]
    assert unanswered["target"] == {"op": "<=", "value": 0.0}
    assert dns_bench_leftovers() <= before, "pins or namespaces left behind"
