"""Services on real packets: ClusterIP DNAT before policy, reverse NAT, reject, affinity, restart."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from collections.abc import Iterator

import pytest

from services.datapath.datapath import Datapath
from services.datapath.maps import addresses, lbctmap, lbportmap
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap, unpin
from services.datapath.maps.lbctmap import LbCtEntry
from services.datapath.maps.lbportmap import LbPortMap
from services.datapath.maps.lbservicemap import Master
from services.datapath.types import (
    Backend,
    Direction,
    Enforcement,
    Frontend,
    L4Proto,
    LbService,
    Reason,
    Verdict,
)
from testkit.datapathnode import Node, clear_services
from testkit.traffic import ALLOW_TIMEOUT, DENY_TIMEOUT, Stream, family_of, socket_in, tcp_exchange, udp_exchange
from tests.datapath.entries import entry

pytestmark = [pytest.mark.root, pytest.mark.bcc]

VIP = "10.96.77.10"
VIP6 = "fd00:96::77:10"
EGRESS_ONLY = Enforcement(egress=True)


@pytest.fixture
def svc(net: Node) -> Iterator[Node]:
    """The clean node; every frontend a test adds is removed after it."""
    yield net
    clear_services(net.dp)


def tcp(address: str, port: int) -> Frontend:
    return Frontend(address, port, L4Proto.TCP)


def backends_used(dp: Datapath, ep_id: int, frontend_port: int) -> set[str]:
    """The backend addresses the endpoint's conntrack shows for connections opened to a service."""
    return {e.destination_ip for e in dp.conntrack(ep_id) if e.service_id and e.direction is Direction.EGRESS}


