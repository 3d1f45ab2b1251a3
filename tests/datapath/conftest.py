"""Shared fixtures for the datapath tests: one compiled datapath and a few pods per session.

Everything carries a random run id (``pt<4 hex>``) so parallel runs on one
machine never share a namespace, an interface, an address or a pin directory,
and everything is removed at the end of the session.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Iterator

import pytest

from services.datapath import netns
from services.datapath.datapath import Datapath
from services.datapath.netns import PodLink
from services.datapath.types import Enforcement
from testkit.datapathnode import IDENTITY_A, IDENTITY_B, IDENTITY_C, TCP_PORTS, UDP_PORTS, Node, Pod
from testkit.traffic import EchoServer


@pytest.fixture(scope="session")
def run_id() -> str:
    return "pt" + secrets.token_hex(2)


def _subnet() -> tuple[int, int]:
    raw = secrets.randbits(16)
    return 200 + raw % 50, raw >> 8


@pytest.fixture(scope="session")
def bpf_base(run_id: str) -> str:
    return f"/sys/fs/bpf/palisade-{run_id}"


@pytest.fixture(scope="session")
def node(run_id: str, bpf_base: str) -> Iterator[Node]:
    """Compiles the program once per session; pods and servers live for the whole session."""
    netns.enable_forwarding()
    o2, o3 = _subnet()
    v4 = f"10.{o2}.{o3}"
    v6 = f"fd10:{o2:x}{o3:02x}:{run_id[2:]}"
    # tcx here (the service's tests run the default, tc): every enforcement test then covers the
    # links, and test_lifecycle's switch between the two covers the filters as well.
    dp = Datapath.open(bpf_base, attach="tcx")
    created: list[PodLink] = []
    servers: list[EchoServer] = []
    try:
        pods = []
        for idx, (letter, identity) in enumerate((("a", IDENTITY_A), ("b", IDENTITY_B), ("c", IDENTITY_C)), 1):
            name = f"{run_id}{letter}"
            ip6 = str(ipaddress.ip_address(f"{v6}::{idx}"))  # canonical, as the datapath reports it
            net = netns.create_pod(name, name, [f"{v4}.{idx}", ip6])
            created.append(net)
            pod = Pod(name, net, ep_id=100 + idx, identity=identity, v4=f"{v4}.{idx}", v6=ip6)
            dp.attach_endpoint(pod.spec)
            pods.append(pod)
        ext_name = f"{run_id}x"
        ext_v6 = str(ipaddress.ip_address(f"{v6}::81"))
        ext = netns.create_pod(ext_name, ext_name, [f"{v4}.129", f"{v4}.130", f"10.{o2}.{(o3 + 1) % 256}.1", ext_v6])
        created.append(ext)
        for link in created:
            servers.append(EchoServer(link.name, TCP_PORTS, UDP_PORTS))
        yield Node(
            run_id=run_id,
            dp=dp,
            a=pods[0],
            b=pods[1],
            c=pods[2],
            ext=ext,
            ext_in=f"{v4}.129",
            ext_except=f"{v4}.130",
            ext_outside=f"10.{o2}.{(o3 + 1) % 256}.1",
            cidr=f"{v4}.128/25",
            ext_v6=ext_v6,
            cidr_v6=str(ipaddress.ip_network(f"{v6}::80/124")),
            pods=tuple(pods),
        )
    finally:
        for server in servers:
            server.close()
        for link in created:
            netns.delete_pod(link)
        dp.teardown()
    assert not os.path.exists(bpf_base)


@pytest.fixture
def net(node: Node) -> Node:
    """The session node with no policy, original identities, empty ipcache, conntrack and flow queue."""
    dp = node.dp
    for pod in node.pods:
        dp.sync_policy(pod.ep_id, Enforcement(), [])
        dp.set_identity(pod.ep_id, pod.identity)
    for prefix in dp.ipcache_dump():
        dp.ipcache_delete(prefix)
    dp.flush_conntrack()
    dp.read_flows(0)
    return node
