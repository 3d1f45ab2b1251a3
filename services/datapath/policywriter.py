"""Writing one endpoint's policy into the maps, and the lock every writer of the maps holds.

Two processes write the same pins: the datapath (orders, syncs) and the node's DNS proxy (the
entries of learned addresses). Both go through :func:`write_policy` under :class:`WriterLock`,
so the hints, enforcement and the policy epoch change in one order whoever writes.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterable

from services.common.log import get_logger
from services.datapath.maps import enforcementmap
from services.datapath.maps.enforcementmap import EnforcementMap
from services.datapath.maps.policymap import PolicyMap, Prefix, PrefixMap
from services.datapath.maps.statemap import StateMap
from services.datapath.types import Enforcement, PolicyChange

log = get_logger("datapath")


def write_policy(
    policy: PolicyMap,
    enforcement_map: EnforcementMap,
    state: StateMap,
    ep_id: int,
    enforcement: Enforcement,
    writes: PrefixMap,
    stale: list[Prefix],
    exact_hints: int | None = None,
) -> PolicyChange:
    """Adds, then enforcement, then removals. Hints widen before the adds (a lookup the
    program skips is never one the map can answer) and narrow, when the caller knows the
    whole map (``exact_hints``), after the removals; an incremental change only widens them.
    Callers hold the maps' :class:`WriterLock` (the datapath and the DNS proxy both write)."""
    flags = enforcement_map.flags(ep_id)
    held = None if flags is None else enforcementmap.from_flags(flags)
    # The kernel's hints, not a copy: another writer of the same pins may have widened them.
    known = enforcementmap.hints_held(flags)
    widened = known | hints_of(writes)
    final = widened if exact_hints is None else exact_hints
    if widened != known:
        enforcement_map.set(ep_id, held or Enforcement(), widened)
    policy.write(writes)
    enforcement_changed = held != enforcement
    if enforcement_changed:
        enforcement_map.set(ep_id, enforcement, widened)
    policy.delete(stale)
    if final != widened:
        enforcement_map.set(ep_id, enforcement, final)
    change = PolicyChange(added=len(writes), removed=len(stale), enforcement_changed=enforcement_changed)
    if change.changed:
        state.bump_epoch()
        log.debug("policy written", endpoint=ep_id, added=change.added, removed=change.removed)
    return change


class WriterLock:
    """This process's lock (re-entrant) and, around it, an exclusive ``flock`` on the pin directory:
    the datapath and the DNS proxy process write the same maps (hints, the policy epoch)."""

    def __init__(self, base_dir: str) -> None:
        self._thread = threading.RLock()
        self._fd = os.open(base_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._depth = 0

    def __enter__(self) -> WriterLock:
        self._thread.acquire()
        if self._depth == 0 and self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread.release()

    def close(self) -> None:
        """Once its holder is closed (the process lock alone then guards the closed check)."""
        with self._thread:
            if self._fd >= 0 and self._depth == 0:
                os.close(self._fd)
                self._fd = -1


def hints_of(prefixes: Iterable[Prefix]) -> int:
    return enforcementmap.hints((p.direction, p.verdict, p.identity, p.protocol) for p in prefixes)