def test_clusterip_tcp_and_udp_reach_the_backend_and_replies_come_from_the_clusterip(svc: Node) -> None:
    dp, a, b = svc.dp, svc.a, svc.b
    state = dp.lb_upsert(LbService(tcp(VIP, 80), (Backend(b.v4, 8080),)))
    dp.lb_upsert(LbService(Frontend(VIP, 53, L4Proto.UDP), (Backend(b.v4, 5353),)))
    assert tcp_exchange(a.name, VIP, 80)
    assert udp_exchange(a.name, VIP, 53)  # the reply's source is the ClusterIP, or recvfrom never matches
    with socket_in(a.name, socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(ALLOW_TIMEOUT)
        s.connect((VIP, 80))
        assert s.getpeername() == (VIP, 80)
    entries = [e for e in dp.conntrack(a.ep_id) if e.service_id == state.id]
    assert entries and all(e.destination_ip == b.v4 and e.destination_port == 8080 for e in entries)
    # The server sees the client's own address: no SNAT.
    assert any(e.source_ip == a.v4 for e in dp.conntrack(b.ep_id))


def test_ipv6_clusterip(svc: Node) -> None:
    svc.dp.lb_upsert(LbService(tcp(VIP6, 80), (Backend(svc.b.v6, 8080),)))
    assert tcp_exchange(svc.a.name, VIP6, 80)


def test_egress_policy_judges_the_backend_identity_and_port(svc: Node) -> None:
    dp, a, b, c = svc.dp, svc.a, svc.b, svc.c
    dp.lb_upsert(LbService(tcp(VIP, 80), (Backend(b.v4, 8080),)))
    dp.lb_upsert(LbService(tcp(VIP, 81), (Backend(c.v4, 8080),)))
    dp.sync_policy(a.ep_id, EGRESS_ONLY, [entry(Direction.EGRESS, b.identity, L4Proto.TCP, 8080)])
    assert tcp_exchange(a.name, VIP, 80)
    assert not tcp_exchange(a.name, VIP, 81, timeout=DENY_TIMEOUT)  # c is not allowed
    # Allowing the frontend's port, not the backend's, allows nothing (policy applies after DNAT).
    dp.sync_policy(a.ep_id, EGRESS_ONLY, [entry(Direction.EGRESS, b.identity, L4Proto.TCP, 80)])
    dp.flush_conntrack()
    assert not tcp_exchange(a.name, VIP, 80, timeout=DENY_TIMEOUT)
    flows = [f for f in dp.read_flows(0) if f.source_ip == a.v4 and f.verdict is Verdict.DENY]
    assert flows and all(f.destination_ip in (b.v4, c.v4) for f in flows)  # never the ClusterIP


def refused(ns: str, ip: str, port: int, kind: int) -> int:
    """The errno a connection (TCP) or a datagram exchange (UDP) to ``ip:port`` ends with, 0 if answered."""
    with socket_in(ns, family_of(ip), kind) as s:
        s.settimeout(ALLOW_TIMEOUT)
        try:
            s.connect((ip, port))
            if kind == socket.SOCK_DGRAM:
                s.send(b"x")
                s.recv(16)
            return 0
        except OSError as exc:
            return exc.errno or -1


@pytest.mark.parametrize("vip", [VIP, VIP6])
def test_a_service_without_backends_is_refused_at_once(svc: Node, vip: str) -> None:
    dp, a = svc.dp, svc.a
    dp.lb_upsert(LbService(tcp(vip, 80)))
    dp.lb_upsert(LbService(Frontend(vip, 53, L4Proto.UDP)))
    assert refused(a.name, vip, 80, socket.SOCK_STREAM) == errno.ECONNREFUSED
    assert refused(a.name, vip, 53, socket.SOCK_DGRAM) == errno.ECONNREFUSED
    assert dp.counters().packets(endpoint_id=a.ep_id, reason=Reason.NO_BACKEND) >= 2


def test_connections_spread_over_backends_unless_client_ip_affinity(svc: Node) -> None:
    dp, a, b, c = svc.dp, svc.a, svc.b, svc.c
    both = (Backend(b.v4, 8080), Backend(c.v4, 8080))
    dp.lb_upsert(LbService(tcp(VIP, 80), both))
    for _ in range(24):
        assert tcp_exchange(a.name, VIP, 80)
    assert backends_used(dp, a.ep_id, 80) == {b.v4, c.v4}
    dp.flush_conntrack()
    dp.lb_upsert(LbService(tcp(VIP, 80), both, affinity_timeout=600))
    for _ in range(24):
        assert tcp_exchange(a.name, VIP, 80)
    assert len(backends_used(dp, a.ep_id, 80)) == 1


def test_a_removed_backend_ends_its_connections_cleanly_and_the_rest_keep_theirs(svc: Node) -> None:
    dp, a, b, c = svc.dp, svc.a, svc.b, svc.c
    dp.lb_upsert(LbService(tcp(VIP, 80), (Backend(b.v4, 8080),)))
    dp.lb_upsert(LbService(tcp(VIP, 81), (Backend(b.v4, 8081),)))
    gone, kept = Stream(a.name, VIP, 80), Stream(a.name, VIP, 81)
    try:
        assert gone.ping() and kept.ping()
        dp.lb_upsert(LbService(tcp(VIP, 80), (Backend(c.v4, 8080),)))
        # The next segment goes to the remaining backend, which knows no such connection: a reset.
        gone.sock.sendall(b"after")
        with pytest.raises(ConnectionResetError):
            data = gone.sock.recv(16)
            if not data:
                raise ConnectionResetError
        assert kept.ping()
        assert tcp_exchange(a.name, VIP, 80)  # new connections use the remaining backend
        assert backends_used(dp, a.ep_id, 80) >= {c.v4}
    finally:
        gone.close()
        kept.close()


def test_a_reopened_datapath_keeps_service_ids_and_established_connections(svc: Node) -> None:
    dp, a, b = svc.dp, svc.a, svc.b
    before = dp.lb_upsert(LbService(tcp(VIP, 80), (Backend(b.v4, 8080),), affinity_timeout=30))
    stream = Stream(a.name, VIP, 80)
    try:
        assert stream.ping()
        reopened = Datapath.open(dp.base_dir)  # a restarted agent: the maps are the record
        try:
            (after,) = reopened.lb_services()
            assert (after.frontend, after.id, after.backends, after.affinity_timeout) == (
                before.frontend,
                before.id,
                before.backends,
                30,
            )
            again = reopened.lb_upsert(LbService(tcp(VIP, 80), (Backend(b.v4, 8080),), affinity_timeout=30))
            assert again.backends == before.backends
            assert stream.ping()
        finally:
            reopened.close()
        assert stream.ping()
    finally:
        stream.close()


def udp_flow(ns: str, family: socket.AddressFamily) -> socket.socket:
    """One UDP socket: every datagram it sends is one flow (the same source port)."""
    s = socket_in(ns, family, socket.SOCK_DGRAM)
    s.settimeout(ALLOW_TIMEOUT)
    return s


def echoed_from(s: socket.socket, ip: str, port: int) -> tuple[str, int]:
    """Send a datagram to (ip, port) and return the address its echo came from."""
    payload = os.urandom(8)
    s.sendto(payload, (ip, port))
    while True:
        data, peer = s.recvfrom(65535)
        if data == payload:
            return peer[0], peer[1]


def service_entry(dp: Datapath, ep_id: int, client_port: int, frontend_port: int) -> LbCtEntry:
    (found,) = [
        e
        for e in dp.lb_conntrack()
        if e.ep_id == ep_id and e.client_port == client_port and e.frontend_port == frontend_port
    ]
    return found


def test_a_udp_flow_whose_backend_is_replaced_moves_to_the_new_one_and_its_replies_keep_the_clusterip(
    svc: Node,
) -> None:
    dp, a, b, c = svc.dp, svc.a, svc.b, svc.c
    dns = Frontend(VIP, 53, L4Proto.UDP)
    dp.lb_upsert(LbService(dns, (Backend(b.v4, 8080),)))
    with udp_flow(a.name, socket.AF_INET) as s:
        assert echoed_from(s, VIP, 53) == (VIP, 53)
        port = s.getsockname()[1]
        before = service_entry(dp, a.ep_id, port, 53)
        assert (before.backend, before.backend_port, before.revision) == (b.v4, 8080, dp.lb.revision(dns))
        dp.lb_upsert(LbService(dns, (Backend(c.v4, 8080),)))
        assert dp.lb.revision(dns) != before.revision  # b left
        # The flow's next datagram goes to c (its entry's revision is old, its backend gone), and the
        # echo comes back from the ClusterIP.
        assert echoed_from(s, VIP, 53) == (VIP, 53)
        after = service_entry(dp, a.ep_id, port, 53)
        assert (after.backend, after.backend_port, after.revision) == (c.v4, 8080, dp.lb.revision(dns))
        assert after.backend_id != before.backend_id
        assert c.v4 in backends_used(dp, a.ep_id, 53)


def test_a_flow_keeps_its_backend_when_another_backend_leaves_and_is_stamped_with_the_new_revision(svc: Node) -> None:
    dp, a, b, c = svc.dp, svc.a, svc.b, svc.c
    dns = Frontend(VIP, 53, L4Proto.UDP)
    dp.lb_upsert(LbService(dns, (Backend(b.v4, 8080),)))
    with udp_flow(a.name, socket.AF_INET) as s:
        assert echoed_from(s, VIP, 53) == (VIP, 53)
        port = s.getsockname()[1]
        first = service_entry(dp, a.ep_id, port, 53)
        # A backend added: nothing left, the revision stands and the entry is not written again.
        dp.lb_upsert(LbService(dns, (Backend(b.v4, 8080), Backend(c.v4, 8080))))
        assert dp.lb.revision(dns) == first.revision
        assert echoed_from(s, VIP, 53) == (VIP, 53)
        assert service_entry(dp, a.ep_id, port, 53).revision == first.revision
        # The other backend leaves: the flow looks its own backend up again and keeps it.
        dp.lb_upsert(LbService(dns, (Backend(b.v4, 8080),)))
        assert dp.lb.revision(dns) != first.revision
        assert echoed_from(s, VIP, 53) == (VIP, 53)
        kept = service_entry(dp, a.ep_id, port, 53)
        assert (kept.backend, kept.backend_id, kept.revision) == (b.v4, first.backend_id, dp.lb.revision(dns))


def test_affine_flows_keep_their_backend_when_the_other_backend_leaves(svc: Node) -> None:
    dp, a, b, c = svc.dp, svc.a, svc.b, svc.c
    dns = Frontend(VIP, 53, L4Proto.UDP)
    both = (Backend(b.v4, 8080), Backend(c.v4, 8080))
    dp.lb_upsert(LbService(dns, both, affinity_timeout=600))
    flows = [udp_flow(a.name, socket.AF_INET) for _ in range(8)]
    try:
        for s in flows:
            assert echoed_from(s, VIP, 53) == (VIP, 53)
        chosen = {service_entry(dp, a.ep_id, s.getsockname()[1], 53).backend for s in flows}
        assert len(chosen) == 1  # one client, one backend
        (kept,) = chosen
        dp.lb_upsert(LbService(dns, tuple(x for x in both if x.address == kept), affinity_timeout=600))
        for s in flows:
            assert echoed_from(s, VIP, 53) == (VIP, 53)
            entry_now = service_entry(dp, a.ep_id, s.getsockname()[1], 53)
            assert (entry_now.backend, entry_now.revision) == (kept, dp.lb.revision(dns))
    finally:
        for s in flows:
            s.close()


def test_a_recreated_service_never_meets_its_predecessors_revision(svc: Node) -> None:
    dp, b = svc.dp, svc.b
    dns = Frontend(VIP, 53, L4Proto.UDP)
    dp.lb_upsert(LbService(dns, (Backend(b.v4, 8080),)))
    first = dp.lb.revision(dns)
    dp.lb_delete(dns)
    assert dp.lb.revision(dns) is None
    dp.lb_upsert(LbService(dns, (Backend(b.v4, 8080),)))
    assert dp.lb.revision(dns) not in (None, first)
    reopened = Datapath.open(dp.base_dir)  # a restarted agent reads the revisions back
    try:
        assert reopened.lb.revision(dns) == dp.lb.revision(dns)
    finally:
        reopened.close()


def ports_in_kernel(dp: Datapath) -> set[int]:
    """The frontend ports the pinned lb_ports map holds, read afresh from the kernel."""
    pinned = PinnedMap.open(dp.base_dir, lbportmap.spec(dp.config.sizes))
    try:
        return LbPortMap(pinned).ports()
    finally:
        pinned.close()


def test_the_frontend_port_hint_follows_the_frontends_and_survives_a_restart(svc: Node) -> None:
    dp, b = svc.dp, svc.b
    dns, dns_v6, web = Frontend(VIP, 53, L4Proto.UDP), Frontend(VIP6, 53, L4Proto.UDP), tcp(VIP, 80)
    for frontend in (dns, dns_v6, web):
        dp.lb_upsert(LbService(frontend, (Backend(b.v4 if frontend.address == VIP else b.v6, 8080),)))
    assert ports_in_kernel(dp) == {53, 80}
    dp.lb_delete(dns)
    assert ports_in_kernel(dp) == {53, 80}  # the IPv6 frontend still listens on 53
    dp.lb_delete(web)
    assert ports_in_kernel(dp) == {53}
    reopened = Datapath.open(dp.base_dir)
    try:
        assert ports_in_kernel(reopened) == {53}
        reopened.lb_delete(dns_v6)
        assert ports_in_kernel(reopened) == set()
    finally:
        reopened.close()


def test_replies_to_a_client_port_that_is_also_a_frontend_port_still_pass(svc: Node) -> None:
    # The reply leaving b goes to (a, 53): its port is a frontend's (the hint says "maybe a
    # frontend"), the service map has no (a, 53), and the reversed tuple finds the flow.
    dp, a, b = svc.dp, svc.a, svc.b
    dp.lb_upsert(LbService(Frontend(VIP, 53, L4Proto.UDP), (Backend(b.v4, 8080),)))
    dp.lb_upsert(LbService(tcp(VIP, 53), (Backend(b.v4, 8080),)))
    dp.sync_policy(b.ep_id, EGRESS_ONLY, [])  # b's egress is enforced, nothing allowed: only replies pass
    denied = dp.counters().packets(endpoint_id=b.ep_id, reason=Reason.DEFAULT_DENY)
    with udp_flow(a.name, socket.AF_INET) as u:
        u.bind(("0.0.0.0", 53))
        assert echoed_from(u, b.v4, 8080) == (b.v4, 8080)
    with socket_in(a.name, socket.AF_INET, socket.SOCK_STREAM) as t:
        t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.bind(("0.0.0.0", 53))
        t.settimeout(ALLOW_TIMEOUT)
        t.connect((b.v4, 8080))
        t.sendall(b"ping")
        assert t.recv(16) == b"ping"
    assert dp.counters().packets(endpoint_id=b.ep_id, reason=Reason.DEFAULT_DENY) == denied


def test_service_connections_pinned_in_the_older_layout_keep_their_backends(bpf_base: str) -> None:
    base = f"{bpf_base}-lbct"
    web = Frontend("10.96.77.20", 80, L4Proto.TCP)
    kept, gone = Backend("10.250.0.2", 8080), Backend("10.250.0.3", 8080)
    dp = Datapath.open(base)
    try:
        state = dp.lb_upsert(LbService(web, (kept, gone)))
        ids = {b: i for i, b in state.backends.items()}
        dp.lb_upsert(LbService(web, (kept,)))  # ``gone``'s id is no more
        # An older agent's service slot: no revision (the word was unused, zero).
        dp.lb._services.write_master(web, Master(state.id, 1, 0, revision=0))
        dp.close()
        # An older agent's map: the same key, the value without address and revision.
        path = os.path.join(base, lbctmap.NAME)
        unpin(path)
        older = MapSpec(
            lbctmap.NAME,
            MapType.LRU_HASH,
            ctypes.sizeof(lbctmap.LbCtKey),
            ctypes.sizeof(lbctmap.LegacyLbCtValue),
            dp.config.sizes.lb_conntrack,
        )
        pinned = PinnedMap.open_or_create(base, older)
        for client_port, backend in ((40000, kept), (40001, gone)):
            key = lbctmap.LbCtKey(sport=socket.htons(client_port), vport=socket.htons(80), ep_id=7, protocol=6)
            key.family = addresses.put(key.saddr, "10.250.0.9")
            addresses.put(key.vaddr, web.address)
            value = lbctmap.LegacyLbCtValue(expires_ns=2**62, backend_id=ids[backend], rev_nat=state.id)
            pinned.update(key, value)
        pinned.close()

        dp = Datapath.open(base)
        (carried,) = dp.lb_conntrack()  # the entry whose backend left is not carried over
        assert (carried.client_port, carried.backend, carried.backend_port, carried.backend_id) == (
            40000,
            kept.address,
            8080,
            ids[kept],
        )
        assert (carried.service_id, carried.revision) == (state.id, dp.lb.revision(web))
        assert dp.lb.revision(web) != 0  # a revision of its own: no zeroed entry can pass for current
    finally:
        dp.teardown()
