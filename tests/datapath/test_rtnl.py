"""The datapath's own route-netlink messages (services.datapath.rtnl).

Encoding (pure): every message the pod path and the tc attach send is byte for byte what
pyroute2 encodes for the same request, and decodes back. Against the kernel (root): a pod
made with them passes packets, a refusal in a batch comes back as an OSError naming the
step and leaves the socket in step, and the tc filters it writes are what the loader reads.
"""

from __future__ import annotations

import errno
import secrets
import socket
import struct
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.datapath import netns, rtnl
from services.datapath.rtnl import Request, Rtnl

REQ_ACK = 0x1 | 0x4
CREATE = REQ_ACK | 0x400 | 0x200
REPLACE = REQ_ACK | 0x400 | 0x100
HOST_MAC, POD_MAC = "02:00:00:00:00:01", "02:00:00:00:00:02"


def pyroute2_bytes(kind: str, msg_type: int, flags: int, fields: dict[str, int], attrs: list[Any]) -> bytes:
    """What pyroute2 encodes for one message (sequence number 7)."""
    from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
    from pyroute2.netlink.rtnl.ndmsg import ndmsg
    from pyroute2.netlink.rtnl.rtmsg import rtmsg
    from pyroute2.netlink.rtnl.tcmsg import tcmsg

    classes: dict[str, Any] = {"link": ifinfmsg, "addr": ifaddrmsg, "route": rtmsg, "neigh": ndmsg, "tc": tcmsg}
    msg = classes[kind]()
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = 7
    for key, value in fields.items():
        msg[key] = value
    msg["attrs"] = attrs
    msg.encode()
    return bytes(msg.data)


def _veth_attrs() -> list[Any]:
    peer = {"attrs": [("IFLA_IFNAME", "eth0"), ("IFLA_ADDRESS", POD_MAC), ("IFLA_NET_NS_FD", 5)]}
    info = {"attrs": [("IFLA_INFO_KIND", "veth"), ("IFLA_INFO_DATA", {"attrs": [("VETH_INFO_PEER", peer)]})]}
    return [("IFLA_IFNAME", "h1"), ("IFLA_ADDRESS", HOST_MAC), ("IFLA_LINKINFO", info)]


BPF_OPTIONS = [("TCA_BPF_CLASSID", 1), ("TCA_BPF_FD", 9), ("TCA_BPF_NAME", "palisade_x"), ("TCA_BPF_FLAGS", 1)]

