"""The route-netlink messages of a pod's network and of the tc attach, spoken on one socket.

The per-pod path (:mod:`services.datapath.netns`: a veth, its addresses, routes and
neighbours; :mod:`services.datapath.loader`: a clsact qdisc and two bpf filters) sends its
few messages itself instead of through pyroute2. pyroute2 0.9 runs an asyncio event loop
for every request: a pod's network took ~15 requests over three sockets and 10 ms of CPU
(``bench_pod_network``, 40 pods, mean), several times what the kernel spends; sent from here
it takes 1 ms, and a tc attach 0.06 ms instead of 0.9. A request is packed with
:mod:`struct`, messages that may go together go in one ``send`` (the kernel handles them in
order and answers each), and every answer is read before returning.
Everything else (routes between nodes, the DNS steering, the dev cluster) stays on pyroute2.

This is not a netlink library: it knows the messages Palisade sends and the attributes it
reads back (a link's index, name, address and peer index; a neighbour's address), nothing more.
Each kernel refusal is an :class:`OSError` with the kernel's errno (so EEXIST is a
``FileExistsError``), naming what was being done and, where the kernel says it, why.

A netlink socket belongs to the network namespace of the thread that created it:
:class:`Rtnl` made on a thread that entered a pod's namespace talks to that namespace
from any thread afterwards.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import secrets
import socket
import struct
from collections.abc import Iterator

# Message types (linux/rtnetlink.h, linux/netlink.h).
NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_NEWROUTE = 24
RTM_NEWNEIGH = 28
RTM_GETNEIGH = 30
RTM_NEWQDISC = 36
RTM_DELQDISC = 37
RTM_NEWTFILTER = 44

# Header flags.
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
#: On an NLMSG_ERROR: extended-ack attributes follow the echoed header.
NLM_F_ACK_TLVS = 0x200
CREATE = NLM_F_CREATE | NLM_F_EXCL
REPLACE = NLM_F_CREATE | NLM_F_REPLACE

SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NLMSGERR_ATTR_MSG = 1

# Attributes.
IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_LINK = 5
IFLA_LINKINFO = 18
IFLA_NET_NS_FD = 28
IFLA_INFO_KIND = 1
IFLA_INFO_DATA = 2
VETH_INFO_PEER = 1
IFA_ADDRESS = 1
IFA_LOCAL = 2
RTA_DST = 1
RTA_OIF = 4
RTA_GATEWAY = 5
NDA_DST = 1
NDA_LLADDR = 2
TCA_KIND = 1
TCA_OPTIONS = 2
TCA_BPF_CLASSID = 3
TCA_BPF_FD = 6
TCA_BPF_NAME = 7
TCA_BPF_FLAGS = 8
TCA_BPF_FLAG_ACT_DIRECT = 1

IFF_UP = 0x1
IFA_F_NODAD = 0x02
RTNH_F_ONLINK = 0x04
NUD_PERMANENT = 0x80
RT_TABLE_MAIN = 254
RTPROT_STATIC = 4
RTN_UNICAST = 1
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
#: The loopback device's index in every namespace.
LOOPBACK_IFINDEX = 1
#: The clsact qdisc's handle (ffff:0) and parent (TC_H_CLSACT).
CLSACT_HANDLE = 0xFFFF0000
TC_H_CLSACT = 0xFFFFFFF1

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_RTATTR = struct.Struct("=HH")  # len, type
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDRMSG = struct.Struct("=BBBBi")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_NDMSG = struct.Struct("=BxxxiHBB")  # family, ifindex, state, flags, type
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_ERRNO = struct.Struct("=i")
_U32 = struct.Struct("=I")


@dataclasses.dataclass(frozen=True)
class Request:
    """One message: its type, flags beyond REQUEST (and ACK, added unless it is a dump), its body
    (the family header and attributes), what it does (for error messages) and the errnos that are
    an answer rather than a failure (e.g. EEXIST for a qdisc that may be there already)."""

    type: int
    flags: int
    body: bytes
    doing: str
    expected: frozenset[int] = frozenset()

    @property
    def dump(self) -> bool:
        return self.flags & NLM_F_DUMP == NLM_F_DUMP


@dataclasses.dataclass(frozen=True)
class Answer:
    """The kernel's answer to one request: 0 or an expected errno, and the messages it sent."""

    error: int
    messages: tuple[Message, ...] = ()


