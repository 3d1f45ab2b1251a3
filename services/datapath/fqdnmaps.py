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
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from services.common import fqdn
from services.common.log import get_logger
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
    #: The endpoint's entries whose remote identity is world or a CIDR identity: a learned address
    #: keeps what its former identity (the longest ipcache prefix holding it, else world) allowed.
    aliased: tuple[PolicyEntry, ...] = ()


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


#: The identity an address had before it was learned (world, or its longest CIDR prefix's).
BaseIdentity = Callable[[str], int]


def desired(
    cache: NameCache, endpoints: Iterable[NameEndpoint], base: BaseIdentity
) -> tuple[dict[str, int], dict[int, Counter[PolicyEntry]]]:
    """The ipcache entries, and per endpoint its policy entries, each with how many learned
    (name, address) pairs call for it."""
    ipcache = cache.ipcache()
    pairs = cache.pairs()
    entries: dict[int, Counter[PolicyEntry]] = {}
    for ep in endpoints:
        mine: Counter[PolicyEntry] = Counter()
        for pair in pairs:
            mine.update(_entries_for(ep, pair.name, pair.ip, cache.identity(pair.ip), base))
        entries[ep.ep_id] = mine
    return ipcache, entries


def _entries_for(ep: NameEndpoint, name: str, ip: str, ident: int | None, base: BaseIdentity) -> list[PolicyEntry]:
    """What one learned pair gives the endpoint: its toFQDNs rules' entries for the address's
    identity, and the entries its former identity had (so a learned address never loses what a
    world or CIDR rule allowed, nor escapes what one denied)."""
    if ident is None:
        return []
    out = [rule.entry(ident) for rule in ep.rules.fqdn if fqdn.matches(rule.selector, name)]
    if ep.aliased:
        former = base(ip)
        out += [
            dataclasses.replace(e, key=dataclasses.replace(e.key, remote_identity=ident))
            for e in ep.aliased
            if e.key.remote_identity == former
        ]
    return out


class NameMaps:
    """Keeps the maps equal to :func:`desired`: incrementally for an answer or an expiry
    (:meth:`change`, work in the change's size), fully for new endpoints or rules (:meth:`sync`)."""

    def __init__(self, maps: PolicyMaps, base: BaseIdentity) -> None:
        self._maps = maps
        self._base = base
        self.ipcache: dict[str, int] = {}
        #: Per endpoint, the entries written and how many learned pairs call for each.
        self.entries: dict[int, Counter[PolicyEntry]] = {}

    def sync(self, cache: NameCache, endpoints: Iterable[NameEndpoint]) -> None:
        eps = {ep.ep_id: ep for ep in endpoints}
        ipcache, entries = desired(cache, eps.values(), self._base)
        for prefix, ident in ipcache.items():
            if self.ipcache.get(prefix) != ident:
                self._maps.ipcache_upsert(prefix, ident)
                self.ipcache[prefix] = ident
        for ep_id, want in entries.items():
            have = self.entries.get(ep_id, Counter())
            self._write(ep_id, set(have), set(want))
            self.entries[ep_id] = want
        for ep_id in [e for e in self.entries if e not in eps]:
            del self.entries[ep_id]  # the endpoint is gone, and its policy map with it
        for prefix in [p for p in self.ipcache if p not in ipcache]:
            self._maps.ipcache_delete(prefix)
            del self.ipcache[prefix]

    def change(
        self,
        cache: NameCache,
        endpoints: Iterable[NameEndpoint],
        added: Iterable[tuple[str, str]],
        removed: Iterable[tuple[str, str]],
    ) -> None:
        """Pairs the cache gained and lost: new addresses and entries first, then removals."""
        eps = list(endpoints)
        added, removed = list(added), list(removed)
        before = {ep.ep_id: set(self.entries.get(ep.ep_id, ())) for ep in eps}
        for name, ip in added:
            ident = cache.identity(ip)
            prefix = host_prefix(ip)
            self._base(ip)  # the former identity, asked before the /32 hides it
            if ident is not None and self.ipcache.get(prefix) != ident:
                self._maps.ipcache_upsert(prefix, ident)
                self.ipcache[prefix] = ident
            for ep in eps:
                self.entries.setdefault(ep.ep_id, Counter()).update(_entries_for(ep, name, ip, ident, self._base))
        for name, ip in removed:
            ident = self.ipcache.get(host_prefix(ip))
            for ep in eps:
                counts = self.entries.setdefault(ep.ep_id, Counter())
                counts.subtract(_entries_for(ep, name, ip, ident, self._base))
                for entry in [e for e, n in counts.items() if n <= 0]:
                    del counts[entry]
        for ep in eps:
            self._write(ep.ep_id, before[ep.ep_id], set(self.entries.get(ep.ep_id, ())))
        for _, ip in removed:
            prefix = host_prefix(ip)
            if cache.identity(ip) is None and prefix in self.ipcache:
                self._maps.ipcache_delete(prefix)
                del self.ipcache[prefix]

    def _write(self, ep_id: int, have: set[PolicyEntry], want: set[PolicyEntry]) -> None:
        if want == have:
            return
        add, remove = want - have, have - want
        groups = {(e.key.remote_identity, e.key.protocol, e.verdict) for e in add | remove}
        keep = {e for e in want & have if (e.key.remote_identity, e.key.protocol, e.verdict) in groups}
        self._maps.apply_entries(ep_id, add=add, remove=remove, keep=keep)

    def adopt(self, ipcache: Mapping[str, int], entries: Mapping[int, set[PolicyEntry]]) -> None:
        """What a previous run wrote (read back from the maps), so the next sync removes only the stale."""
        self.ipcache = dict(ipcache)
        self.entries = {k: Counter(v) for k, v in entries.items()}

    def adopt_endpoint(self, ep_id: int, entries: set[PolicyEntry]) -> None:
        self.entries[ep_id] = Counter(entries)


__all__ = ["NameEndpoint", "NameMaps", "PolicyMaps", "desired", "host_prefix"]
