"""What the node's DNS proxy learned: names, their addresses, the addresses' identities. Pure.

Every (name, address) pair an answer gave is kept until its TTL (raised to a minimum)
has passed and no open connection uses the address. Each address gets a node-local
identity from :data:`MIN_LOCAL_ID` up: above ipam's cluster (256-65535) and CIDR
(``1 << 24`` .. ``(1 << 25) - 1``) ranges, so it never collides with an identity the
cluster hands out, and no control-plane round trip stands between an answer and the
maps. Counts are bounded per name and per endpoint (the endpoints whose lookups hold a
pair); the oldest pairs go first.

The cache is plain data: :meth:`NameCache.to_json` / :meth:`NameCache.from_json` keep
it on disk across restarts, with the identities it gave, so a restored address keeps
the identity the maps and open connections already use.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from services.datapath.types import MAX_LOCAL_IDENTITY as MAX_LOCAL_ID
from services.datapath.types import MIN_LOCAL_IDENTITY as MIN_LOCAL_ID

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CacheLimits:
    """Bounds of the cache (settings of the proxy)."""

    #: Answers' TTLs are raised to this many seconds.
    min_ttl: float = 5.0
    #: At most this many addresses per name; the oldest learned are evicted first.
    max_per_name: int = 50
    #: At most this many (name, address) pairs held by one endpoint's lookups; oldest first.
    max_per_endpoint: int = 1000

    def __post_init__(self) -> None:
        if self.min_ttl < 0 or self.max_per_name < 1 or self.max_per_endpoint < 1:
            raise ValueError(
                f"DNS cache limits min_ttl={self.min_ttl} max_per_name={self.max_per_name} "
                f"max_per_endpoint={self.max_per_endpoint}: the TTL must be >= 0 and both counts >= 1"
            )


@dataclasses.dataclass
class Learned:
    """One (name, address) pair from an answer."""

    name: str
    ip: str
    #: When the pair expires (seconds, the caller's clock).
    expires: float
    #: Order of learning (a re-answer moves the pair to the newest).
    seq: int
    #: Endpoints whose lookups hold the pair.
    endpoints: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """The outcome of learning one answer: the pairs added, then the ones evicted to make room."""

    added: tuple[tuple[str, str], ...] = ()
    evicted: tuple[tuple[str, str], ...] = ()


def host_prefix(ip: str) -> str:
    address = ipaddress.ip_address(ip)
    return f"{address}/{address.max_prefixlen}"


class NameCache:
    """Indexed by name, address and endpoint, so one answer costs work in its own size, not the
    cache's (an S3-like name rotating through thousands of addresses stays cheap)."""

    def __init__(self, limits: CacheLimits = CacheLimits()) -> None:
        self.limits = limits
        self._pairs: dict[tuple[str, str], Learned] = {}
        self._by_name: dict[str, dict[str, Learned]] = {}
        #: Pairs holding each address.
        self._ip_refs: dict[str, int] = {}
        #: Each endpoint's pairs, oldest learned first.
        self._by_endpoint: dict[int, dict[tuple[str, str], None]] = {}
        self._identities: dict[str, int] = {}
        self._ids_in_use: set[int] = set()
        self._next_id = MIN_LOCAL_ID
        self._seq = 0

    # -- reading -------------------------------------------------------------------------------

    def pairs(self) -> list[Learned]:
        return sorted(self._pairs.values(), key=lambda p: p.seq)

    def names(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for pair in self.pairs():
            out.setdefault(pair.name, []).append(pair.ip)
        return out

    def __len__(self) -> int:
        return len(self._pairs)

    def identity(self, ip: str) -> int | None:
        return self._identities.get(ip)

    def ipcache(self) -> dict[str, int]:
        """Host prefix -> local identity of every address the cache holds."""
        return {host_prefix(ip): ident for ip, ident in self._identities.items()}

    # -- learning ------------------------------------------------------------------------------

    def learn(self, endpoint: int, name: str, answers: Iterable[tuple[str, float]], now: float) -> Lookup:
        """Pairs for ``name`` from one answer (address, TTL seconds), held by ``endpoint``."""
        added: list[tuple[str, str]] = []
        held = self._by_endpoint.setdefault(endpoint, {})
        for ip, ttl in answers:
            ip = str(ipaddress.ip_address(ip))
            key = (name, ip)
            self._seq += 1
            expires = now + max(ttl, self.limits.min_ttl)
            pair = self._pairs.get(key)
            if pair is None:
                pair = self._pairs[key] = Learned(name, ip, expires, self._seq)
                self._by_name.setdefault(name, {})[ip] = pair
                self._ip_refs[ip] = self._ip_refs.get(ip, 0) + 1
                self._allocate(ip)
                added.append(key)
            else:
                pair.expires = max(pair.expires, expires)
                pair.seq = self._seq
            pair.endpoints.add(endpoint)
            held.pop(key, None)
            held[key] = None  # the newest of this endpoint's
        evicted = self._bound_name(name) + self._bound_endpoint(endpoint)
        # Added pairs include any this answer's own bounds evicted (in ``evicted`` too): a consumer
        # that applies both, added first, ends where the cache is.
        return Lookup(tuple(added), tuple(evicted))

    def expire(self, now: float, in_use: set[str]) -> list[tuple[str, str]]:
        """Removes pairs past their TTL whose address no open connection uses."""
        gone = [k for k, p in self._pairs.items() if p.expires <= now and p.ip not in in_use]
        for key in gone:
            self._drop(key)
        return gone

    def has_expired(self, now: float) -> bool:
        return any(p.expires <= now for p in self._pairs.values())

    def forget_endpoint(self, endpoint: int) -> list[tuple[str, str]]:
        """The endpoint is gone: pairs only it held are removed."""
        gone = []
        for key in self._by_endpoint.pop(endpoint, {}):
            pair = self._pairs[key]
            pair.endpoints.discard(endpoint)
            if not pair.endpoints:
                gone.append(key)
                self._drop(key)
        return gone

    def endpoints(self) -> set[int]:
        return set(self._by_endpoint)

    def _allocate(self, ip: str) -> None:
        if ip in self._identities:
            return
        for _ in range(MAX_LOCAL_ID - MIN_LOCAL_ID + 1):
            candidate = self._next_id
            self._next_id = MIN_LOCAL_ID if candidate >= MAX_LOCAL_ID else candidate + 1
            if candidate not in self._ids_in_use:
                self._identities[ip] = candidate
                self._ids_in_use.add(candidate)
                return
        raise RuntimeError("every node-local identity is in use; lower the DNS cache limits")

    def _drop(self, key: tuple[str, str]) -> None:
        pair = self._pairs.pop(key)
        name, ip = key
        by_name = self._by_name[name]
        del by_name[ip]
        if not by_name:
            del self._by_name[name]
        for endpoint in pair.endpoints:
            self._by_endpoint.get(endpoint, {}).pop(key, None)
        refs = self._ip_refs[ip] - 1
        if refs:
            self._ip_refs[ip] = refs
        else:
            del self._ip_refs[ip]
            ident = self._identities.pop(ip, None)
            if ident is not None:
                self._ids_in_use.discard(ident)

    def _bound_name(self, name: str) -> list[tuple[str, str]]:
        mine = sorted(self._by_name.get(name, {}).values(), key=lambda p: p.seq)
        over = mine[: max(0, len(mine) - self.limits.max_per_name)]
        for pair in over:
            self._drop((pair.name, pair.ip))
        return [(p.name, p.ip) for p in over]

    def _bound_endpoint(self, endpoint: int) -> list[tuple[str, str]]:
        held = self._by_endpoint.get(endpoint, {})
        evicted = []
        while len(held) > self.limits.max_per_endpoint:
            key = next(iter(held))
            del held[key]
            pair = self._pairs[key]
            pair.endpoints.discard(endpoint)
            if not pair.endpoints:
                self._drop(key)
                evicted.append(key)
        return evicted

    # -- disk ----------------------------------------------------------------------------------

    def to_json(self, now: float, wall: float) -> dict[str, Any]:
        """Expiries as wall-clock times (``wall`` is the wall clock at ``now``)."""
        return {
            "format": FORMAT,
            "next_id": self._next_id,
            "identities": dict(self._identities),
            "pairs": [
                {"name": p.name, "ip": p.ip, "expires": p.expires - now + wall, "endpoints": sorted(p.endpoints)}
                for p in self.pairs()
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], limits: CacheLimits, now: float, wall: float) -> NameCache:
        if data.get("format") != FORMAT:
            raise ValueError(f"DNS cache format {data.get('format')!r} is not {FORMAT}")
        cache = cls(limits)
        cache._next_id = int(data["next_id"])
        identities = {str(ip): int(ident) for ip, ident in data["identities"].items()}
        for ip, ident in identities.items():
            if not MIN_LOCAL_ID <= ident <= MAX_LOCAL_ID:
                raise ValueError(f"DNS cache: identity {ident} of {ip} is outside the node-local range")
        for raw in data["pairs"]:
            cache._seq += 1
            pair = Learned(
                str(raw["name"]),
                str(ipaddress.ip_address(raw["ip"])),
                float(raw["expires"]) - wall + now,
                cache._seq,
                {int(e) for e in raw["endpoints"]},
            )
            key = (pair.name, pair.ip)
            cache._pairs[key] = pair
            cache._by_name.setdefault(pair.name, {})[pair.ip] = pair
            cache._ip_refs[pair.ip] = cache._ip_refs.get(pair.ip, 0) + 1
            for endpoint in pair.endpoints:
                cache._by_endpoint.setdefault(endpoint, {})[key] = None
        cache._identities = {ip: ident for ip, ident in identities.items() if ip in cache._ip_refs}
        cache._ids_in_use = set(cache._identities.values())
        for ip in cache._ip_refs.keys() - cache._identities.keys():
            cache._allocate(ip)
        return cache
