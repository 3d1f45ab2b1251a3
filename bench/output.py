"""What a benchmark writes: progress lines on stderr, one JSON object on stdout.

``make bench`` (``bench/__main__.py``) reads each benchmark's stdout as its result, so
nothing else may go there: :func:`logger` gives every benchmark the same progress lines
on stderr, and :func:`run_as_json` keeps stdout for the result alone while libraries and
compilers write to fd 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

#: Writes one progress line.
Log = Callable[[str], None]


def logger(name: str) -> Log:
    """The progress log of benchmark ``name``: ``[name HH:MM:SS] message`` lines on stderr."""

    def log(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log


@contextlib.contextmanager
def stdout_reserved_for_json() -> Iterator[int]:
    """Send everything else written to fd 1 (libraries, compilers) to stderr; yield the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield saved
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """SIGTERM unwinds the benchmark as Ctrl-C does (a KeyboardInterrupt), so its cleanup runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_timed(bench: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace, log: Log) -> int:
    """Run ``bench`` under :func:`terminate_cleanly` and print its result as JSON, with ``total_s``
    its wall time; exit status 130 when it was interrupted (after its cleanup ran)."""
    started = time.monotonic()
    try:
        with terminate_cleanly():
            out = bench(args)
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc}); cleaned up")
        return 130
    out["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=2))
    return 0


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run_as_json(
    bench: Callable[[argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
    *,
    missing: Callable[[], str | None],
) -> int:
    """Run ``bench`` and print its result as JSON on stdout (only that goes there); exit 2 with an
    ``error`` object when ``missing()`` names something the machine lacks. SIGTERM and SIGHUP
    unwind the benchmark, so it cleans up."""
    problem = missing()
    if problem:
        print(json.dumps({"error": problem}))
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    with stdout_reserved_for_json() as out_fd:
        result = bench(args)
        with os.fdopen(os.dup(out_fd), "w") as out:
            out.write(json.dumps(result, indent=2) + "\n")
    return 0