@dataclasses.dataclass(frozen=True)
class Message:
    """A message the kernel sent: its type, the fixed header after the netlink one, its attributes."""

    type: int
    header: bytes
    attrs: dict[int, bytes]


@dataclasses.dataclass(frozen=True)
class Link:
    """What :func:`get_link` reports of an interface."""

    index: int
    name: str
    mac: str
    #: For a veth: its peer's index (in the peer's namespace); else its own index or 0.
    peer_index: int


# -- encoding -------------------------------------------------------------------------


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    size = _RTATTR.size + len(payload)
    return _RTATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def u32(value: int) -> bytes:
    return _U32.pack(value)


def asciiz(text: str) -> bytes:
    return text.encode() + b"\0"


def mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def mac_text(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def random_mac() -> str:
    """A random unicast, locally administered Ethernet address (as the kernel's eth_random_addr)."""
    raw = bytearray(secrets.token_bytes(6))
    raw[0] = (raw[0] & 0xFE) | 0x02
    return mac_text(bytes(raw))


def _ifinfo(index: int = 0, *, up: bool = False) -> bytes:
    return _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, IFF_UP if up else 0, IFF_UP if up else 0)


def new_veth(name: str, mac: str, peer: str, peer_mac: str, peer_netns_fd: int) -> Request:
    """A veth ``name`` (down) whose peer ``peer`` is made directly in the namespace ``peer_netns_fd``."""
    peer_info = _ifinfo() + attr(IFLA_IFNAME, asciiz(peer)) + attr(IFLA_ADDRESS, mac_bytes(peer_mac))
    peer_info += attr(IFLA_NET_NS_FD, u32(peer_netns_fd))
    info = attr(IFLA_INFO_KIND, asciiz("veth")) + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer_info))
    body = _ifinfo() + attr(IFLA_IFNAME, asciiz(name)) + attr(IFLA_ADDRESS, mac_bytes(mac)) + attr(IFLA_LINKINFO, info)
    return Request(RTM_NEWLINK, CREATE, body, f"creating veth {name} with peer {peer}")


def set_up(index: int = 0, name: str = "") -> Request:
    """Bring a link up, by index or (index 0) by name."""
    body = _ifinfo(index, up=True) + (attr(IFLA_IFNAME, asciiz(name)) if name else b"")
    return Request(RTM_NEWLINK, 0, body, f"bringing up interface {name or index}")


def del_link(name: str) -> Request:
    return Request(RTM_DELLINK, 0, _ifinfo() + attr(IFLA_IFNAME, asciiz(name)), f"deleting interface {name}")


def get_link(*, index: int = 0, name: str = "") -> Request:
    body = _ifinfo(index) + (attr(IFLA_IFNAME, asciiz(name)) if name else b"")
    return Request(RTM_GETLINK, 0, body, f"looking up interface {name or index}")


def _family(ip: str) -> tuple[int, bytes, int]:
    """(address family, packed address, full prefix length) of ``ip``."""
    addr = ipaddress.ip_address(ip)
    return (socket.AF_INET if addr.version == 4 else socket.AF_INET6), addr.packed, addr.max_prefixlen


def new_address(index: int, ip: str) -> Request:
    """``ip`` as a /32 (/128) on interface ``index``; IPv6 without duplicate address detection."""
    family, packed, prefix = _family(ip)
    if family == socket.AF_INET:
        header = _IFADDRMSG.pack(family, prefix, 0, RT_SCOPE_UNIVERSE, index)
        body = header + attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed)
    else:
        body = _IFADDRMSG.pack(family, prefix, IFA_F_NODAD, RT_SCOPE_UNIVERSE, index) + attr(IFA_ADDRESS, packed)
    return Request(RTM_NEWADDR, CREATE, body, f"adding address {ip} to interface {index}")


