"""Hairpin: a pod reaching itself through a ClusterIP whose only backend is itself.

The pod's kernel drops a packet from its own address arriving from outside, so the program gives
the connection the hairpin address as source (169.254.42.1, 100::42), puts it straight back into
the pod, and undoes both translations on the replies: the client sees the ClusterIP, the server
a peer of its own. As with a pod connecting to its own address, policy never stops it; another
pod through the same Service is judged as usual.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from services.datapath.types import Backend, Enforcement, Frontend, L4Proto, LbService
from testkit.datapathnode import Node, clear_services
from testkit.traffic import (
    ALLOW_TIMEOUT,
    DENY_TIMEOUT,
    family_of,
    recv_exact,
    socket_in,
    tcp_exchange,
    udp_exchange,
)

pytestmark = [pytest.mark.root, pytest.mark.bcc]

VIP = {"v4": "10.96.79.10", "v6": "fd00:96::79:10"}
HAIRPIN = {"v4": "169.254.42.1", "v6": "100::42"}
FRONT = {L4Proto.TCP: 80, L4Proto.UDP: 53}
BACK = {L4Proto.TCP: 8080, L4Proto.UDP: 5353}


@pytest.fixture
def svc(net: Node) -> Iterator[Node]:
    yield net
    for pod in net.pods:
        net.dp.sync_policy(pod.ep_id, Enforcement(), [])
    clear_services(net.dp)


def _serve(svc: Node, family: str) -> str:
    a = svc.a
    vip = VIP[family]
    own = a.v4 if family == "v4" else a.v6
    for proto in (L4Proto.TCP, L4Proto.UDP):
        svc.dp.lb_upsert(LbService(Frontend(vip, FRONT[proto], proto), (Backend(own, BACK[proto]),)))
    return vip


@pytest.mark.parametrize("family", ["v4", "v6"])
@pytest.mark.parametrize("proto", [L4Proto.TCP, L4Proto.UDP])
def test_a_pod_reaches_itself_through_its_own_service(svc: Node, family: str, proto: L4Proto) -> None:
    vip = _serve(svc, family)
    exchange = tcp_exchange if proto is L4Proto.TCP else udp_exchange
    assert exchange(svc.a.name, vip, FRONT[proto])
    # Behind default deny both ways: a pod reaching itself is never stopped by policy.
    svc.dp.sync_policy(svc.a.ep_id, Enforcement(ingress=True, egress=True), [])
    svc.dp.flush_conntrack()
    assert exchange(svc.a.name, vip, FRONT[proto])
    assert not exchange(svc.b.name, vip, FRONT[proto], timeout=DENY_TIMEOUT), "another pod is still judged"


@pytest.mark.parametrize("family", ["v4", "v6"])
def test_the_client_sees_the_cluster_ip_and_the_server_the_hairpin_address(svc: Node, family: str) -> None:
    vip = _serve(svc, family)
    a = svc.a
    own = a.v4 if family == "v4" else a.v6
    with socket_in(a.name, family_of(vip), socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((own, 9123))
        server.listen(1)
        server.settimeout(ALLOW_TIMEOUT)
        svc.dp.lb_upsert(LbService(Frontend(vip, 91, L4Proto.TCP), (Backend(own, 9123),)))
        with socket_in(a.name, family_of(vip), socket.SOCK_STREAM) as client:
            client.settimeout(ALLOW_TIMEOUT)
            client.connect((vip, 91))
            assert client.getpeername()[:2] == (vip, 91)
            conn, peer = server.accept()
            with conn:
                assert peer[0] == HAIRPIN[family]
                assert peer[1] == client.getsockname()[1], "the client's port is kept"
                client.sendall(b"hairpin!")
                assert recv_exact(conn, 8) == b"hairpin!"
                conn.sendall(b"answered")
                assert recv_exact(client, 8) == b"answered"
