"""Learned names into the BPF maps: ipcache entries and the FQDN policy entries of endpoints.

:func:`desired` (pure) computes, from the name cache and the local endpoints' FQDN rules,
the ipcache entries (each learned address -> its node-local identity) and the egress
entries of every endpoint whose rules select a learned name. :class:`NameMaps` writes the
difference to what it wrote before: new ipcache entries and policy entries first, then
removals, so an address the proxy is about to release in an answer is allowed before the
pod can use it, and one that expired is removed from policies before its identity is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Protocol

from services.common.log import get_logger
from services.datapath import fqdnmatch
from services.datapath.fqdncache import NameCache, host_prefix
from services.datapath.types import NameRules, PolicyChange, PolicyEntry

log = get_logger("fqdn")


@dataclasses.dataclass(frozen=True)
class NameEndpoint:
    """A local endpoint as the DNS proxy sees it."""

    ep_id: int
    identity: int
    ips: tuple[str, ...]
    rules: NameRules


class PolicyMaps(Protocol):
    """The part of the BPF facade the proxy writes (blocking calls)."""

    def ipcache_upsert(self, prefix: str, identity: int) -> None: ...

    def ipcache_delete(self, prefix: str) -> bool: ...

    def apply_entries(
        self,
        ep_id: int,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange: ...


def desired(cache: NameCache, endpoints: Iterable[NameEndpoint]) -> tuple[dict[str, int], dict[int, set[PolicyEntry]]]:
    """The ipcache entries and per-endpoint policy entries the learned names give."""
    ipcache = cache.ipcache()
    pairs = cache.pairs()
    entries: dict[int, set[PolicyEntry]] = {}
    for ep in endpoints:
        mine: set[PolicyEntry] = set()
        for rule in ep.rules.fqdn:
            for pair in pairs:
                ident = cache.identity(pair.ip)
                if ident is not None and fqdnmatch.match(rule.selector, pair.name):
                    mine.add(rule.entry(ident))
        entries[ep.ep_id] = mine
    return ipcache, entries


class NameMaps:
    """Keeps the maps equal to :func:`desired`, writing only differences."""

    def __init__(self, maps: PolicyMaps) -> None:
        self._maps = maps
        self.ipcache: dict[str, int] = {}
        self.entries: dict[int, set[PolicyEntry]] = {}

    def sync(self, cache: NameCache, endpoints: Iterable[NameEndpoint]) -> None:
        eps = {ep.ep_id: ep for ep in endpoints}
        ipcache, entries = desired(cache, eps.values())
        for prefix, ident in ipcache.items():
            if self.ipcache.get(prefix) != ident:
                self._maps.ipcache_upsert(prefix, ident)
                self.ipcache[prefix] = ident
        for ep_id, want in entries.items():
            have = self.entries.get(ep_id, set())
            if want != have:
                keep = want & have
                self._maps.apply_entries(ep_id, add=want - have, remove=have - want, keep=keep)
                self.entries[ep_id] = want
        for ep_id in [e for e in self.entries if e not in eps]:
            del self.entries[ep_id]  # the endpoint is gone, and its policy map with it
        for prefix in [p for p in self.ipcache if p not in ipcache]:
            self._maps.ipcache_delete(prefix)
            del self.ipcache[prefix]

    def adopt(self, ipcache: Mapping[str, int], entries: Mapping[int, set[PolicyEntry]]) -> None:
        """What a previous run wrote (read back from the maps), so the next sync removes only the stale."""
        self.ipcache = dict(ipcache)
        self.entries = {k: set(v) for k, v in entries.items()}

    def adopt_endpoint(self, ep_id: int, entries: set[PolicyEntry]) -> None:
        self.entries[ep_id] = set(entries)


__all__ = ["NameEndpoint", "NameMaps", "PolicyMaps", "desired", "host_prefix"]
