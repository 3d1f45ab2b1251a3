"""The node manager's logic: Node objects and ipam's CIDRs into a routing plan (no kernel)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from palisade.v1 import identity_pb2, k8s_pb2
from services.datapath.masquerade import MasqueradePlan
from services.datapath.nodes import NodeInfo, NodeRoutes, masquerade_plan, parse_node, plan
from services.datapath.routing import NodeRoute, RoutingPlan, RoutingResult


def node_object(name: str, *addresses: tuple[str, str], cidrs: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"podCIDRs": list(cidrs)} if cidrs else {},
        "status": {"addresses": [{"type": t, "address": a} for t, a in addresses]},
    }


def test_a_node_s_internal_address_comes_first_and_invalid_values_are_left_out() -> None:
    obj = node_object(
        "n",
        ("Hostname", "n"),
        ("ExternalIP", "203.0.113.7"),
        ("InternalIP", "not-an-ip"),
        ("InternalIP", "10.0.0.7"),
        cidrs=("10.244.3.0/24", "bogus"),
    )
    assert parse_node("n", obj) == NodeInfo("n", ("10.0.0.7", "203.0.113.7"), ("10.244.3.0/24",))


NODES = {
    "a": NodeInfo("a", ("172.31.0.10",)),
    "b": NodeInfo("b", ("172.31.0.11", "fd00::11")),
    "c": NodeInfo("c", ()),
}
CIDRS = {"a": ["10.244.0.0/24"], "b": ["10.244.1.0/24", "fd10::/64"], "c": ["10.244.2.0/24"]}


def test_direct_routes_every_other_node_s_cidrs_via_its_address_of_that_family() -> None:
    routes, skipped = plan("a", NODES, CIDRS, "direct")
    assert routes.routes == (
        NodeRoute("10.244.1.0/24", "172.31.0.11", "b"),
        NodeRoute("fd10::/64", "fd00::11", "b"),
    )
    assert routes.local_address == "172.31.0.10"
    assert skipped == ["10.244.2.0/24 of node c: the node has no IPv4 address"]


def test_the_tunnel_carries_only_the_cidrs_of_its_underlay_s_family() -> None:
    routes, skipped = plan("a", NODES, CIDRS, "tunnel")
    assert [r.prefix for r in routes.routes] == ["10.244.1.0/24"]
    assert "fd10::/64 of node b: the tunnel's underlay is not IPv6" in skipped


class FakeRouting:
    def __init__(self) -> None:
        self.plans: list[RoutingPlan] = []

    def apply(self, plan: RoutingPlan) -> RoutingResult:
        self.plans.append(plan)
        return RoutingResult(len(plan.routes), 0)


class FakeMasquerade:
    def __init__(self) -> None:
        self.plans: list[MasqueradePlan] = []

    def apply(self, plan: MasqueradePlan) -> None:
        self.plans.append(plan)


class FakeIpam:
    def __init__(self, cidrs: dict[str, list[str]]) -> None:
        self.cidrs = cidrs
        self.down = False
        self.asked: list[str] = []

    async def node_cidrs(self, node: str) -> list[str]:
        self.asked.append(node)
        if self.down:
            raise ConnectionError("ipam is away")
        return self.cidrs[node]


def delta(name: str, obj: dict[str, Any] | None) -> k8s_pb2.K8sDelta:
    op = k8s_pb2.DELTA_OP_DELETE if obj is None else k8s_pb2.DELTA_OP_UPSERT
    return k8s_pb2.K8sDelta(name=name, op=op, object_json=json.dumps(obj or {}).encode())


@pytest.mark.parametrize("ipam_down", [False, True])
def test_node_changes_become_routes_and_masquerade_and_a_gone_node_s_routes_go(ipam_down: bool) -> None:
    async def body() -> None:
        routing, masq = FakeRouting(), FakeMasquerade()
        ipam = FakeIpam({"a": ["10.244.0.0/24"], "b": ["10.244.1.0/24"]})
        ipam.down = ipam_down
        nodes = NodeRoutes("a", "direct", routing, ipam, masquerade=masq, non_masquerade=["192.168.0.0/16"])
        await nodes._on_node("", delta("a", node_object("a", ("InternalIP", "172.31.0.10"), cidrs=("10.244.0.0/24",))))
        await nodes._on_node("", delta("b", node_object("b", ("InternalIP", "172.31.0.11"), cidrs=("10.244.1.0/24",))))
        await nodes.reconcile()
        # From ipam, or (ipam away) from the Node's own spec.podCIDRs.
        assert routing.plans[-1].routes == (NodeRoute("10.244.1.0/24", "172.31.0.11", "b"),)
        assert masq.plans[-1].sources == ("10.244.0.0/24",)
        assert set(masq.plans[-1].keep) >= {"10.244.1.0/24", "172.31.0.11/32", "192.168.0.0/16"}
        await nodes._on_node("", delta("b", None))
        await nodes.reconcile()
        assert not routing.plans[-1].routes
        assert "10.244.1.0/24" not in masq.plans[-1].keep

    asyncio.run(body())


POD_ADDRESSES = {
    "10.0.1.1/32": "b",  # outside every pod CIDR: a host route via b
    "10.244.1.7/32": "b",  # inside b's CIDR: its CIDR's route is enough
    "10.0.1.2/32": "c",  # outside, but c has no IPv4 address
}


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
def test_pods_outside_every_pod_cidr_get_a_host_route_via_their_node(mode: str) -> None:
    routes, skipped = plan("a", NODES, CIDRS, mode, pod_addresses=POD_ADDRESSES)
    assert NodeRoute("10.0.1.1/32", "172.31.0.11", "b") in routes.routes
    assert not [r for r in routes.routes if r.prefix == "10.244.1.7/32"]
    assert "10.0.1.2/32 of node c: the node has no IPv4 address" in skipped
    keep = masquerade_plan("a", NODES, CIDRS, True, (), POD_ADDRESSES).keep
    assert "10.0.1.1/32" in keep and "10.244.1.7/32" not in keep


def ipcache(prefix: str, node: str, pod: str = "p", deleted: bool = False) -> identity_pb2.IpcacheEntry:
    return identity_pb2.IpcacheEntry(prefix=prefix, identity=300, node=node, namespace="x", pod=pod, deleted=deleted)


def test_the_ipcache_s_pods_outside_the_cidrs_become_routes_and_go_with_their_pods() -> None:
    async def body() -> None:
        routing = FakeRouting()
        nodes = NodeRoutes("a", "direct", routing, FakeIpam({"a": ["10.244.0.0/24"], "b": ["10.244.1.0/24"]}))
        await nodes._on_node("", delta("a", node_object("a", ("InternalIP", "172.31.0.10"))))
        await nodes._on_node("", delta("b", node_object("b", ("InternalIP", "172.31.0.11"))))
        await nodes.reconcile()
        nodes.loaded.set()
        nodes._wake.clear()
        await nodes._on_ipcache("", ipcache("10.244.1.9/32", "b"))
        assert not nodes._wake.is_set(), "an address inside a pod CIDR changes no route"
        await nodes._on_ipcache("", ipcache("10.0.1.1", "a"))  # this node's own pod: routed locally
        await nodes._on_ipcache("", ipcache("172.31.0.11/32", "b", pod=""))  # a node address
        assert not nodes._wake.is_set()
        await nodes._on_ipcache("", ipcache("10.0.1.2", "b"))
        assert nodes._wake.is_set()
        await nodes.reconcile()
        assert list(routing.plans[-1].routes) == [
            NodeRoute("10.0.1.2/32", "172.31.0.11", "b"),
            NodeRoute("10.244.1.0/24", "172.31.0.11", "b"),
        ]
        await nodes._on_ipcache("", ipcache("10.0.1.2", "b", deleted=True))
        await nodes.reconcile()
        assert list(routing.plans[-1].routes) == [NodeRoute("10.244.1.0/24", "172.31.0.11", "b")]

    asyncio.run(body())
