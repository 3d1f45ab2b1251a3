"""Order statistics shared by the benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


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
