"""The datapath's side of the DNS proxy: which endpoints it serves, and their steering.

The datapath owns endpoints and their policy; the proxy (a process of its own, see
``dnsproxyd``) learns names for them. After every change the datapath publishes the local
endpoints with name rules to ``dns-endpoints.json`` in its state dir (written aside, then
renamed), then writes their ``dns_steering`` entries: a query steered to the proxy always
finds its endpoint in the file, and the proxy re-reads the file when a query names an endpoint
or rule it does not know yet. The entries stay while either process restarts.

The file also carries the ipcache's CIDR prefixes (those holding ipam's CIDR identities): a
learned address keeps what its former identity allowed, the longest of those prefixes holding
it (else world), and the learned /32 hides that prefix in the LPM map, so the proxy takes the
prefixes from here and follows them as policies add and remove CIDRs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from services.common.log import get_logger
from services.datapath.fqdnmaps import NameEndpoint
from services.datapath.maps.dnsmap import DNS_PORT
from services.datapath.types import Direction, DnsRule, FqdnRule, L4Proto, NameRules, PolicyEntry, PolicyKey, Verdict

log = get_logger("dnsproxy")

FILE = "dns-endpoints.json"
FORMAT = 1


def steering_of(endpoints: Iterable[NameEndpoint]) -> tuple[set[tuple[int, int, int]], list[str]]:
    """The dns_steering keys the endpoints' DNS rules need, and what cannot be steered. Pure."""
    keys: set[tuple[int, int, int]] = set()
    problems: list[str] = []
    for ep in endpoints:
        for rule in ep.rules.dns:
            if rule.port != DNS_PORT:
                problems.append(
                    f"endpoint {ep.ep_id}: a DNS rule on port {rule.port} is not steered to the DNS proxy "
                    f"(only port {DNS_PORT} is); its queries are allowed but not filtered or learned"
                )
                continue
            protocols = (L4Proto.UDP, L4Proto.TCP) if rule.protocol is L4Proto.ANY else (rule.protocol,)
            keys.update((ep.ep_id, rule.port, p.number) for p in protocols)
    return keys, problems


# --- the file -------------------------------------------------------------------------------------


def _rules_to_json(rules: NameRules) -> dict[str, Any]:
    return {
        "fqdn": [[r.selector, r.protocol.value, r.port_low, r.port_high, r.verdict.value] for r in rules.fqdn],
        "dns": [[r.remote_identity, r.protocol.value, r.port, list(r.selectors)] for r in rules.dns],
    }


def _rules_from_json(data: dict[str, Any]) -> NameRules:
    return NameRules(
        fqdn=tuple(FqdnRule(s, L4Proto(p), lo, hi, Verdict(v)) for s, p, lo, hi, v in data["fqdn"]),
        dns=tuple(DnsRule(i, L4Proto(p), port, tuple(sel)) for i, p, port, sel in data["dns"]),
    )


def _entry_to_json(e: PolicyEntry) -> list[Any]:
    k = e.key
    return [k.direction.value, k.remote_identity, k.protocol.value, k.port_low, k.port_high, e.verdict.value, k.audit]


def _entry_from_json(raw: list[Any]) -> PolicyEntry:
    direction, remote, protocol, low, high, verdict, audit = raw
    key = PolicyKey(Direction(direction), int(remote), L4Proto(protocol), int(low), int(high), bool(audit))
    return PolicyEntry(key, Verdict(verdict))


@dataclasses.dataclass(frozen=True)
class Published:
    """What the datapath published: the endpoints with name rules, and the ipcache's CIDR prefixes."""

    endpoints: list[NameEndpoint]
    prefixes: dict[str, int] = dataclasses.field(default_factory=dict)


