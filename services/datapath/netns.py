"""Pod networking on one node: named network namespaces joined to the host by veths.

Every pod gets a veth pair: ``eth0`` inside its namespace, a named host-side
end where the datapath attaches. Pods are routed, not bridged (as Cilium and
Calico do):

- inside the pod, each address is a /32 (or /128) on ``eth0``; the default
  route goes to a link-local gateway (169.254.1.1, fe80::1) whose neighbour
  entry is pinned to the host veth's MAC, so no ARP/ND is needed to leave;
- on the host, a /32 (/128) route per pod address points at its veth, with a
  permanent neighbour entry for the pod's MAC;
- IPv4 and IPv6 forwarding are on, so pod-to-pod traffic crosses the host's
  routing table and both veths (egress policy at the source's, ingress policy
  at the destination's).

This module is the one way pods are wired: the service (through
:class:`NetnsPodNetwork`), the tests and the benchmarks all call :func:`create_pod`
and :func:`delete_pod`. Named namespaces are made as ``ip netns add`` makes them (a
bind mount of a namespace under a shared /run/netns), but in the process: a thread
unshares its network namespace and mounts it, with no fork of a process that runs gRPC
threads (pyroute2's way forks without exec) and no exec of ``ip`` (a fork of this
process costs milliseconds per pod).

The netlink messages are our own (:mod:`services.datapath.rtnl`), not pyroute2's: pyroute2 runs
an event loop per request, and a pod's ~15 requests cost more CPU than the kernel's work. A
pod's network is three sends on the host's socket and one on a socket opened in its
namespace (by the thread that made the namespace, before it ends; everything is sent from
the caller).

It is made in two steps, so that the first can run while the pod's addresses are being
allocated: :func:`plug_pod` (the namespace and the veth, nothing routed) and
:func:`address_pod` (addresses, routes and neighbours on both sides). :func:`create_pod`
is both.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from services.common.log import get_logger
from services.datapath import rtnl
from services.datapath.rtnl import Rtnl
from services.datapath.types import Address

log = get_logger("netns")

NETNS_DIR = "/run/netns"
GATEWAY_V4 = "169.254.1.1"
GATEWAY_V6 = "fe80::1"
POD_IFNAME = "eth0"
CLONE_NEWNET = 0x40000000
RT_SCOPE_LINK = rtnl.RT_SCOPE_LINK
IFNAMSIZ = 15

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PodLink:
    """A pod's network as set up: its namespace and the host end of its veth."""

    #: Path of the namespace, e.g. /run/netns/pal_x_web.
    netns: str
    #: True when :func:`create_pod` created the namespace (and :func:`delete_pod` deletes it).
    netns_owned: bool
    host_ifname: str
    host_ifindex: int
    host_mac: str = ""
    pod_mac: str = ""
    #: The addresses routed to the pod.
    ips: tuple[str, ...] = ()
    #: False when another CNI plugin made the veth: :func:`delete_pod` leaves it.
    link_owned: bool = True
    pod_ifname: str = POD_IFNAME

    @property
    def name(self) -> str:
        """The namespace's name under /run/netns (what ``ip netns exec`` takes)."""
        return os.path.basename(self.netns)


def enable_forwarding() -> None:
    """Turn on IPv4 and IPv6 forwarding in the host namespace."""
    for path in ("/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"):
        with open(path) as f:
            if f.read().strip() == "1":
                continue
        with open(path, "w") as f:
            f.write("1")


def netns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def name_of(netns: str) -> str:
    """The name under /run/netns of a namespace given by name or path (/var/run/netns/x too)."""
    path = Path(netns)
    if len(path.parts) > 1 and Path(os.path.realpath(path.parent)) == Path(os.path.realpath(NETNS_DIR)):
        return path.name
    if path.parent != Path(NETNS_DIR) and len(path.parts) > 1:
        raise ValueError(f"network namespace {netns} is not under {NETNS_DIR}; bind-mount it there (ip netns attach)")
    return path.name


MS_BIND = 0x1000
MS_REC = 0x4000
MS_SHARED = 1 << 20
MNT_DETACH = 2
_netns_dir_lock = threading.Lock()
_netns_dir_shared = False


def _mount(source: str, target: str, flags: int) -> None:
    if _libc().mount(source.encode(), target.encode(), b"none", flags, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source or '(propagation)'} on {target}: {os.strerror(code)}")


