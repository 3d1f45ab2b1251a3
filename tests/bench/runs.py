"""A benchmark run as `make bench` runs it, for the benchmarks' tests."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from testkit.harness import ROOT


def run_bench(module: str, *args: str, timeout: float) -> dict[str, Any]:
    """``python -m bench.<module> ARGS``: it must exit 0 within ``timeout`` seconds; its stdout, one
    JSON object, is returned."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out
