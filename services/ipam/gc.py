"""When an unreferenced identity may be collected. Pure: the caller passes what etcd holds and the time.

An identity is due once it has been seen without references for ``grace``
seconds *and* its ``id`` key has not been written since (every reference taken
rewrites it, see :mod:`services.ipam.keys`), so a reference taken and dropped
between two passes restarts the grace period. The deletion itself is a
transaction guarded by the same facts, so a stale decision never deletes a
used identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping


@dataclasses.dataclass(slots=True)
class _Unused:
    since: float
    mod_revision: int


class GcTracker:
    """Remembers since when each identity has been unreferenced."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._unused: dict[int, _Unused] = {}

    def observe(self, identities: Mapping[int, int], referenced: Collection[int], now: float) -> list[tuple[int, int]]:
        """Record one pass: ``identities`` maps id -> mod revision of its id key.

        Returns (id, mod revision) of the identities due for collection.
        """
        due = []
        for gone in set(self._unused) - set(identities):
            del self._unused[gone]
        for ident, mod in identities.items():
            if ident in referenced:
                self._unused.pop(ident, None)
                continue
            seen = self._unused.get(ident)
            if seen is None or seen.mod_revision != mod:
                self._unused[ident] = _Unused(now, mod)
                seen = self._unused[ident]
            if now - seen.since >= self.grace:
                due.append((ident, mod))
        return sorted(due)

    def forget(self, identity: int) -> None:
        self._unused.pop(identity, None)

    def pending(self) -> int:
        """Identities currently waiting out their grace period."""
        return len(self._unused)
