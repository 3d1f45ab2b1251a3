"""`make run --nodes 3 --routing tunnel`: nodes that share no network, joined by the datapaths' VXLAN.

Each dev node sits on a bridge of its own behind a router, so no node reaches another on a link:
a route to another node's pod CIDR via its address is refused by the kernel. Pods still reach
each other across nodes, enforced by identity, because every datapath made the kernel's VXLAN
device and routed the other nodes' pod CIDRs into it; the device's counters show the packets.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.datapath.routing import RTPROT_PALISADE, TUNNEL_IFNAME
from services.devstack import __main__ as devstack
from testkit.harness import ROOT
from testkit.stack import Stack, running_stack
from tests.system.test_make_run_nodes import (
    MATRIX_CASES,
    _matrix_files,
    _probe_equals_analyze,
    check_pods_outside_every_pod_cidr_reach_across_nodes,
)

pytestmark = [pytest.mark.root, pytest.mark.bcc]

NODES = ["dev-node-1", "dev-node-2", "dev-node-3"]
SUBNET = "172.31.248.0/24"
ARGS = ("--nodes", "3", "--node-subnet", SUBNET, "--routing", "tunnel")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("tunnel"), ROOT / "examples", *ARGS) as s:
        yield s


def _network(stack: Stack) -> Any:
    return devstack.parse([*ARGS, "--run-dir", str(stack.run_dir)]).network


def _ip_json(netns: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(["ip", "-n", netns, "-j", *args], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout or "[]"))


def _tunnel_tx(netns: str) -> int:
    (link,) = _ip_json(netns, "-s", "link", "show", TUNNEL_IFNAME)
    return int(link["stats64"]["tx"]["packets"])


def test_no_node_shares_a_link_with_another(stack: Stack) -> None:
    network = _network(stack)
    one, two = network.nodes[0], network.nodes[1]
    assert one.bridge != two.bridge
    refused = subprocess.run(
        ["ip", "-n", one.netns, "route", "add", "10.255.255.0/24", "via", two.address],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "invalid gateway" in refused.stderr.lower(), refused


def test_each_node_routes_the_others_pod_cidrs_into_the_tunnel(stack: Stack) -> None:
    network = _network(stack)
    for node in network.nodes:
        routes = _ip_json(node.netns, "route", "show", "proto", str(RTPROT_PALISADE))
        others = {n.address for n in network.nodes if n.name != node.name}
        assert {r["gateway"] for r in routes} == others, routes
        assert {r["dev"] for r in routes} == {TUNNEL_IFNAME}
        (link,) = _ip_json(node.netns, "-d", "link", "show", TUNNEL_IFNAME)
        assert link["linkinfo"]["info_kind"] == "vxlan"
        assert link["linkinfo"]["info_data"]["local"] == node.address


def test_the_example_story_holds_across_nodes_through_the_tunnel(stack: Stack) -> None:
    endpoints = stack.endpoints()
    front, back = endpoints["shop/frontend"]["node"], endpoints["shop/backend"]["node"]
    assert front != back, "pick pods on two nodes"
    netns = {n.name: n.netns for n in _network(stack).nodes}
    before = _tunnel_tx(netns[front])
    assert stack.reach("shop/frontend", "shop/backend", 8080)
    assert _tunnel_tx(netns[front]) > before, "the connection left through the VXLAN device"
    assert not stack.reach("tools/debug", "shop/backend", 8080)
    assert stack.reach("shop/backend", "shop/db", 5432)
    assert not stack.reach("shop/frontend", "shop/db", 5432)
    assert stack.reach_service("shop/frontend", "shop/backend", 80)
    assert not stack.reach_service("tools/debug", "shop/backend", 80)


@pytest.mark.parametrize("case", sorted(MATRIX_CASES))
def test_connectivity_probe_through_the_tunnel_equals_analyze(stack: Stack, tmp_path: Path, case: str) -> None:
    _probe_equals_analyze(stack, _matrix_files(tmp_path, MATRIX_CASES[case]))


def test_pods_outside_every_pod_cidr_reach_across_nodes_through_the_tunnel(stack: Stack, tmp_path: Path) -> None:
    hosts = [n.netns for n in _network(stack).nodes]
    check_pods_outside_every_pod_cidr_reach_across_nodes(stack, tmp_path, hosts)


def test_zz_ctrl_c_removes_the_router_and_the_bridges(stack: Stack) -> None:
    network = _network(stack)
    stack.interrupt()
    assert not os.path.exists(f"/run/netns/{network.router_netns}")
    assert not [n for n in network.nodes if os.path.exists(f"/run/netns/{n.netns}")]
    for bridge in network.bridges:
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
