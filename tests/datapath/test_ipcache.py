"""Remote identities from the ipcache LPM trie: CIDR rules, except, world, and map contents."""

from __future__ import annotations

import pytest

from services.datapath.types import IDENTITY_WORLD, Direction, Enforcement, L4Proto, Verdict
from testkit.datapathnode import Node
from testkit.traffic import DENY_TIMEOUT, tcp_exchange
from tests.datapath.entries import entry

pytestmark = [pytest.mark.root, pytest.mark.bcc]

#: Cilium gives CIDR selectors local identities from 1<<24 up.
CIDR_ID = 16777300
EXCEPT_ID = 16777301


def test_cidr_rule_with_except(net: Node) -> None:
    """toCIDRSet {cidr: .128/25, except: [.130/32]}: the except prefix maps to another identity."""
    dp, a = net.dp, net.a
    except_prefix = f"{net.ext_except}/32"
    dp.ipcache_upsert(net.cidr, CIDR_ID)
    dp.ipcache_upsert(except_prefix, EXCEPT_ID)
    dp.sync_policy(
        a.ep_id,
        Enforcement(egress=True),
        [entry(Direction.EGRESS, CIDR_ID, L4Proto.TCP, 8080)],
    )
    assert tcp_exchange(a.name, net.ext_in, 8080)
    assert not tcp_exchange(a.name, net.ext_except, 8080, timeout=DENY_TIMEOUT), "excepted address"
    assert not tcp_exchange(a.name, net.ext_outside, 8080, timeout=DENY_TIMEOUT), "outside the CIDR is world"
    dp.read_flows(0)
    assert not tcp_exchange(a.name, net.ext_except, 8080, timeout=DENY_TIMEOUT)
    events = [e for e in dp.read_flows(1000) if e.verdict is Verdict.DENY and e.destination_ip == net.ext_except]
    assert events and events[0].destination_identity == EXCEPT_ID

    # Without the except prefix the address falls back to the /25.
    assert dp.ipcache_delete(except_prefix)
    assert tcp_exchange(a.name, net.ext_except, 8080)


def test_ipv6_cidr_rule_with_except(net: Node) -> None:
    dp, a = net.dp, net.a
    dp.ipcache_upsert(net.cidr_v6, CIDR_ID)
    dp.sync_policy(
        a.ep_id,
        Enforcement(egress=True),
        [entry(Direction.EGRESS, CIDR_ID, L4Proto.TCP, 8080)],
    )
    assert tcp_exchange(a.name, net.ext_v6, 8080)
    dp.ipcache_upsert(f"{net.ext_v6}/128", EXCEPT_ID)
    assert not tcp_exchange(a.name, net.ext_v6, 8080, timeout=DENY_TIMEOUT)
    assert dp.ipcache_dump() == {net.cidr_v6: CIDR_ID, f"{net.ext_v6}/128": EXCEPT_ID}


def test_cidr_identity_on_ingress(net: Node) -> None:
    dp, b = net.dp, net.b
    dp.ipcache_upsert(net.cidr, CIDR_ID)
    dp.sync_policy(
        b.ep_id,
        Enforcement(ingress=True),
        [entry(Direction.INGRESS, CIDR_ID, L4Proto.TCP, 9000, 9010)],
    )
    ext = net.ext.name
    assert tcp_exchange(ext, b.v4, 9005)
    assert not tcp_exchange(ext, b.v4, 8080, timeout=DENY_TIMEOUT)
    assert not tcp_exchange(net.a.name, b.v4, 9005, timeout=DENY_TIMEOUT), "a pod is not in the CIDR identity"


def test_unknown_addresses_are_world(net: Node) -> None:
    dp, a = net.dp, net.a
    dp.sync_policy(
        a.ep_id,
        Enforcement(egress=True),
        [entry(Direction.EGRESS, IDENTITY_WORLD, L4Proto.TCP, 8080)],
    )
    assert tcp_exchange(a.name, net.ext_outside, 8080)
    assert not tcp_exchange(a.name, net.b.v4, 8080, timeout=DENY_TIMEOUT), "a local pod is not world"
    # Once the address has an ipcache entry it is no longer world.
    dp.ipcache_upsert(f"{net.ext_outside}/32", CIDR_ID)
    assert not tcp_exchange(a.name, net.ext_outside, 8080, timeout=DENY_TIMEOUT)


def test_ipcache_dump_and_delete(net: Node) -> None:
    dp = net.dp
    entries = {net.cidr: CIDR_ID, f"{net.ext_except}/32": EXCEPT_ID, "fd99::/64": 16777400, "0.0.0.0/0": 2}
    for prefix, identity in entries.items():
        dp.ipcache_upsert(prefix, identity)
    assert dp.ipcache_dump() == entries
    dp.ipcache_upsert(net.cidr, CIDR_ID + 1)  # overwrite
    assert dp.ipcache_dump()[net.cidr] == CIDR_ID + 1
    assert dp.ipcache_delete("fd99::/64")
    assert not dp.ipcache_delete("fd99::/64")
    assert "fd99::/64" not in dp.ipcache_dump()
    with pytest.raises(ValueError):
        dp.ipcache_upsert("10.0.0.1/8", CIDR_ID)  # host bits set: almost certainly a caller bug
