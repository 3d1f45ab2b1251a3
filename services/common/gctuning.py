"""Garbage-collector settings for services that hold a whole cluster in memory.

The watcher's cache and the policy service's engine keep many long-lived objects,
and a sync allocates hundreds of thousands more at once; with CPython's default
thresholds the collector rescans them over and over (a full collection of a loaded
policy service took a quarter of a second, landing on whichever change came next).
What they hold is mostly acyclic, so rarer collections cost little memory
(``bench/bench_watcher.py --default-gc`` compares the watcher's sync with the defaults).
"""

from __future__ import annotations

import gc


def tune_gc() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700."""
    gc.set_threshold(50_000, 20, 100)


def freeze_loaded() -> None:
    """What a sync built lives as long as the objects do: move it out of every later collection."""
    gc.collect()
    gc.freeze()