#: (what, our request, pyroute2's message: class, type, flags, header fields, attributes)
CASES: list[tuple[str, Callable[[], Request], tuple[str, int, int, dict[str, int], list[Any]]]] = [
    (
        "veth with its peer in a namespace",
        lambda: rtnl.new_veth("h1", HOST_MAC, "eth0", POD_MAC, 5),
        ("link", 16, CREATE, {}, _veth_attrs()),
    ),
    ("link up by index", lambda: rtnl.set_up(4), ("link", 16, REQ_ACK, {"index": 4, "flags": 1, "change": 1}, [])),
    (
        "link up by name",
        lambda: rtnl.set_up(name="eth0"),
        ("link", 16, REQ_ACK, {"flags": 1, "change": 1}, [("IFLA_IFNAME", "eth0")]),
    ),
    ("delete link", lambda: rtnl.del_link("h1"), ("link", 17, REQ_ACK, {}, [("IFLA_IFNAME", "h1")])),
    ("get link by name", lambda: rtnl.get_link(name="h1"), ("link", 18, REQ_ACK, {}, [("IFLA_IFNAME", "h1")])),
    ("get link by index", lambda: rtnl.get_link(index=12), ("link", 18, REQ_ACK, {"index": 12}, [])),
    (
        "IPv4 address",
        lambda: rtnl.new_address(3, "10.1.2.3"),
        (
            "addr",
            20,
            CREATE,
            {"family": 2, "prefixlen": 32, "index": 3},
            [("IFA_LOCAL", "10.1.2.3"), ("IFA_ADDRESS", "10.1.2.3")],
        ),
    ),
    (
        "IPv6 address without DAD",
        lambda: rtnl.new_address(3, "fd00::1"),
        ("addr", 20, CREATE, {"family": 10, "prefixlen": 128, "flags": 2, "index": 3}, [("IFA_ADDRESS", "fd00::1")]),
    ),
    (
        "host route, scope link",
        lambda: rtnl.replace_route("10.1.2.3", 32, 3, scope=rtnl.RT_SCOPE_LINK),
        (
            "route",
            24,
            REPLACE,
            {"family": 2, "dst_len": 32, "table": 254, "proto": 4, "scope": 253, "type": 1},
            [("RTA_DST", "10.1.2.3"), ("RTA_OIF", 3)],
        ),
    ),
    (
        "IPv6 host route",
        lambda: rtnl.replace_route("fd00::1", 128, 3),
        (
            "route",
            24,
            REPLACE,
            {"family": 10, "dst_len": 128, "table": 254, "proto": 4, "type": 1},
            [("RTA_DST", "fd00::1"), ("RTA_OIF", 3)],
        ),
    ),
    (
        "IPv4 default through the gateway",
        lambda: rtnl.replace_route("0.0.0.0", 0, 3, gateway="169.254.1.1"),
        (
            "route",
            24,
            REPLACE,
            {"family": 2, "table": 254, "proto": 4, "type": 1},
            [("RTA_OIF", 3), ("RTA_GATEWAY", "169.254.1.1")],
        ),
    ),
    (
        "IPv6 default, gateway on link",
        lambda: rtnl.replace_route("::", 0, 3, gateway="fe80::1", onlink=True),
        (
            "route",
            24,
            REPLACE,
            {"family": 10, "table": 254, "proto": 4, "type": 1, "flags": 4},
            [("RTA_OIF", 3), ("RTA_GATEWAY", "fe80::1")],
        ),
    ),
    (
        "permanent IPv4 neighbour",
        lambda: rtnl.replace_neighbour(3, "169.254.1.1", HOST_MAC),
        (
            "neigh",
            28,
            REPLACE,
            {"family": 2, "ifindex": 3, "state": 128},
            [("NDA_DST", "169.254.1.1"), ("NDA_LLADDR", HOST_MAC)],
        ),
    ),
    (
        "permanent IPv6 neighbour",
        lambda: rtnl.replace_neighbour(3, "fe80::1", HOST_MAC),
        (
            "neigh",
            28,
            REPLACE,
            {"family": 10, "ifindex": 3, "state": 128},
            [("NDA_DST", "fe80::1"), ("NDA_LLADDR", HOST_MAC)],
        ),
    ),
    (
        "neighbour dump",
        lambda: rtnl.dump_neighbours(socket.AF_INET6, 3),
        ("neigh", 30, 0x1 | 0x300, {"family": 10, "ifindex": 3}, []),
    ),
    (
        "clsact qdisc",
        lambda: rtnl.add_clsact(3),
        ("tc", 36, CREATE, {"index": 3, "handle": 0xFFFF0000, "parent": 0xFFFFFFF1}, [("TCA_KIND", "clsact")]),
    ),
    (
        "clsact qdisc removed",
        lambda: rtnl.del_clsact(3),
        ("tc", 37, REQ_ACK, {"index": 3, "handle": 0xFFFF0000, "parent": 0xFFFFFFF1}, [("TCA_KIND", "clsact")]),
    ),
    (
        "direct-action bpf filter, all protocols, prio 1",
        lambda: rtnl.replace_bpf_filter(
            3, parent=0xFFFFFFF2, prio=1, handle=1, protocol=0x0003, prog_fd=9, name="palisade_x"
        ),
        (
            "tc",
            44,
            REPLACE,
            {"index": 3, "handle": 1, "parent": 0xFFFFFFF2, "info": 0x10300},
            [("TCA_KIND", "bpf"), ("TCA_OPTIONS", {"attrs": BPF_OPTIONS})],
        ),
    ),
]


@pytest.mark.parametrize(("what", "ours", "theirs"), CASES, ids=[c[0] for c in CASES])
def test_messages_are_what_pyroute2_encodes(
    what: str, ours: Callable[[], Request], theirs: tuple[str, int, int, dict[str, int], list[Any]]
) -> None:
    assert rtnl.packed(ours(), 7) == pyroute2_bytes(*theirs), what


def test_a_veth_decodes_back_with_its_peer_inside() -> None:
    request = rtnl.new_veth("h1", HOST_MAC, "eth0", POD_MAC, 5)
    top = rtnl.attrs(request.body, 16)
    assert top[rtnl.IFLA_IFNAME] == b"h1\0" and rtnl.mac_text(top[rtnl.IFLA_ADDRESS]) == HOST_MAC
    info = rtnl.attrs(top[rtnl.IFLA_LINKINFO])
    peer = rtnl.attrs(rtnl.attrs(info[rtnl.IFLA_INFO_DATA])[rtnl.VETH_INFO_PEER], 16)
    assert peer == {
        rtnl.IFLA_IFNAME: b"eth0\0",
        rtnl.IFLA_ADDRESS: bytes.fromhex("020000000002"),
        rtnl.IFLA_NET_NS_FD: struct.pack("=I", 5),
    }


