"""Traffic from a pod's own node: allowed whatever the policy (allow-localhost=always), or judged.

The node's host namespace (here: the test's, where the pods' host veths are) reaches a pod from
an address of its own, which the ipcache holds as the reserved identity host (1), as the
datapath installs the node's addresses. Kubernetes says traffic from the node where a pod runs
is always allowed, so kubelet's probes reach pods behind a default deny; other pods stay denied.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator

import pytest

from services.common.labels import ReservedIdentity
from services.datapath import netns
from services.datapath.datapath import Datapath
from services.datapath.loader import ProgramConfig
from services.datapath.types import Direction, EndpointSpec, Enforcement, Reason, Verdict
from testkit.datapathnode import Node
from testkit.traffic import DENY_TIMEOUT, EchoServer, tcp_exchange, udp_exchange

pytestmark = [pytest.mark.root, pytest.mark.bcc]

#: The node's host namespace: the test process's own (its main thread never leaves it).
HOST_NS = f"/proc/{os.getpid()}/ns/net"


def host_source(ip: str) -> str:
    """The address the host namespace sends from towards ``ip``."""
    out = subprocess.run(["ip", "-j", "route", "get", ip], capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)[0]["prefsrc"])


@pytest.fixture
def host_is_host(net: Node) -> Iterator[str]:
    """The host's source address towards the pods, in the ipcache as ``host``."""
    src = host_source(net.a.v4)
    net.dp.ipcache_upsert(f"{src}/32", int(ReservedIdentity.HOST))
    yield src
    net.dp.ipcache_delete(f"{src}/32")


def test_a_pod_behind_default_deny_answers_its_own_node(net: Node, host_is_host: str) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(a.ep_id, Enforcement(ingress=True), [])
    try:
        assert tcp_exchange(HOST_NS, a.v4, 8080), "the node's probe reaches the pod"
        assert udp_exchange(HOST_NS, a.v4, 5353)
        assert not tcp_exchange(b.name, a.v4, 8080, timeout=DENY_TIMEOUT), "another pod is still denied"
        flows = dp.read_flows(0)
        from_host = [f for f in flows if f.source_identity == ReservedIdentity.HOST and f.endpoint_id == a.ep_id]
        assert from_host and all(f.verdict is Verdict.ALLOW for f in from_host)
        assert {f.reason for f in from_host} == {Reason.NOT_ENFORCED}
        denied = [f for f in flows if f.source_identity == b.identity and f.direction is Direction.INGRESS]
        assert denied and all(f.reason is Reason.DEFAULT_DENY for f in denied)
    finally:
        dp.sync_policy(a.ep_id, Enforcement(), [])


@pytest.fixture(scope="module")
def judged_pod(run_id: str) -> Iterator[tuple[Datapath, netns.PodLink, str]]:
    """A pod on programs compiled with allow-localhost=policy (a datapath of its own)."""
    base = f"/sys/fs/bpf/palisade-{run_id}-hostpolicy"
    dp = Datapath.open(base, config=ProgramConfig(allow_host=False))
    name = f"{run_id}h"
    ip = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}.7"
    link = netns.create_pod(name, name, [ip])
    server = EchoServer(link.name, (8080,), ())
    try:
        dp.attach_endpoint(EndpointSpec(900, link.host_ifindex, link.host_ifname, link.ips, 2001))
        yield dp, link, ip
    finally:
        server.close()
        netns.delete_pod(link)
        dp.teardown()


def test_allow_localhost_policy_judges_the_node_like_any_peer(
    judged_pod: tuple[Datapath, netns.PodLink, str],
) -> None:
    dp, _link, ip = judged_pod
    src = host_source(ip)
    dp.ipcache_upsert(f"{src}/32", int(ReservedIdentity.HOST))
    assert tcp_exchange(HOST_NS, ip, 8080), "not enforced: the node reaches it"
    dp.sync_policy(900, Enforcement(ingress=True), [])
    assert not tcp_exchange(HOST_NS, ip, 8080, timeout=DENY_TIMEOUT), "judged by policy: default deny drops it"
    drops = [f for f in dp.read_flows(0) if f.source_identity == ReservedIdentity.HOST and f.verdict is Verdict.DENY]
    assert drops and drops[-1].reason is Reason.DEFAULT_DENY