def _shared_netns_dir() -> None:
    """/run/netns as ``ip netns`` keeps it: a shared mount, so namespaces mounted there are seen
    from other mount namespaces (the runtime's, a pod's) and their unmount propagates."""
    global _netns_dir_shared
    with _netns_dir_lock:
        if _netns_dir_shared:
            return
        os.makedirs(NETNS_DIR, mode=0o755, exist_ok=True)
        try:
            _mount("", NETNS_DIR, MS_SHARED | MS_REC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: not a mount point yet
                raise
            _mount(NETNS_DIR, NETNS_DIR, MS_BIND | MS_REC)
            _mount("", NETNS_DIR, MS_SHARED | MS_REC)
        _netns_dir_shared = True


def create_netns(name: str, inside: Callable[[], T] | None = None) -> T | None:
    """A new network namespace, named ``name`` under /run/netns (``ip netns add name``).

    ``inside`` runs in the new namespace before the thread that made it ends (a socket it opens
    stays in the namespace): its result is returned.
    """
    path = netns_path(name)
    _shared_netns_dir()
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST,
            f"network namespace {name} already exists (left over?); delete it (ip netns del {name}) "
            "or pass it as netns to adopt it",
        ) from None
    failure: list[OSError] = []
    result: list[T] = []

    def make() -> None:
        # The thread's own namespace changes (network namespaces are per thread), then the mount
        # holds it after the thread ends.
        if _libc().unshare(CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            failure.append(OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}"))
            return
        try:
            _mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", path, MS_BIND)
            if inside is not None:
                result.append(inside())
        except OSError as exc:
            failure.append(exc)

    thread = threading.Thread(target=make, name=f"netns-add-{name}")
    thread.start()
    thread.join()
    if failure:
        with contextlib.suppress(OSError):
            _libc().umount2(path.encode(), MNT_DETACH)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise OSError(failure[0].errno, f"cannot create network namespace {name}: {failure[0].strerror}")
    return result[0] if result else None


def delete_netns(name: str) -> None:
    """Remove the name (``ip netns del name``); the kernel frees the namespace once nothing uses it."""
    path = netns_path(name)
    if not os.path.exists(path):
        return
    if _libc().umount2(path.encode(), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code != errno.EINVAL:  # EINVAL: not mounted (a half-made name)
            raise OSError(code, f"umount {path}: {os.strerror(code)}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def in_netns(name: str, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a thread that has entered the namespace ``name`` (a name or a path).

    Network namespaces are per thread, so the rest of the process stays where
    it is; sockets created by ``fn`` keep belonging to ``name`` afterwards.
    """
    result: list[T] = []
    failure: list[BaseException] = []
    path = name if os.path.isabs(name) else netns_path(name)

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc().setns(fd, CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns: {os.strerror(code)}", name)
            finally:
                os.close(fd)
            result.append(fn(*args))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{os.path.basename(name)}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


#: Neighbour states whose link-layer address is usable (NUD_VALID in the kernel).
NUD_VALID = 0x80 | 0x40 | 0x02 | 0x04 | 0x08 | 0x10  # permanent, noarp, reachable, stale, delay, probe


def link_mac(ifindex: int) -> str | None:
    """The Ethernet address of host interface ``ifindex``; None if it does not exist (any more)."""
    with Rtnl() as nl:
        (link,) = nl.links(rtnl.get_link(index=ifindex))
    return link.mac if link is not None else None


def neighbour_mac(ifindex: int, ip: str) -> str | None:
    """The Ethernet address the host's neighbour table gives ``ip`` on interface ``ifindex``
    (a pod behind its veth), if it has a usable one."""
    addr = ipaddress.ip_address(ip)
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    with Rtnl() as nl:
        for index, state, dst, lladdr in nl.neighbours(family, ifindex):
            if index == ifindex and dst and lladdr and state & NUD_VALID and ipaddress.ip_address(dst) == addr:
                return lladdr
    return None


def _host_requests(index: int, addrs: tuple[str, ...], pod_mac: str) -> list[rtnl.Request]:
    """The host side once the veth exists: up, then per pod address a route and a neighbour."""
    out = [rtnl.set_up(index)]
    for ip in addrs:
        if ipaddress.ip_address(ip).version == 4:
            out.append(rtnl.replace_route(ip, 32, index, scope=RT_SCOPE_LINK))
        else:
            out.append(rtnl.replace_route(ip, 128, index))
        out.append(rtnl.replace_neighbour(index, ip, pod_mac))
    return out


def _pod_requests(index: int, addrs: tuple[str, ...], host_mac: str) -> list[rtnl.Request]:
    """The pod side: lo and the pod's interface up, its addresses, the routes to the link-local
    gateway and its neighbour entry (the host veth's MAC, so nothing is resolved to leave)."""
    out = [rtnl.set_up(rtnl.LOOPBACK_IFINDEX), rtnl.set_up(index)]
    out += [rtnl.new_address(index, ip) for ip in addrs]
    if any(ipaddress.ip_address(ip).version == 4 for ip in addrs):
        out.append(rtnl.replace_route(GATEWAY_V4, 32, index, scope=RT_SCOPE_LINK))
        out.append(rtnl.replace_route("0.0.0.0", 0, index, gateway=GATEWAY_V4))
        out.append(rtnl.replace_neighbour(index, GATEWAY_V4, host_mac))
    if any(ipaddress.ip_address(ip).version == 6 for ip in addrs):
        out.append(rtnl.replace_route("::", 0, index, gateway=GATEWAY_V6, onlink=True))
        out.append(rtnl.replace_neighbour(index, GATEWAY_V6, host_mac))
    return out


@dataclasses.dataclass
class PodPlug:
    """A pod's namespace joined to the host by its veth, nothing routed yet (:func:`plug_pod`)."""

    #: The link as :func:`address_pod` completes it (``ips`` empty until then).
    link: PodLink
    #: The pod interface's index inside its namespace.
    pod_index: int
    #: A netlink socket in the pod's namespace, made with a namespace this module created
    #: (None: opened when the pod is addressed); :func:`address_pod` closes it.
    inside: Rtnl | None = None

    def close(self) -> None:
        if self.inside is not None:
            self.inside.close()
            self.inside = None


def plug_pod(netns: str, host_ifname: str, *, create: bool = True, pod_ifname: str = POD_IFNAME) -> PodPlug:
    """Join namespace ``netns`` (a name or a path under /run/netns) to the host by a veth, unrouted.

    With ``create`` the namespace is created first (it must not exist) and belongs to the
    pod; otherwise it must exist and is adopted (the caller keeps it). The veth pair is
    ``pod_ifname`` inside and ``host_ifname`` on the host, where the BPF programs attach.
    On failure everything created so far is removed again. Failures are OSErrors:
    FileExistsError when the namespace (created), the host interface or the pod's interface
    (in an adopted namespace) is already there.

    The veth is made with its peer already in the namespace (moving a device between
    namespaces costs the kernel far more) and both MACs chosen here, so nothing is read back
    but the two ifindexes.
    """
    if len(host_ifname) > IFNAMSIZ:
        raise ValueError(f"interface name {host_ifname!r} is longer than {IFNAMSIZ} characters")
    name = name_of(netns)
    with Rtnl() as nl:
        if nl.links(rtnl.get_link(name=host_ifname))[0] is not None:
            raise FileExistsError(
                errno.EEXIST, f"interface {host_ifname} already exists on the host; delete the old endpoint first"
            )
        inside: Rtnl | None = None
        if create:
            inside = create_netns(name, _new_namespace_socket)
        elif not os.path.exists(netns_path(name)):
            raise FileNotFoundError(errno.ENOENT, f"network namespace {netns_path(name)} does not exist")
        link = PodLink(netns_path(name), create, host_ifname, 0, pod_ifname=pod_ifname)
        host_mac, pod_mac = rtnl.random_mac(), rtnl.random_mac()
        try:
            ns_fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                _made, found = nl.request(
                    rtnl.new_veth(host_ifname, host_mac, pod_ifname, pod_mac, ns_fd),
                    rtnl.get_link(name=host_ifname),
                )
            except OSError as exc:
                raise _refusal(name, exc, pod_ifname) from None
            finally:
                os.close(ns_fd)
            host = rtnl.link_of(found.messages[0])
            _sysctl(f"/proc/sys/net/ipv6/conf/{host_ifname}/accept_dad", "0")
        except BaseException:
            if inside is not None:
                inside.close()
            delete_pod(link)
            raise
    link = dataclasses.replace(link, host_ifindex=host.index, host_mac=host_mac, pod_mac=pod_mac)
    # The veth's peer index (IFLA_LINK) is the pod interface's index in its namespace.
    return PodPlug(link, host.peer_index, inside)


def address_pod(plug: PodPlug, ips: Sequence[str]) -> PodLink:
    """Route ``ips`` to a plugged pod: the host side up with a route and a neighbour entry per
    address, the pod side up with its addresses and its routes to the gateway. The plug's socket
    is closed either way; on failure the caller removes the pod's network (:func:`delete_pod`)."""
    link = plug.link
    addrs = tuple(str(ipaddress.ip_address(ip)) for ip in ips)
    try:
        with Rtnl() as nl:
            nl.request(*_host_requests(link.host_ifindex, addrs, link.pod_mac))
        inside = plug.inside or in_netns(link.netns, _pod_socket, link.pod_ifname)
        plug.inside = inside
        inside.request(*_pod_requests(plug.pod_index, addrs, link.host_mac))
    except OSError as exc:
        raise _refusal(link.name, exc) from exc
    finally:
        plug.close()
    log.info(
        "pod network created", netns=link.name, veth=link.host_ifname, ifindex=link.host_ifindex, ips=",".join(addrs)
    )
    return dataclasses.replace(link, ips=addrs)


def create_pod(
    netns: str, host_ifname: str, ips: Sequence[str], *, create: bool = True, pod_ifname: str = POD_IFNAME
) -> PodLink:
    """:func:`plug_pod` and :func:`address_pod` at once; on failure everything made is removed."""
    addrs = tuple(str(ipaddress.ip_address(ip)) for ip in ips)
    plug = plug_pod(netns, host_ifname, create=create, pod_ifname=pod_ifname)
    try:
        return address_pod(plug, addrs)
    except BaseException:
        delete_pod(plug.link)
        raise


def _refusal(name: str, exc: OSError, pod_ifname: str = "") -> OSError:
    """A kernel refusal while setting up namespace ``name``, said so; with ``pod_ifname``, EEXIST from
    creating the veth: the namespace has that interface already."""
    if pod_ifname and exc.errno == errno.EEXIST:
        return FileExistsError(
            errno.EEXIST,
            f"network namespace {name} already has an interface {pod_ifname} (another pod's network); "
            "give the pod a namespace of its own",
        )
    return OSError(exc.errno, f"netlink refused setting up namespace {name}: {exc.strerror}")


def adopt_pod(netns: str, host_ifname: str, ips: Sequence[str]) -> PodLink:
    """The network another CNI plugin gave a pod (chained mode): its host-side veth, as it is.

    Nothing is configured or changed; the link is the other plugin's (``link_owned`` False).
    FileNotFoundError when the namespace or the interface does not exist.
    """
    name = name_of(netns)
    if not os.path.exists(netns_path(name)):
        raise FileNotFoundError(errno.ENOENT, f"network namespace {netns_path(name)} does not exist")
    with Rtnl() as nl:
        (found,) = nl.links(rtnl.get_link(name=host_ifname))
    if found is None:
        raise FileNotFoundError(
            errno.ENOENT,
            f"host interface {host_ifname} does not exist; the previous plugin's result names a veth it did "
            "not create on the host",
        )
    addrs = tuple(str(ipaddress.ip_address(ip)) for ip in ips)
    return PodLink(netns_path(name), False, host_ifname, found.index, host_mac=found.mac, ips=addrs, link_owned=False)


def _sysctl(path: str, value: str) -> None:
    with contextlib.suppress(FileNotFoundError), open(path, "w") as f:
        f.write(value)


def _new_namespace_socket() -> Rtnl:
    """Runs in a namespace just made (see :func:`create_netns`): interfaces made in it from now on
    do no duplicate address detection, and a netlink socket that stays in it."""
    _sysctl("/proc/sys/net/ipv6/conf/default/accept_dad", "0")
    return Rtnl()


def _pod_socket(pod_ifname: str) -> Rtnl:
    """Runs inside the pod's namespace (see :func:`in_netns`): no duplicate address detection on
    its interface (before it comes up), and a netlink socket that stays in the namespace."""
    # /proc/sys/net follows the namespace of the thread that opens it.
    _sysctl(f"/proc/sys/net/ipv6/conf/{pod_ifname}/accept_dad", "0")
    return Rtnl()


def delete_pod(link: PodLink) -> None:
    """Remove the host veth (its routes, neighbours and pod end go with it) and an owned namespace; idempotent."""
    if link.link_owned:
        with Rtnl() as nl:
            nl.request(dataclasses.replace(rtnl.del_link(link.host_ifname), expected=frozenset({errno.ENODEV})))
    if link.netns_owned:  # an adopted namespace is the caller's
        delete_netns(link.name)


def pod_alive(link: PodLink) -> bool:
    """Whether the namespace and the host veth of a pod still exist."""
    if not os.path.exists(link.netns):
        return False
    with Rtnl() as nl:
        return nl.links(rtnl.get_link(name=link.host_ifname))[0] is not None


def list_netns(prefix: str = "") -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


class NetnsPodNetwork:
    """The endpoint manager's pod network over this module (blocking calls)."""

    def plug(self, *, netns: str, create: bool, host_ifname: str, pod_ifname: str = POD_IFNAME) -> PodPlug:
        enable_forwarding()
        return plug_pod(netns, host_ifname, create=create, pod_ifname=pod_ifname)

    def address(self, plug: PodPlug, addresses: Sequence[Address]) -> PodLink:
        return address_pod(plug, [a.ip for a in addresses])

    def adopt(self, *, netns: str, host_ifname: str, ips: Sequence[str]) -> PodLink:
        enable_forwarding()
        return adopt_pod(netns, host_ifname, ips)

    def teardown(self, link: PodLink) -> None:
        delete_pod(link)

    def alive(self, link: PodLink) -> bool:
        return pod_alive(link)

    def exists(self, netns: str) -> bool:
        return os.path.exists(netns)