def encode(endpoints: Iterable[NameEndpoint], prefixes: Mapping[str, int] | None = None) -> str:
    eps = sorted(endpoints, key=lambda e: e.ep_id)
    body = [
        {
            "id": e.ep_id,
            "identity": e.identity,
            "ips": list(e.ips),
            "rules": _rules_to_json(e.rules),
            "aliased": [_entry_to_json(x) for x in sorted(e.aliased)],
        }
        for e in eps
    ]
    cidrs = sorted([p, i] for p, i in (prefixes or {}).items())
    return json.dumps({"format": FORMAT, "endpoints": body, "prefixes": cidrs}, sort_keys=True)


def decode(text: str) -> Published:
    data = json.loads(text)
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r} is not {FORMAT}")
    endpoints = [
        NameEndpoint(
            int(e["id"]),
            int(e["identity"]),
            tuple(e["ips"]),
            _rules_from_json(e["rules"]),
            tuple(_entry_from_json(x) for x in e["aliased"]),
        )
        for e in data["endpoints"]
    ]
    # A file from before the prefixes were published has none: every learned address was world.
    return Published(endpoints, {str(p): int(i) for p, i in data.get("prefixes", [])})


class NameSource:
    """The proxy's reader of the file: the endpoints when the file changed since the last read."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, FILE)
        self._seen: tuple[int, int] | None = None

    def read_if_changed(self) -> Published | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns)
        if stamp == self._seen:
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                published = decode(f.read())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("DNS endpoints file unreadable; keeping the last one", path=self.path, error=str(exc))
            return None
        self._seen = stamp
        return published


# --- the datapath's publisher ----------------------------------------------------------------------


class SteeringMaps(Protocol):
    def dns_steer_set(self, ep_id: int, port: int, protocol: int, proxy_port: int) -> None: ...

    def dns_steer_delete(self, ep_id: int, port: int, protocol: int) -> bool: ...

    def dns_steer_dump(self) -> dict[tuple[int, int, int], int]: ...


class NamePublisher:
    """Publishes the endpoints with name rules and the ipcache's CIDR prefixes, then makes the
    steering entries match the endpoints."""

    def __init__(self, state_dir: str, maps: SteeringMaps, proxy_port: int, *, await_prefixes: bool = False) -> None:
        """``await_prefixes``: the CIDR prefixes come later (:meth:`publish_prefixes`, once the
        ipcache is loaded), and the file is written only once both are known, so a restarted
        datapath never tells the proxy that the prefixes are gone."""
        self.path = os.path.join(state_dir, FILE)
        self._maps = maps
        self.proxy_port = proxy_port
        self._prefixes: dict[str, int] | None = None if await_prefixes else {}
        self._endpoints: list[NameEndpoint] | None = None
        self._last: str | None = None
        self.problems: list[str] = []

    def publish_prefixes(self, prefixes: Mapping[str, int]) -> bool:
        """The ipcache's CIDR prefixes changed (or were loaded); False when the file did not."""
        self._prefixes = dict(prefixes)
        return self._write()

    def publish(self, endpoints: Sequence[NameEndpoint]) -> bool:
        """False when nothing changed since the last publication."""
        self._endpoints = list(endpoints)
        return self._write()

    def _write(self) -> bool:
        if self._endpoints is None or self._prefixes is None:
            return False
        # Endpoints without name rules still take learned addresses' former entries (aliased).
        text = encode((e for e in self._endpoints if e.rules.fqdn or e.rules.dns or e.aliased), self._prefixes)
        if text == self._last:
            return False
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, self.path)
        self._last = text
        self._steer(self._endpoints)
        return True

    def _steer(self, endpoints: Sequence[NameEndpoint]) -> None:
        """The steering entries, after the file names every endpoint they steer."""
        keys, problems = steering_of(endpoints)
        for problem in problems:
            if problem not in self.problems:
                log.error("DNS rule not steered", problem=problem)
        self.problems = problems
        held = self._maps.dns_steer_dump()
        for key in keys:
            if held.get(key) != self.proxy_port:
                self._maps.dns_steer_set(*key, self.proxy_port)
        for key in held.keys() - keys:
            self._maps.dns_steer_delete(*key)