def replace_route(
    dst: str, prefixlen: int, index: int, *, gateway: str = "", scope: int = RT_SCOPE_UNIVERSE, onlink: bool = False
) -> Request:
    """A static route to ``dst/prefixlen`` out of ``index`` (through ``gateway``), created or replaced."""
    family, packed, _ = _family(dst)
    header = _RTMSG.pack(
        family, prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, scope, RTN_UNICAST, RTNH_F_ONLINK if onlink else 0
    )
    body = header + (attr(RTA_DST, packed) if prefixlen else b"") + attr(RTA_OIF, u32(index))
    if gateway:
        body += attr(RTA_GATEWAY, _family(gateway)[1])
    return Request(RTM_NEWROUTE, REPLACE, body, f"setting the route to {dst}/{prefixlen} on interface {index}")


def replace_neighbour(index: int, ip: str, mac: str) -> Request:
    """A permanent neighbour entry: ``ip`` is ``mac`` on interface ``index``."""
    family, packed, _ = _family(ip)
    body = _NDMSG.pack(family, index, NUD_PERMANENT, 0, 0) + attr(NDA_DST, packed) + attr(NDA_LLADDR, mac_bytes(mac))
    return Request(RTM_NEWNEIGH, REPLACE, body, f"setting the neighbour {ip} on interface {index}")


def dump_neighbours(family: int, index: int) -> Request:
    body = _NDMSG.pack(family, index, 0, 0, 0)
    return Request(RTM_GETNEIGH, NLM_F_DUMP, body, f"listing the neighbours of interface {index}")


def add_clsact(index: int) -> Request:
    """The clsact qdisc on interface ``index``; EEXIST (there already) is an answer."""
    body = _TCMSG.pack(socket.AF_UNSPEC, index, CLSACT_HANDLE, TC_H_CLSACT, 0) + attr(TCA_KIND, asciiz("clsact"))
    return Request(
        RTM_NEWQDISC, CREATE, body, f"adding the clsact qdisc to interface {index}", frozenset({errno.EEXIST})
    )


def del_clsact(index: int, expected: frozenset[int] = frozenset()) -> Request:
    body = _TCMSG.pack(socket.AF_UNSPEC, index, CLSACT_HANDLE, TC_H_CLSACT, 0) + attr(TCA_KIND, asciiz("clsact"))
    return Request(RTM_DELQDISC, 0, body, f"removing the clsact qdisc of interface {index}", expected)


def replace_bpf_filter(
    index: int, *, parent: int, prio: int, handle: int, protocol: int, prog_fd: int, name: str, classid: int = 1
) -> Request:
    """A direct-action bpf filter running ``prog_fd`` on hook ``parent`` of interface ``index``,
    created or replaced in place (same prio and handle)."""
    info = (prio << 16) | socket.htons(protocol)
    options = attr(TCA_BPF_CLASSID, u32(classid)) + attr(TCA_BPF_FD, u32(prog_fd)) + attr(TCA_BPF_NAME, asciiz(name))
    options += attr(TCA_BPF_FLAGS, u32(TCA_BPF_FLAG_ACT_DIRECT))
    body = _TCMSG.pack(socket.AF_UNSPEC, index, handle, parent, info) + attr(TCA_KIND, asciiz("bpf"))
    body += attr(TCA_OPTIONS, options)
    return Request(RTM_NEWTFILTER, REPLACE, body, f"attaching bpf filter {name} to interface {index}")


def packed(req: Request, seq: int) -> bytes:
    """``req`` as sent: the netlink header (REQUEST, and ACK unless it is a dump) and its body."""
    flags = NLM_F_REQUEST | req.flags | (0 if req.dump else NLM_F_ACK)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(req.body), req.type, flags, seq, 0) + req.body


# -- decoding -------------------------------------------------------------------------


def attrs(data: bytes, offset: int = 0) -> dict[int, bytes]:
    """The attributes in ``data`` from ``offset``, by type (nested ones left packed)."""
    out: dict[int, bytes] = {}
    while offset + _RTATTR.size <= len(data):
        size, kind = _RTATTR.unpack_from(data, offset)
        if size < _RTATTR.size:
            break
        out[kind & 0x3FFF] = data[offset + _RTATTR.size : offset + size]
        offset += (size + 3) & ~3
    return out


