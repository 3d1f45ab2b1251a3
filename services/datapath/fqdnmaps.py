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
import ipaddress
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


class CidrPrefixes:
    """The ipcache's CIDR prefixes, for a learned address's former identity: the longest prefix
    holding it, in one dict probe per prefix length held (not a scan of every prefix)."""

    def __init__(self, prefixes: Mapping[str, int]) -> None:
        self.held = dict(prefixes)
        by_length: dict[tuple[int, int], dict[int, int]] = {}
        for prefix, ident in self.held.items():
            net = ipaddress.ip_network(prefix, strict=False)
            by_length.setdefault((net.version, net.prefixlen), {})[int(net.network_address)] = ident
        self._lengths = sorted(by_length.items(), key=lambda item: -item[0][1])

    def longest(self, ip: str) -> int | None:
        address = ipaddress.ip_address(ip)
        bits, value = address.max_prefixlen, int(address)
        for (version, length), networks in self._lengths:
            if version == address.version:
                found = networks.get(value >> (bits - length) << (bits - length))
                if found is not None:
                    return found
        return None

    def exact(self, prefix: str) -> int | None:
        """The identity of exactly ``prefix`` (a learned /32 takes its place in the map)."""
        return self.held.get(prefix)


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

    def __init__(
        self, maps: PolicyMaps, base: BaseIdentity, underneath: Callable[[str], int | None] = lambda _: None
    ) -> None:
        self._maps = maps
        self._base = base
        #: The CIDR identity of exactly a learned address's /32, put back when the address goes.
        self._underneath = underneath
        self.ipcache: dict[str, int] = {}
        #: Per endpoint, the entries written and how many learned pairs call for each.
        self.entries: dict[int, Counter[PolicyEntry]] = {}
        #: Per endpoint, the entries written by remote identity (what a change re-encodes beside
        #: its own entries, found without a scan of every entry).
        self._by_remote: dict[int, dict[int, set[PolicyEntry]]] = {}

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
            self._held(ep_id, want)
        for ep_id in [e for e in self.entries if e not in eps]:
            del self.entries[ep_id]  # the endpoint is gone, and its policy map with it
            self._by_remote.pop(ep_id, None)
        for prefix in [p for p in self.ipcache if p not in ipcache]:
            self._release(prefix)

    def _held(self, ep_id: int, counts: Counter[PolicyEntry]) -> None:
        self.entries[ep_id] = counts
        index: dict[int, set[PolicyEntry]] = {}
        for entry in counts:
            index.setdefault(entry.key.remote_identity, set()).add(entry)
        self._by_remote[ep_id] = index

    def change(
        self,
        cache: NameCache,
        endpoints: Iterable[NameEndpoint],
        added: Iterable[tuple[str, str]],
        removed: Iterable[tuple[str, str]],
    ) -> None:
        """Pairs the cache gained and lost: new addresses and entries first, then removals. Work in
        the change's size: an answer costs the same with 10 learned addresses as with 10,000."""
        eps = list(endpoints)
        added, removed = list(added), list(removed)
        gained: dict[int, set[PolicyEntry]] = {ep.ep_id: set() for ep in eps}
        lost: dict[int, set[PolicyEntry]] = {ep.ep_id: set() for ep in eps}
        for name, ip in added:
            ident = cache.identity(ip)
            prefix = host_prefix(ip)
            self._base(ip)  # the former identity, asked before the /32 hides it
            if ident is not None and self.ipcache.get(prefix) != ident:
                self._maps.ipcache_upsert(prefix, ident)
                self.ipcache[prefix] = ident
            for ep in eps:
                counts = self.entries.setdefault(ep.ep_id, Counter())
                for entry in _entries_for(ep, name, ip, ident, self._base):
                    held = counts.get(entry, 0)
                    if held <= 0:
                        gained[ep.ep_id].add(entry)
                        lost[ep.ep_id].discard(entry)
                    counts[entry] = max(held, 0) + 1
        for name, ip in removed:
            ident = self.ipcache.get(host_prefix(ip))
            for ep in eps:
                counts = self.entries.setdefault(ep.ep_id, Counter())
                for entry in _entries_for(ep, name, ip, ident, self._base):
                    held = counts.get(entry, 0)
                    if held > 1:
                        counts[entry] = held - 1
                        continue
                    counts.pop(entry, None)
                    if entry in gained[ep.ep_id]:
                        gained[ep.ep_id].discard(entry)  # added and removed by this change: never written
                    elif held == 1:
                        lost[ep.ep_id].add(entry)
        for ep in eps:
            self._write_delta(ep.ep_id, gained[ep.ep_id], lost[ep.ep_id])
        for _, ip in removed:
            prefix = host_prefix(ip)
            if cache.identity(ip) is None and prefix in self.ipcache:
                self._release(prefix)

    def _release(self, prefix: str) -> None:
        """A learned address's /32 gone: removed, or given back to the CIDR prefix it hid."""
        under = self._underneath(prefix)
        if under is None:
            self._maps.ipcache_delete(prefix)
        else:
            self._maps.ipcache_upsert(prefix, under)
        del self.ipcache[prefix]

    def reassert(self, prefixes: Iterable[str]) -> None:
        """Learned /32s rewritten where the ipcache's own entry for the same prefix may have
        replaced them (a datapath that restarted replays its CIDR /32s)."""
        for prefix in prefixes:
            ident = self.ipcache.get(prefix)
            if ident is not None:
                self._maps.ipcache_upsert(prefix, ident)

    def _write_delta(self, ep_id: int, add: set[PolicyEntry], remove: set[PolicyEntry]) -> None:
        """``add`` and ``remove`` written, with the entries held beside them that share their
        (remote identity, protocol, verdict): those are encoded together."""
        if not add and not remove:
            return
        index = self._by_remote.setdefault(ep_id, {})
        for entry in remove:
            held = index.get(entry.key.remote_identity)
            if held is not None:
                held.discard(entry)
                if not held:
                    del index[entry.key.remote_identity]
        for entry in add:
            index.setdefault(entry.key.remote_identity, set()).add(entry)
        groups = {(e.key.remote_identity, e.key.protocol, e.verdict) for e in add | remove}
        keep = {
            e
            for ident in {g[0] for g in groups}
            for e in index.get(ident, ())
            if e not in add and (e.key.remote_identity, e.key.protocol, e.verdict) in groups
        }
        self._maps.apply_entries(ep_id, add=add, remove=remove, keep=keep)

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
        self.entries, self._by_remote = {}, {}
        for ep_id, held in entries.items():
            self._held(ep_id, Counter(held))

    def adopt_endpoint(self, ep_id: int, entries: set[PolicyEntry]) -> None:
        self._held(ep_id, Counter(entries))


__all__ = ["CidrPrefixes", "NameEndpoint", "NameMaps", "PolicyMaps", "desired", "host_prefix"]
