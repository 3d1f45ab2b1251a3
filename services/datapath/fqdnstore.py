"""The DNS proxy's learned names on disk (the datapath's state dir), restored before it serves.

A snapshot (``fqdn.json``, :meth:`NameCache.to_json`) plus a journal (``fqdn.journal``) of the
answers learned since, one JSON line each, appended before the answer is released: a lookup
costs one short append, not a rewrite of every name. Loading replays the journal over the
snapshot (the cache's bounds evict the same pairs again), then :meth:`NameStore.compact` writes a
new snapshot and empties the journal. Times on disk are wall-clock; in memory, the caller's clock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import IO, Any

from services.common.log import get_logger
from services.datapath.fqdncache import CacheLimits, NameCache

log = get_logger("dnsproxy")

SNAPSHOT = "fqdn.json"
JOURNAL = "fqdn.journal"


class NameStore:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self._journal: IO[str] | None = None

    @property
    def snapshot_path(self) -> str:
        return os.path.join(self.state_dir, SNAPSHOT)

    @property
    def journal_path(self) -> str:
        return os.path.join(self.state_dir, JOURNAL)

    def load(self, limits: CacheLimits, now: float, wall: float) -> NameCache:
        """The cache as the last run left it; an unreadable file is an error naming it (never a
        silent empty cache: the maps still hold what it learned)."""
        cache = NameCache(limits)
        if os.path.exists(self.snapshot_path):
            try:
                with open(self.snapshot_path, encoding="utf-8") as f:
                    cache = NameCache.from_json(json.load(f), limits, now, wall)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{self.snapshot_path}: the DNS proxy's learned names cannot be read ({exc}); "
                    "move the file away to start with no learned names"
                ) from None
        replayed = 0
        if os.path.exists(self.journal_path):
            with open(self.journal_path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    try:
                        rec = json.loads(line)
                        learned = float(rec["wall"]) - wall + now
                        answers = [(str(ip), float(ttl)) for ip, ttl in rec["answers"]]
                        cache.learn(int(rec["endpoint"]), str(rec["name"]), answers, learned)
                        replayed += 1
                    except (ValueError, KeyError, TypeError):
                        # The last line of a killed run may be cut short; anything else is named.
                        log.warning("DNS journal line unreadable, skipped", path=self.journal_path, line=number)
        log.info("learned names restored", pairs=len(cache.pairs()), replayed=replayed)
        return cache

    def append(self, endpoint: int, name: str, answers: Iterable[tuple[str, float]], wall: float) -> None:
        if self._journal is None:
            os.makedirs(self.state_dir, exist_ok=True)
            self._journal = open(self.journal_path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        rec: dict[str, Any] = {"endpoint": endpoint, "name": name, "answers": list(answers), "wall": wall}
        self._journal.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._journal.flush()

    def compact(self, cache: NameCache, now: float, wall: float) -> None:
        """A new snapshot (written aside, then renamed), then an empty journal."""
        os.makedirs(self.state_dir, exist_ok=True)
        tmp = self.snapshot_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cache.to_json(now, wall), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        self.close()
        with open(self.journal_path, "w", encoding="utf-8"):
            pass

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
