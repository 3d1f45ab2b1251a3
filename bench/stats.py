"""Order statistics, targets and process measurements shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The sample at quantile ``q`` (0..1), nearest rank."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def stats_ms(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """p50/p90/p99, mean, min and max of ``values`` (already in milliseconds)."""
    return {
        "p50": round(percentile(values, 0.50), digits),
        "p90": round(percentile(values, 0.90), digits),
        "p99": round(percentile(values, 0.99), digits),
        "mean": round(statistics.fmean(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def target(op: str, bound: float) -> dict[str, Any]:
    """A target for a summary row: ``{"op": "<=" | ">=", "value": bound}``."""
    if op not in ("<=", ">="):
        raise ValueError(f"target op must be '<=' or '>=', not {op!r}")
    return {"op": op, "value": float(bound)}


def target_met(value: float, goal: Mapping[str, Any]) -> bool:
    bound = float(goal["value"])
    return value <= bound if goal["op"] == "<=" else value >= bound


def rss_mib(pid: int) -> float:
    """VmRSS of a process in MiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except FileNotFoundError:
        pass
    return 0.0


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def round_to(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def summarize_bpf(samples: dict[str, list[dict[str, dict[str, float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant and workload, the median of every field over the repetitions."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, reps in samples.items():
        out[name] = {
            workload: {key: round_to(median([r[workload][key] for r in reps])) for key in reps[0][workload]}
            for workload in reps[0]
        }
    return out


def quartiles(values: Sequence[float]) -> list[float]:
    if len(values) < 2:
        return [round_to(v) for v in (*values, *values)][:2]
    q = statistics.quantiles(values, n=4)
    return [round_to(q[0]), round_to(q[2])]


def peak_rss_mib(pid: int) -> float:
    """VmHWM (the highest RSS so far) of a process in MiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except FileNotFoundError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    # After the command: state is field 3, utime and stime are fields 14 and 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
