"""IPv6 between pods, and neighbour resolution (ARP, ND) under deny-all policy."""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest

from services.datapath.netns import in_netns
from services.datapath.types import Direction, Enforcement, L4Proto, Reason, Verdict
from testkit.datapathnode import Node, drops
from testkit.traffic import DENY_TIMEOUT, sctp_init_crosses, socket_in, tcp_exchange, udp_exchange
from tests.datapath.entries import entry

pytestmark = [pytest.mark.root, pytest.mark.bcc]


def test_ipv6_tcp_allowed_and_denied(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    dp.sync_policy(
        b.ep_id,
        Enforcement(ingress=True),
        [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)],
    )
    assert tcp_exchange(a.name, b.v6, 8080)
    before = drops(dp, b.ep_id, Direction.INGRESS)
    dp.read_flows(0)
    assert not tcp_exchange(a.name, b.v6, 8081, timeout=DENY_TIMEOUT)
    assert not tcp_exchange(c.name, b.v6, 8080, timeout=DENY_TIMEOUT)
    assert drops(dp, b.ep_id, Direction.INGRESS) >= before + 2
    events = [e for e in dp.read_flows(1000) if e.verdict is Verdict.DENY and e.direction is Direction.INGRESS]
    assert {(e.source_ip, e.destination_ip, e.destination_port, e.source_identity) for e in events} >= {
        (a.v6, b.v6, 8081, a.identity),
        (c.v6, b.v6, 8080, c.identity),
    }
    assert all(e.reason is Reason.DEFAULT_DENY for e in events)


def test_ipv6_udp_and_sctp(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(
        b.ep_id,
        Enforcement(ingress=True),
        [
            entry(Direction.INGRESS, a.identity, L4Proto.UDP, 5353),
            entry(Direction.INGRESS, a.identity, L4Proto.SCTP, 3868),
        ],
    )
    assert udp_exchange(a.name, b.v6, 5353)
    assert not udp_exchange(a.name, b.v6, 5354, timeout=DENY_TIMEOUT)
    assert sctp_init_crosses(a.name, b.name, b.v6, 3868)
    assert not sctp_init_crosses(a.name, b.name, b.v6, 3869, timeout=DENY_TIMEOUT)


def test_ipv6_egress_deny_entry(net: Node) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(
        a.ep_id,
        Enforcement(egress=True),
        [
            entry(Direction.EGRESS, b.identity),
            entry(Direction.EGRESS, b.identity, L4Proto.TCP, 9000, 9010, deny=True),
        ],
    )
    assert tcp_exchange(a.name, b.v6, 8080)
    assert not tcp_exchange(a.name, b.v6, 9010, timeout=DENY_TIMEOUT)
    assert tcp_exchange(a.name, b.v6, 9011)


def _neighbour_lladdr(ns: str, ip: str, family: int) -> str | None:
    from pyroute2 import IPRoute

    def lookup() -> str | None:
        with IPRoute() as ipr:
            for n in ipr.get_neighbours(family=family):
                if n.get_attr("NDA_DST") == ip and n["state"] not in (0x01, 0x20):  # not INCOMPLETE/FAILED
                    lladdr = n.get_attr("NDA_LLADDR")
                    return str(lladdr) if lladdr else None
        return None

    return in_netns(ns, lookup)


def _host_link_local(ifindex: int) -> str:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        for addr in ipr.get_addr(index=ifindex, family=socket.AF_INET6):
            ip = addr.get_attr("IFA_ADDRESS")
            if ipaddress.ip_address(ip).is_link_local:
                return str(ip)
    raise AssertionError("host veth has no link-local address")


def _sysctl(path: str, value: str) -> str:
    with open(path) as f:
        old = f.read().strip()
    with open(path, "w") as f:
        f.write(value)
    return old


def test_neighbour_discovery_and_arp_pass_under_deny_all(net: Node) -> None:
    """a enforces both directions with no entry; it still resolves its neighbours.

    For ARP, a gets an on-link route to c's address, so it must ARP for it; the
    host veth answers by proxy ARP. For ND, a resolves the host veth's link-local.
    """
    from pyroute2 import IPRoute

    dp, a, c = net.dp, net.a, net.c
    dp.sync_policy(a.ep_id, Enforcement(ingress=True, egress=True), [])
    host_ll = _host_link_local(a.net.host_ifindex)
    conf = f"/proc/sys/net/ipv4/conf/{a.net.host_ifname}/proxy_arp"
    delay = f"/proc/sys/net/ipv4/neigh/{a.net.host_ifname}/proxy_delay"
    old_proxy, old_delay = _sysctl(conf, "1"), _sysctl(delay, "0")

    def onlink_route(command: str) -> None:
        with IPRoute() as ipr:
            idx = ipr.link_lookup(ifname="eth0")[0]
            ipr.route(command, dst=f"{c.v4}/32", oif=idx, scope=253)

    in_netns(a.name, onlink_route, "replace")
    scope = _pod_eth0_index(a.name)
    try:
        deadline = time.monotonic() + 5
        v6 = v4 = None
        while time.monotonic() < deadline and not (v6 and v4):
            # Any datagram makes the kernel resolve the neighbour first; policy then drops the datagram.
            with socket_in(a.name, socket.AF_INET6, socket.SOCK_DGRAM) as s:
                s.sendto(b"x", (host_ll, 9, 0, scope))
            with socket_in(a.name, socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"x", (c.v4, 9))
            time.sleep(0.2)
            v6 = _neighbour_lladdr(a.name, host_ll, socket.AF_INET6)
            v4 = _neighbour_lladdr(a.name, c.v4, socket.AF_INET)
        assert v6 == a.net.host_mac, "IPv6 neighbour discovery must pass"
        assert v4 == a.net.host_mac, "ARP must pass"
        assert drops(dp, a.ep_id, Direction.EGRESS) >= 1, "the datagrams themselves were dropped"
    finally:
        in_netns(a.name, onlink_route, "del")
        _sysctl(conf, old_proxy)
        _sysctl(delay, old_delay)


def _pod_eth0_index(ns: str) -> int:
    return in_netns(ns, socket.if_nametoindex, "eth0")
