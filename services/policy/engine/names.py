"""Decisions on DNS names, from the rules selecting a pod: may it resolve a name (its DNS rules), and
may it connect to an address it learned for a name (its ``toFQDNs`` rules). Pure.

``palisade analyze`` (names resolved from the user's table) and ``palisade policy trace`` use these,
so both judge names as the node does:

* A pod with no DNS rule has its queries forwarded untouched (they are ordinary traffic, judged
  by its L4 policy), and the node's DNS proxy never sees them: it learns no address for the pod,
  so its ``toFQDNs`` rules allow nothing.
* A pod with DNS rules may resolve a name when one of their selectors selects it; any other
  query is refused by the proxy.
* A connection to an address is judged first as any connection (a deny wins, an allow of the
  address's own identity stands); where its egress would drop it by default, a ``toFQDNs`` rule
  selecting a name the address was learned for, on the connection's port, allows it, provided the
  pod may resolve that name (else the address is never learned).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.fqdn import matches
from services.policy.engine.model import (
    WILDCARD_IDENTITY,
    Direction,
    EntryKey,
    PolicyRef,
    Rule,
    Verdict,
)
from services.policy.engine.resolve import RuleRef

RuleSet = Iterable[tuple[PolicyRef, Rule]]


@dataclass(frozen=True, slots=True)
class NameMatch:
    """A rule that selects a name, and the selector that does."""

    rule: RuleRef
    selector: str

    def __str__(self) -> str:
        return f"{self.rule.policy}: {self.rule.peer_rule} ({self.selector})"


@dataclass(frozen=True, slots=True)
class DnsDecision:
    """Whether a pod may resolve ``name`` through the node's DNS proxy, and why."""

    name: str
    #: Some DNS rule applies to the pod's queries (they go through the proxy).
    filtered: bool
    allowed: bool
    matched: tuple[NameMatch, ...] = ()
    #: The DNS rules in force (policy: path), when no selector matched.
    rules: tuple[str, ...] = ()

    def render(self) -> str:
        if not self.filtered:
            return (
                f"DNS query {self.name}: FORWARDED (no DNS rule selects this pod: its queries are ordinary "
                "traffic, and no address is learned for its toFQDNs rules)"
            )
        if self.allowed:
            return f"DNS query {self.name}: ALLOWED\n" + "\n".join(f"  matched: {m}" for m in self.matched)
        return f"DNS query {self.name}: REFUSED (no selector of its DNS rules selects it)\n" + "\n".join(
            f"  DNS rule: {r}" for r in self.rules
        )


def dns_decision(rules: RuleSet, name: str) -> DnsDecision:
    """May the subject of ``rules`` (every rule selecting it) resolve ``name``?"""
    matched: list[NameMatch] = []
    in_force: list[str] = []
    for key, rule in rules:
        for pr in rule.peer_rules:
            if pr.direction is not Direction.EGRESS or pr.verdict is not Verdict.ALLOW:
                continue
            for dp in pr.dns:
                ref = RuleRef(key, rule.origin, pr.origin, pr.verdict)
                in_force.append(f"{ref.policy}: {pr.origin} ({', '.join(dp.selectors)})")
                matched.extend(NameMatch(ref, s) for s in dp.selectors if matches(s, name))
    return DnsDecision(name, bool(in_force), bool(matched), tuple(dict.fromkeys(matched)), tuple(in_force))


def fqdn_matches(rules: RuleSet, name: str, protocol: int, port: int) -> tuple[NameMatch, ...]:
    """The ``toFQDNs`` rules allowing a connection to an address learned for ``name`` on ``port``."""
    found: list[NameMatch] = []
    for key, rule in rules:
        for pr in rule.peer_rules:
            if pr.direction is not Direction.EGRESS or pr.verdict is not Verdict.ALLOW or not pr.fqdns:
                continue
            covered = any(
                EntryKey(Direction.EGRESS, WILDCARD_IDENTITY, s.protocol, s.port_low, s.port_high).covers(
                    protocol=protocol, port=port
                )
                for s in pr.ports
            )
            if not covered:
                continue
            ref = RuleRef(key, rule.origin, pr.origin, pr.verdict)
            found.extend(NameMatch(ref, s) for s in pr.fqdns if matches(s, name))
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True, slots=True)
class NameEgress:
    """The egress verdict of a connection to an address learned for a name."""

    allowed: bool
    #: "deny" | "allow" (decided without names) | "fqdn-rule" | "unresolvable" | "default-deny"
    reason: str
    matched: tuple[NameMatch, ...] = ()
    dns: DnsDecision | None = None

    def render(self) -> str:
        words = {
            "deny": "denied whatever the name (a deny covers the address)",
            "allow": "allowed whatever the name (an allow covers the address)",
            "fqdn-rule": "allowed by toFQDNs",
            "unresolvable": "toFQDNs selects the name, but the pod may not resolve it (no address is learned)",
            "default-deny": "no toFQDNs rule selects the name on this port",
        }
        lines = [f"toFQDNs: {'ALLOWED' if self.allowed else 'DENIED'} ({words[self.reason]})"]
        lines += [f"  matched: {m}" for m in self.matched]
        if self.dns is not None and self.reason in ("fqdn-rule", "unresolvable"):
            lines += ["  " + line for line in self.dns.render().splitlines()]
        return "\n".join(lines)


def name_egress(
    rules: Iterable[tuple[PolicyRef, Rule]], name: str, protocol: int, port: int, *, allowed: bool, by_default: bool
) -> NameEgress:
    """Combine the address's own egress verdict (``allowed``; ``by_default``: the verdict of the
    direction's default, no entry or rule covering it) with the subject's rules on ``name``."""
    ruleset = list(rules)
    if not by_default:
        return NameEgress(allowed, "allow" if allowed else "deny")
    if allowed:
        return NameEgress(True, "allow")
    found = fqdn_matches(ruleset, name, protocol, port)
    if not found:
        return NameEgress(False, "default-deny")
    dns = dns_decision(ruleset, name)
    if dns.allowed:
        return NameEgress(True, "fqdn-rule", found, dns)
    return NameEgress(False, "unresolvable", found, dns)