def test_chosen_macs_are_unicast_and_locally_administered() -> None:
    macs = {rtnl.random_mac() for _ in range(200)}
    assert len(macs) == 200
    for mac in macs:
        first = int(mac[:2], 16)
        assert first & 0x01 == 0 and first & 0x02 == 0x02, mac


def test_a_link_is_read_from_the_kernels_answer() -> None:
    header = struct.pack("=BxHiII", 0, 1, 42, 0x1043, 0)
    body = rtnl.attr(rtnl.IFLA_IFNAME, b"pal0\0") + rtnl.attr(rtnl.IFLA_ADDRESS, bytes.fromhex("0a0b0c0d0e0f"))
    body += rtnl.attr(rtnl.IFLA_LINK, struct.pack("=I", 2))
    link = rtnl.link_of(rtnl.Message(rtnl.RTM_NEWLINK, header, rtnl.attrs(body)))
    assert link == rtnl.Link(index=42, name="pal0", mac="0a:0b:0c:0d:0e:0f", peer_index=2)


# -- against the kernel ------------------------------------------------------------------


@pytest.fixture
def name() -> Iterator[str]:
    ns = "pr" + secrets.token_hex(3)
    yield ns
    for left in (ns, ns + "b"):
        subprocess.run(["ip", "link", "del", left], capture_output=True, check=False)
        netns.delete_netns(left)


@pytest.mark.root
def test_pods_made_with_it_pass_packets_both_families(name: str) -> None:
    from testkit.traffic import EchoServer, tcp_exchange, udp_exchange

    o2, o3 = 200 + secrets.randbelow(50), secrets.randbelow(256)  # apart from a concurrent run's pods
    a4, a6, b4, b6 = f"10.{o2}.{o3}.1", f"fd10:{o2:x}:{o3:x}::1", f"10.{o2}.{o3}.2", f"fd10:{o2:x}:{o3:x}::2"
    a = netns.create_pod(name, name, [a4, a6])
    b = netns.create_pod(name + "b", name + "b", [b4, b6])
    netns.enable_forwarding()
    assert a.pod_mac != a.host_mac and netns.link_mac(a.host_ifindex) == a.host_mac
    server = EchoServer(b.name, [7007], [7008])
    try:
        assert tcp_exchange(a.name, b4, 7007)
        assert tcp_exchange(a.name, b6, 7007)
        assert udp_exchange(a.name, b6, 7008)
    finally:
        server.close()
    # The host's neighbour entries are the pod's MAC as chosen, for both families.
    assert netns.neighbour_mac(b.host_ifindex, b4) == b.pod_mac
    assert netns.neighbour_mac(b.host_ifindex, b6) == b.pod_mac
    netns.delete_pod(a)
    netns.delete_pod(b)
    assert not netns.pod_alive(a) and netns.link_mac(a.host_ifindex) is None


@pytest.mark.root
def test_a_refusal_names_its_step_and_the_socket_stays_in_step(name: str) -> None:
    with Rtnl() as nl:
        (missing,) = nl.links(rtnl.get_link(name=name))
        assert missing is None
        with pytest.raises(OSError) as err:
            nl.request(rtnl.set_up(name=name), rtnl.get_link(name="lo"))
        assert err.value.errno == errno.ENODEV
        assert f"bringing up interface {name}: No such device" in str(err.value)
        # The answer to the second request was read too: the next request gets its own answers.
        (lo,) = nl.links(rtnl.get_link(name="lo"))
        assert lo is not None and lo.name == "lo" and lo.index == rtnl.LOOPBACK_IFINDEX


@pytest.mark.root
def test_a_duplicate_address_is_refused_by_name_and_undone(name: str) -> None:
    ip = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}.3"
    with pytest.raises(FileExistsError) as err:
        netns.create_pod(name, name, [ip, ip])
    assert f"netlink refused setting up namespace {name}: adding address {ip}" in str(err.value)
    assert name not in netns.list_netns(name), "the namespace made for it is removed again"
    assert subprocess.run(["ip", "link", "show", name], capture_output=True).returncode != 0
