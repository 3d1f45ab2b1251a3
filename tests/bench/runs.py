"""A benchmark run as `make bench` runs it, for the benchmarks' tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.__main__ import run_one


def run_bench(module: str, *args: str, timeout: float) -> dict[str, Any]:
    """``python -m bench.<module> ARGS`` as `make bench` runs it (:func:`bench.__main__.run_one`): it
    must exit 0 within ``timeout`` seconds and print one JSON object, which is returned."""
    out = run_one(Path(f"{module}.py"), timeout, list(args))
    assert "error" not in out, out["error"]
    return out