def _messages(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        size, kind, flags, seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if size < _NLMSGHDR.size:
            break
        yield kind, flags, seq, data[offset + _NLMSGHDR.size : offset + size]
        offset += (size + 3) & ~3


_HEADERS = {
    RTM_NEWLINK: _IFINFOMSG.size,
    RTM_NEWNEIGH: _NDMSG.size,
}


def link_of(message: Message) -> Link:
    _family, _type, index, _flags, _change = _IFINFOMSG.unpack(message.header)
    name = message.attrs.get(IFLA_IFNAME, b"").rstrip(b"\0").decode()
    peer = message.attrs.get(IFLA_LINK)
    return Link(index, name, mac_text(message.attrs.get(IFLA_ADDRESS, b"")), _U32.unpack(peer)[0] if peer else 0)


def neighbour_of(message: Message) -> tuple[int, int, str, str]:
    """(ifindex, state, ip, mac) of a neighbour entry (ip and mac empty when the kernel gives none)."""
    _family, index, state, _flags, _type = _NDMSG.unpack(message.header)
    dst, lladdr = message.attrs.get(NDA_DST, b""), message.attrs.get(NDA_LLADDR, b"")
    ip = str(ipaddress.ip_address(dst)) if len(dst) in (4, 16) else ""
    return index, state, ip, mac_text(lladdr) if len(lladdr) == 6 else ""


# -- the socket -----------------------------------------------------------------------


class Rtnl:
    """A NETLINK_ROUTE socket in the namespace of the thread that makes it. Not thread-safe:
    one caller at a time (the loader holds its lock; netns opens one per call)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        try:
            self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)  # refusals echo only the header
            self._sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)  # and say why
            self._sock.bind((0, 0))
        except BaseException:
            self._sock.close()
            raise
        self._seq = 0

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def request(self, *requests: Request) -> list[Answer]:
        """Send ``requests`` in one datagram (the kernel handles them in order, each whatever became
        of the one before) and read every answer. Raises the first refusal that is not expected, as
        an OSError naming what was being done; the rest were answered (and read) all the same.
        At most one dump, and last: the kernel serves one dump at a time per socket."""
        first = self._seq + 1
        self._seq += len(requests)
        self._sock.send(b"".join(packed(req, number) for number, req in enumerate(requests, first)))
        errors: dict[int, tuple[int, str]] = {}
        replies: dict[int, list[Message]] = {number: [] for number in range(first, first + len(requests))}
        pending = set(replies)
        while pending:
            for kind, flags, seq, payload in _messages(self._sock.recv(1 << 16)):
                if seq not in pending:
                    continue
                if kind == NLMSG_ERROR:
                    (code,) = _ERRNO.unpack_from(payload)
                    if code:
                        errors[seq] = (-code, _ext_ack_message(flags, payload))
                    pending.discard(seq)
                elif kind == NLMSG_DONE:
                    pending.discard(seq)
                else:
                    size = _HEADERS.get(kind, 0)
                    replies[seq].append(Message(kind, payload[:size], attrs(payload, size)))
        answers: list[Answer] = []
        for number, req in enumerate(requests, first):
            code, why = errors.get(number, (0, ""))
            if code and code not in req.expected:
                detail = f"{req.doing}: {os.strerror(code)}" + (f" ({why})" if why else "")
                raise OSError(code, detail)
            answers.append(Answer(code, tuple(replies[number])))
        return answers

    def links(self, *requests: Request) -> list[Link | None]:
        """Send GETLINK ``requests`` (see :func:`get_link`): each link, or None where there is none."""
        answers = self.request(*(dataclasses.replace(r, expected=frozenset({errno.ENODEV})) for r in requests))
        return [link_of(a.messages[0]) if a.messages else None for a in answers]

    def neighbours(self, family: int, index: int) -> list[tuple[int, int, str, str]]:
        """The neighbour entries of interface ``index`` in ``family`` (see :func:`neighbour_of`)."""
        (answer,) = self.request(dump_neighbours(family, index))
        return [neighbour_of(m) for m in answer.messages if m.type == RTM_NEWNEIGH]


def _ext_ack_message(flags: int, payload: bytes) -> str:
    """The kernel's explanation in an extended ack, if it gave one (after the echoed header)."""
    if not flags & NLM_F_ACK_TLVS:
        return ""
    found = attrs(payload, _ERRNO.size + _NLMSGHDR.size).get(NLMSGERR_ATTR_MSG, b"")
    return found.rstrip(b"\0").decode(errors="replace")
