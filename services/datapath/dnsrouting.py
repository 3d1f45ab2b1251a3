"""The node's policy routing for steered DNS: packets marked ``dnsmap.PROXY_MARK`` are local.

A steered query keeps its destination (the pod's DNS server); the program assigns it the proxy's
socket, and this rule makes the routing deliver it to the local stack instead of forwarding it
(as Cilium's ``ip rule fwmark 0x200/0xf00 lookup 2004`` for its transparent proxies). Idempotent;
both families. Palisade's own job on a node, done the same way in the dev cluster.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from typing import Any

from services.common.log import get_logger
from services.datapath.maps import dnsmap

log = get_logger("dnsproxy")

#: The routing table holding the local default routes.
TABLE = 2005
#: The rule's priority (before the main table's 32766).
PRIORITY = 9000

#: The rule that sends marked packets to TABLE, and TABLE's local default route (added and removed alike).
_RULE: dict[str, Any] = {
    "table": TABLE,
    "priority": PRIORITY,
    "fwmark": dnsmap.PROXY_MARK,
    "fwmask": dnsmap.PROXY_MARK_MASK,
}
_ROUTE: dict[str, Any] = {"table": TABLE, "type": "local", "scope": 254}


def install() -> None:
    """Adds the rule and the local default route of both families where they are missing."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        for family, dst in ((socket.AF_INET, "0.0.0.0/0"), (socket.AF_INET6, "::/0")):
            if not _has_rule(ipr, family):
                ipr.rule("add", family=family, **_RULE)
            try:
                ipr.route("add", family=family, dst=dst, oif=ipr.link_lookup(ifname="lo")[0], **_ROUTE)
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise
    log.info("DNS proxy routing installed", table=TABLE, mark=hex(dnsmap.PROXY_MARK))


def _has_rule(ipr: Any, family: int) -> bool:
    for rule in ipr.get_rules(family=family):
        if rule.get_attr("FRA_TABLE") == TABLE and rule.get_attr("FRA_FWMARK") == dnsmap.PROXY_MARK:
            return True
    return False


def remove() -> None:
    """Removes the rule and the table's routes (a node that no longer runs the proxy)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        for family, dst in ((socket.AF_INET, "0.0.0.0/0"), (socket.AF_INET6, "::/0")):
            while _has_rule(ipr, family):
                ipr.rule("del", family=family, **_RULE)
            with contextlib.suppress(NetlinkError, IndexError):
                ipr.route("del", family=family, dst=dst, oif=ipr.link_lookup(ifname="lo")[0], **_ROUTE)
