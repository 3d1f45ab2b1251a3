"""The kernel's BPF run-time accounting (BPF_ENABLE_STATS), as the benchmarks read it: what a
program's runs cost in nanoseconds, measured in the kernel, far less sensitive to the machine's
load than a rate. It costs a little per run while on, so a benchmark turns it on only around the
samples that read it, never during its measured rounds."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Mapping

from services.datapath.maps.bpf import check, libbpf, prog_info

BPF_STATS_RUN_TIME = 0


def prog_run_stats(fd: int) -> tuple[int, int]:
    """Total run time (ns) and run count the kernel has accounted to a program."""
    info = prog_info(fd)
    return int(info.run_time_ns), int(info.run_cnt)


@contextlib.contextmanager
def bpf_run_stats() -> Iterator[None]:
    """Kernel BPF run-time accounting, on while the context lasts (BPF_ENABLE_STATS: off when the fd
    closes, even if this process dies)."""
    fn = libbpf().bpf_enable_stats
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    fd = check(fn(BPF_STATS_RUN_TIME), "bpf_enable_stats")
    try:
        yield
    finally:
        os.close(fd)


def snapshot(fds: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(run time ns, runs) of each named program now."""
    return {name: prog_run_stats(fd) for name, fd in fds.items()}


def runs_between(
    before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]
) -> tuple[dict[str, float], int]:
    """Per program, its runs and ns per run between two snapshots; and the total ns of all of them."""
    row: dict[str, float] = {}
    total_ns = 0
    for name in before:
        ns, runs = after[name][0] - before[name][0], after[name][1] - before[name][1]
        total_ns += ns
        row[f"{name}_runs"] = runs
        row[f"{name}_ns_per_run"] = round(ns / runs, 1) if runs else 0.0
    return row, total_ns
