"""What the node's DNS proxy learned, as the datapath reads it from the proxy: plain data. Pure.

The proxy (``dnsproxyd``) owns the learned names (:class:`~services.datapath.fqdncache.NameCache`);
the datapath never writes them. For `palisade fqdn cache list`, `palisade fqdn names` and the
names of flows in `observe`, the datapath asks the proxy for a :class:`NamesView` (``namesapi``):
every learned (name, address) pair with its identity, TTL left and endpoints, and the toFQDNs
selectors of the endpoints. This module builds the view from the cache, carries it as JSON
between the two processes, and answers the questions the CLI asks of it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from services.common import fqdn
from services.datapath.fqdncache import NameCache
from services.datapath.fqdnmaps import NameEndpoint

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class LearnedAddress:
    """One (name, address) pair the proxy holds."""

    name: str
    ip: str
    #: The address's node-local identity.
    identity: int
    #: Seconds until the TTL runs out (negative once it has: kept while a connection uses it).
    ttl_left: float
    #: When the TTL runs out, wall-clock seconds.
    expires: float
    #: Endpoints whose lookups hold the pair, ascending.
    endpoints: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Selection:
    """A selector, the endpoints whose toFQDNs rules use it, and the learned addresses it holds."""

    selector: str
    endpoints: tuple[int, ...]
    #: (identity, address, the selected names of the address), by address.
    selected: tuple[tuple[int, str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class NamesView:
    """The proxy's learned names and the selectors in use, at one moment."""

    addresses: tuple[LearnedAddress, ...] = ()
    #: Selector -> endpoints whose toFQDNs rules use it.
    selectors: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def names_of(self, ip: str) -> list[str]:
        """The learned names of an address, sorted (none when it is not learned)."""
        try:
            address = str(ipaddress.ip_address(ip))
        except ValueError:
            return []
        return sorted({a.name for a in self.addresses if a.ip == address})

    def names_by_ip(self) -> dict[str, list[str]]:
        out: dict[str, set[str]] = {}
        for a in self.addresses:
            out.setdefault(a.ip, set()).add(a.name)
        return {ip: sorted(names) for ip, names in out.items()}

    def select(self, selector: str = "", endpoint: int | None = None) -> list[LearnedAddress]:
        """The pairs whose name ``selector`` (normal form; empty: every name) selects and, with
        ``endpoint``, that the endpoint's lookups hold; by name, then address."""
        out = [
            a
            for a in self.addresses
            if (not selector or fqdn.matches(selector, a.name)) and (endpoint is None or endpoint in a.endpoints)
        ]
        return sorted(out, key=_by_name_and_ip)

    def selections(self) -> list[Selection]:
        """Every selector in use with the addresses it holds, by selector."""
        out = []
        for selector, endpoints in sorted(self.selectors.items()):
            held: dict[str, tuple[int, set[str]]] = {}
            for a in self.addresses:
                if fqdn.matches(selector, a.name):
                    held.setdefault(a.ip, (a.identity, set()))[1].add(a.name)
            selected = tuple(
                (ident, ip, tuple(sorted(names)))
                for ip, (ident, names) in sorted(held.items(), key=lambda item: _ip_key(item[0]))
            )
            out.append(Selection(selector, tuple(sorted(endpoints)), selected))
        return out

    # -- the wire between the proxy and the datapath ----------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "addresses": [dataclasses.asdict(a) for a in self.addresses],
            "selectors": {s: list(eps) for s, eps in self.selectors.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NamesView:
        if data.get("format") != FORMAT:
            raise ValueError(f"learned names format {data.get('format')!r} is not {FORMAT}")
        addresses = tuple(
            LearnedAddress(
                str(a["name"]),
                str(a["ip"]),
                int(a["identity"]),
                float(a["ttl_left"]),
                float(a["expires"]),
                tuple(int(e) for e in a["endpoints"]),
            )
            for a in data["addresses"]
        )
        selectors = {str(s): tuple(int(e) for e in eps) for s, eps in data["selectors"].items()}
        return cls(addresses, selectors)


def view(cache: NameCache, endpoints: Iterable[NameEndpoint], now: float, wall: float) -> NamesView:
    """The view of the proxy's cache and endpoints; ``now`` on the cache's clock is ``wall``."""
    addresses = []
    for pair in cache.pairs():
        ident = cache.identity(pair.ip)
        if ident is None:
            continue
        left = pair.expires - now
        addresses.append(LearnedAddress(pair.name, pair.ip, ident, left, wall + left, tuple(sorted(pair.endpoints))))
    selectors: dict[str, set[int]] = {}
    for ep in endpoints:
        for rule in ep.rules.fqdn:
            selectors.setdefault(rule.selector, set()).add(ep.ep_id)
    return NamesView(
        tuple(sorted(addresses, key=_by_name_and_ip)), {s: tuple(sorted(eps)) for s, eps in selectors.items()}
    )


def name_filter(text: str) -> str:
    """A name or matchPattern given to filter by, in normal form; :class:`fqdn.FqdnError` naming it."""
    return fqdn.validate_pattern(text)


def _ip_key(ip: str) -> tuple[int, int]:
    address = ipaddress.ip_address(ip)
    return address.version, int(address)


def _by_name_and_ip(a: LearnedAddress) -> tuple[str, tuple[int, int]]:
    return a.name, _ip_key(a.ip)


__all__ = ["LearnedAddress", "NamesView", "Selection", "name_filter", "view"]
