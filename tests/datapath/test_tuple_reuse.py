"""One client port, two paths to one backend: by its ClusterIP and by its own address.

After DNAT both paths give the backend the same tuple (client address and port, backend address
and port), so a connection through the ClusterIP and a direct one from the same client port meet
in conntrack. Every test binds the client's port explicitly, so the reuse is certain rather than
a matter of which port the kernel picks. Each is run with a backend on the node (local delivery)
and one reached through the host (as a backend on another node is), IPv4 and IPv6, TCP and UDP.

- one after the other: the first connection closed (its entry closing, or alive for UDP), the next
  opened on the same port by the other path;
- at the same time: the first still open when the second starts (Palisade gives the second a
  port of its own, as netfilter's NAT does for a clashing tuple), both exchange afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from collections.abc import Iterator

import pytest

from services.datapath.maps import snatmap
from services.datapath.maps.bpf import prog_test_run
from services.datapath.types import Backend, Direction, Frontend, L4Proto, LbService, Reason, Verdict
from testkit.datapathnode import Node, clear_services
from testkit.traffic import (
    ACK,
    ALLOW_TIMEOUT,
    SYN,
    TC_ACT_OK,
    TC_ACT_REDIRECT,
    TC_ACT_SHOT,
    close_to_time_wait,
    family_of,
    recv_exact,
    socket_in,
)
from testkit.traffic import tc_frame as frame

pytestmark = [pytest.mark.root, pytest.mark.bcc]

VIP = "10.96.78.10"
VIP6 = "fd00:96::78:10"
TCP_FRONT, TCP_BACK = 80, 8080
UDP_FRONT, UDP_BACK = 53, 5353


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # "v4" | "v6"
    where: str  # "local" | "remote"

    def __str__(self) -> str:
        return f"{self.family}-{self.where}"


CASES = [Case(f, w) for f in ("v4", "v6") for w in ("local", "remote")]


@dataclasses.dataclass(frozen=True)
class Paths:
    """The client's namespace and the two addresses of one backend."""

    client: str
    vip: str
    backend: str


@pytest.fixture(params=CASES, ids=str)
def paths(request: pytest.FixtureRequest, net: Node) -> Iterator[Paths]:
    case: Case = request.param
    v6 = case.family == "v6"
    pod_or_host = {"local": (net.b.v4, net.b.v6), "remote": (net.ext_in, net.ext_v6)}[case.where]
    backend = pod_or_host[v6]
    vip = VIP6 if v6 else VIP
    net.dp.lb_upsert(LbService(Frontend(vip, TCP_FRONT, L4Proto.TCP), (Backend(backend, TCP_BACK),)))
    net.dp.lb_upsert(LbService(Frontend(vip, UDP_FRONT, L4Proto.UDP), (Backend(backend, UDP_BACK),)))
    yield Paths(net.a.name, vip, backend)
    clear_services(net.dp)


def client_port() -> int:
    """A port outside the kernel's ephemeral range, fresh per test (no TIME_WAIT left from another)."""
    return 20000 + secrets.randbelow(10000)


