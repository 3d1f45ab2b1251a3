"""Parsing the parts of a policy that name DNS names: ``toFQDNs`` selectors and ``rules.dns``,
validated as Cilium validates them (services/common/fqdn.py holds the name and pattern rules)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.fqdn import DNS_PORT, FqdnError, validate_name, validate_pattern
from services.policy.engine.model import Direction, PortSpec
from services.policy.engine.parsecontext import ParseContext, as_list, as_map


def fqdn_selectors(ctx: ParseContext, items: list[Any], path: str) -> tuple[str, ...]:
    """The selectors of a ``toFQDNs`` list or a ``rules.dns`` list, in normal form (see ``fqdn``)."""
    out: list[str] = []
    for j, raw in enumerate(items):
        spath = f"{path}[{j}]"
        sel = as_map(ctx, raw, spath)
        given = [f for f in ("matchName", "matchPattern") if sel.get(f) not in (None, "")]
        if len(given) != 1:
            raise ctx.error(
                spath,
                "give exactly one of matchName or matchPattern"
                if given
                else "empty selector: give matchName (one name) or matchPattern (a pattern with *)",
            )
        field = given[0]
        value = sel[field]
        if not isinstance(value, str):
            raise ctx.error(f"{spath}.{field}", "must be a string")
        try:
            out.append(validate_name(value) if field == "matchName" else validate_pattern(value))
        except FqdnError as err:
            raise ctx.error(f"{spath}.{field}", str(err)) from None
    return tuple(dict.fromkeys(out))


def dns_items(ctx: ParseContext, tp: Mapping[str, Any], tpath: str, direction: Direction) -> tuple[str, ...] | None:
    """The selectors of a ``toPorts`` element's ``rules.dns`` (None when it has none)."""
    rules = as_map(ctx, tp.get("rules"), f"{tpath}.rules")
    if "dns" not in rules:
        return None
    dpath = f"{tpath}.rules.dns"
    if direction is Direction.INGRESS:
        raise ctx.error(dpath, "DNS rules are only allowed in egress rules (they filter the subject's own queries)")
    others = sorted(str(k) for k, v in rules.items() if k != "dns" and v)
    if others:
        raise ctx.error(f"{tpath}.rules", f"dns cannot be combined with {', '.join(others)} in one toPorts element")
    items = as_list(ctx, rules.get("dns"), dpath)
    return fqdn_selectors(ctx, items, dpath)


def check_dns_port(ctx: ParseContext, specs: list[PortSpec], path: str) -> None:
    for spec in specs:
        if spec.name or spec.port_low == 0:
            raise ctx.error(f"{path}.port", "DNS rules need a port number (the DNS server's, usually 53)")
        if spec.port_low != spec.port_high:
            raise ctx.error(f"{path}.endPort", "DNS rules apply to one port, not a range")
        if spec.port_low != DNS_PORT:
            ctx.unsupported_feature(
                f"{path}.port",
                f"DNS rules on port {spec.port_low}: only port {DNS_PORT} is steered to the node's DNS proxy; "
                f"queries to port {spec.port_low} are allowed, their names neither filtered nor learned",
            )
