"""`make bench`: run every benchmark under bench/ and write a dated report.

Each ``bench/bench_*.py`` is a script that prints one JSON object on stdout. It may hold:
- ``summary``: a list of {"metric", "value", "unit"} rows for the Markdown table
  (otherwise every top-level number is listed); a row may carry a ``target``
  ({"op": "<=" | ">=", "value": bound}, see ``bench.stats.target``): the report lists
  every target first, with its value and whether it is met;
- ``plots``: a list of {"name", "title", "xlabel", "ylabel", "kind": "line"|"hist",
  "series": {label: [[x, y], ...]} (line) or {label: [values...]} (hist)}.

Writes ``bench/results/<date>.json``, ``bench/results/<date>.md`` with PNG plots beside
it, and ``bench/results/latest.md`` pointing at the newest report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.stats import target_met

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_one(script: Path, timeout: float, extra: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            # As a module from the root, so every benchmark can import the project and its test harness.
            [sys.executable, "-m", f"bench.{script.stem}", *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "seconds": round(time.monotonic() - started, 1)}
    elapsed = round(time.monotonic() - started, 1)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}", "seconds": elapsed}
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": f"output is not JSON: {proc.stdout[-500:]}", "seconds": elapsed}
    data["seconds"] = elapsed
    return dict(data)


def summary_rows(name: str, data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(benchmark, metric, value, target) rows; the target cell says whether it is met."""
    if "error" in data:
        return [(name, "error", str(data["error"]).splitlines()[0][:200], "")]
    rows = data.get("summary")
    if isinstance(rows, list):
        return [(name, str(r["metric"]), _value(r), _target(r)) for r in rows]
    return [(name, k, str(v), "") for k, v in _numbers(data)]


def _value(row: dict[str, Any]) -> str:
    return f"{row['value']} {row.get('unit', '')}".strip()


def _target(row: dict[str, Any]) -> str:
    goal = row.get("target")
    if not goal:
        return ""
    unit = row.get("unit", "")
    verdict = "met" if target_met(float(row["value"]), goal) else "**not met**"
    return f"{'≤' if goal['op'] == '<=' else '≥'} {goal['value']} {unit}".strip() + f": {verdict}"


def target_lines(report: dict[str, Any]) -> list[str]:
    """The report's opening section: every target row of every benchmark, and how many are met."""
    rows = [
        (name, r)
        for name, data in report["benchmarks"].items()
        for r in (data.get("summary") or [])
        if isinstance(r, dict) and r.get("target")
    ]
    if not rows:
        return []
    met = sum(target_met(float(r["value"]), r["target"]) for _, r in rows)
    lines = ["## Targets", "", f"{met} of {len(rows)} met.", "", "| benchmark | metric | value | target |"]
    lines.append("|---|---|---|---|")
    lines += [f"| {name} | {r['metric']} | {_value(r)} | {_target(r)} |" for name, r in rows]
    return [*lines, "", "## Every figure", ""]


def _numbers(data: dict[str, Any], prefix: str = "", depth: int = 3) -> list[tuple[str, Any]]:
    """Every number in ``data``, nested dicts flattened to dotted keys."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out.append((prefix + key, value))
        elif isinstance(value, dict) and depth > 1:
            out.extend(_numbers(value, f"{prefix}{key}.", depth - 1))
    return out


def render_plots(stem: str, name: str, data: dict[str, Any], out_dir: Path) -> list[str]:
    plots = data.get("plots") or []
    if not plots:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for plot in plots:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, values in plot["series"].items():
            if plot.get("kind") == "hist":
                ax.hist(values, bins=30, alpha=0.6, label=label)
            else:
                xs, ys = zip(*values, strict=True) if values else ((), ())
                ax.plot(xs, ys, marker="o", label=label)
        if plot.get("logx"):
            ax.set_xscale("log")
        ax.set_title(plot.get("title", name))
        ax.set_xlabel(plot.get("xlabel", ""))
        ax.set_ylabel(plot.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fname = f"{stem}-{name}-{plot['name']}.png"
        fig.savefig(out_dir / fname, dpi=100)
        plt.close(fig)
        files.append(fname)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="make bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("names", nargs="*", help="only these benchmarks (e.g. engine ipam)")
    # The tuple-reuse soak runs ten minutes per cluster size, twice.
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.names:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.names]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M%SZ")
    report: dict[str, Any] = {
        "date": stem,
        "machine": {
            "python": platform.python_version(),
            "kernel": platform.release(),
            "cpus": __import__("os").cpu_count(),
        },
        "benchmarks": {},
    }
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        print(f"bench {name}...", flush=True)
        report["benchmarks"][name] = run_one(script, args.timeout, [])
        print(f"  {json.dumps(report['benchmarks'][name])[:300]}", flush=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Palisade benchmarks, {stem}", "", f"Machine: {report['machine']}", ""]
    lines += target_lines(report)
    lines += ["| benchmark | metric | value | target |", "|---|---|---|---|"]
    for name, data in report["benchmarks"].items():
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in summary_rows(name, data)]
    for name, data in report["benchmarks"].items():
        for fname in render_plots(stem, name, data, out_dir):
            lines += ["", f"![{fname}]({fname})"]
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out_dir / "latest.md").write_text(f"Latest report: [{stem}]({stem}.md)\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out_dir / (stem + '.md')}")
    failed = [n for n, d in report["benchmarks"].items() if "error" in d]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