def bound(ns: str, ip: str, kind: int, port: int) -> socket.socket:
    s = socket_in(ns, family_of(ip), kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::" if family_of(ip) == socket.AF_INET6 else "0.0.0.0", port))
    s.settimeout(ALLOW_TIMEOUT)
    return s


def tcp_open(ns: str, ip: str, port: int, src_port: int) -> socket.socket:
    s = bound(ns, ip, socket.SOCK_STREAM, src_port)
    try:
        s.connect((ip, port))
    except OSError as exc:
        s.close()
        raise AssertionError(f"connect from port {src_port} to [{ip}]:{port}: {exc}") from exc
    return s


def echoes(s: socket.socket) -> bool:
    msg = os.urandom(8)
    try:
        if s.type == socket.SOCK_STREAM:
            s.sendall(msg)
            return recv_exact(s, len(msg)) == msg
        s.send(msg)
        while True:
            if s.recv(64) == msg:
                return True
    except OSError:
        return False


def udp_open(ns: str, ip: str, port: int, src_port: int) -> socket.socket:
    s = bound(ns, ip, socket.SOCK_DGRAM, src_port)
    s.connect((ip, port))  # a reply from any other source than (ip, port) is never received
    return s


def targets(p: Paths, kind: int) -> dict[str, tuple[str, int]]:
    if kind == socket.SOCK_STREAM:
        return {"clusterip": (p.vip, TCP_FRONT), "direct": (p.backend, TCP_BACK)}
    return {"clusterip": (p.vip, UDP_FRONT), "direct": (p.backend, UDP_BACK)}


ORDERS = [("clusterip", "direct"), ("direct", "clusterip")]


@pytest.mark.parametrize("order", ORDERS, ids="-then-".join)
def test_tcp_one_after_the_other_on_one_port(paths: Paths, net: Node, order: tuple[str, str]) -> None:
    to = targets(paths, socket.SOCK_STREAM)
    port = client_port()
    for round_ in range(3):
        for path in order:
            s = tcp_open(paths.client, *to[path], port)
            try:
                assert echoes(s), f"round {round_}: {path} connection from port {port} got no echo"
            finally:
                close_to_time_wait(s)
    # Every connection was judged as a new flow at the client, none inherited the one before: one
    # allow event each (a connection that follows one of the other path while that one's entry is
    # still closing leaves with a port of Palisade's, the others with the client's).
    opened = [
        f
        for f in net.dp.read_flows(0)
        if f.endpoint_id == net.a.ep_id and f.verdict is Verdict.ALLOW and f.destination_ip == paths.backend
    ]
    assert len(opened) == 6, opened
    assert {f.source_port for f in opened} >= {port}


@pytest.mark.parametrize("order", ORDERS, ids="-then-".join)
def test_tcp_at_the_same_time_on_one_port(paths: Paths, net: Node, order: tuple[str, str]) -> None:
    to = targets(paths, socket.SOCK_STREAM)
    port = client_port()
    first = tcp_open(paths.client, *to[order[0]], port)
    try:
        assert echoes(first)
        second = tcp_open(paths.client, *to[order[1]], port)
        try:
            for _ in range(3):
                assert echoes(second), f"{order[1]} connection beside a live {order[0]} one"
                assert echoes(first), f"{order[0]} connection once a {order[1]} one shares its port"
        finally:
            close_to_time_wait(second)
        assert echoes(first)
    finally:
        close_to_time_wait(first)
    # The backend saw two tuples: the second connection left with a port of Palisade's choosing.
    at_backend = {
        e.source_port
        for e in net.dp.conntrack(net.a.ep_id)
        if e.destination_ip == paths.backend and e.destination_port == TCP_BACK
    }
    assert port in at_backend and len(at_backend) == 2, at_backend


@pytest.mark.parametrize("order", ORDERS, ids="-then-".join)
def test_udp_one_after_the_other_on_one_port(paths: Paths, order: tuple[str, str]) -> None:
    to = targets(paths, socket.SOCK_DGRAM)
    port = client_port()
    for round_ in range(3):
        for path in order:
            with udp_open(paths.client, *to[path], port) as s:
                assert echoes(s), f"round {round_}: {path} datagram from port {port} got no echo"


@pytest.mark.parametrize("order", ORDERS, ids="-then-".join)
def test_udp_at_the_same_time_on_one_port(paths: Paths, order: tuple[str, str]) -> None:
    to = targets(paths, socket.SOCK_DGRAM)
    port = client_port()
    with udp_open(paths.client, *to[order[0]], port) as first:
        assert echoes(first)
        with udp_open(paths.client, *to[order[1]], port) as second:
            for _ in range(3):
                assert echoes(second), f"{order[1]} datagrams beside a live {order[0]} flow"
                assert echoes(first), f"{order[0]} datagrams once a {order[1]} flow shares its port"


def test_a_clashing_connection_survives_a_datapath_restart(net: Node) -> None:
    """The port Palisade gave a clashing connection is pinned state: a restarted agent keeps it."""
    from services.datapath.datapath import Datapath

    dp, a, b = net.dp, net.a, net.b
    dp.lb_upsert(LbService(Frontend(VIP, TCP_FRONT, L4Proto.TCP), (Backend(b.v4, TCP_BACK),)))
    port = client_port()
    try:
        via_service, direct = tcp_open(a.name, VIP, TCP_FRONT, port), tcp_open(a.name, b.v4, TCP_BACK, port)
        try:
            assert echoes(via_service) and echoes(direct)
            reopened = Datapath.open(dp.base_dir)
            reopened.close()
            assert echoes(via_service) and echoes(direct)
        finally:
            # Closed before the service goes: a FIN retransmitted later would reach no backend.
            close_to_time_wait(via_service)
            close_to_time_wait(direct)
    finally:
        clear_services(dp)


def test_a_reply_that_cannot_be_translated_back_is_dropped_and_reported(net: Node) -> None:
    """A reply whose translation is gone (the port given to its connection forgotten, its service
    deleted) is dropped, since the client could not match it; the drop is counted and reported as a
    flow event at the client, never lost unseen. Frames go through the programs with
    BPF_PROG_TEST_RUN, as if they arrived on a's host veth."""
    dp, a, b = net.dp, net.a, net.b
    dp.lb_upsert(LbService(Frontend(VIP, TCP_FRONT, L4Proto.TCP), (Backend(b.v4, TCP_BACK),)))
    from_a, to_a, a_if = dp.template.from_container_fd, dp.template.to_container_fd, a.net.host_ifindex
    tcp, port = socket.IPPROTO_TCP, client_port()
    try:
        assert prog_test_run(from_a, frame(a.v4, VIP, port, TCP_FRONT, tcp, SYN), a_if, 1)[0] == TC_ACT_REDIRECT
        assert prog_test_run(from_a, frame(a.v4, b.v4, port, TCP_BACK, tcp, SYN), a_if, 1)[0] == TC_ACT_REDIRECT
        (given,) = dp.snat()
        assert (given.client_port, given.service_id) == (port, 0)
        assert snatmap.PORT_MIN <= given.given_port <= snatmap.PORT_MAX
        reply = frame(b.v4, a.v4, TCP_BACK, given.given_port, tcp, SYN | ACK)
        assert prog_test_run(to_a, reply, a_if, 1)[0] == TC_ACT_OK
        dp.read_flows(0)
        dropped_before = dp.counters().packets(
            endpoint_id=a.ep_id, reason=Reason.NO_BACKEND, direction=Direction.INGRESS
        )
        dp.snat_map.flush()
        assert prog_test_run(to_a, reply, a_if, 1)[0] == TC_ACT_SHOT
        for state in dp.lb_services():
            dp.lb_delete(state.frontend)
        reply_to_service = frame(b.v4, a.v4, TCP_BACK, port, tcp, SYN | ACK)
        assert prog_test_run(to_a, reply_to_service, a_if, 1)[0] == TC_ACT_SHOT
        drops = [f for f in dp.read_flows(0) if f.endpoint_id == a.ep_id and f.reason is Reason.NO_BACKEND]
        assert [(f.direction, f.source_ip, f.destination_port) for f in drops] == [
            (Direction.INGRESS, b.v4, given.given_port),
            (Direction.INGRESS, b.v4, port),
        ]
        dropped = dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.NO_BACKEND, direction=Direction.INGRESS)
        assert dropped - dropped_before == 2
    finally:
        clear_services(dp)
