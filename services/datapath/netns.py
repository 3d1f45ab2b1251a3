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
and :func:`delete_pod`. Namespaces are created with ``ip netns add``, which forks
and execs: pyroute2's in-process creation forks without exec, which is not safe in a
process running gRPC threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import os
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from services.common.log import get_logger
from services.datapath.types import Address

log = get_logger("netns")

NETNS_DIR = "/run/netns"
GATEWAY_V4 = "169.254.1.1"
GATEWAY_V6 = "fe80::1"
POD_IFNAME = "eth0"
CLONE_NEWNET = 0x40000000
NUD_PERMANENT = 0x80
IFA_F_NODAD = 0x02
RTNH_F_ONLINK = 0x04
RT_SCOPE_LINK = 253
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


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)} failed: {result.stderr.strip() or result.returncode}")


def create_netns(name: str) -> None:
    if os.path.exists(netns_path(name)):
        raise FileExistsError(
            errno.EEXIST,
            f"network namespace {name} already exists (left over?); delete it (ip netns del {name}) "
            "or pass it as netns to adopt it",
        )
    _ip("netns", "add", name)


def delete_netns(name: str) -> None:
    if os.path.exists(netns_path(name)):
        _ip("netns", "del", name)


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
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
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


def _mac(ipr: Any, index: int) -> str:
    return str(ipr.get_links(index)[0].get_attr("IFLA_ADDRESS"))


#: Neighbour states whose link-layer address is usable (NUD_VALID in the kernel).
NUD_VALID = 0x80 | 0x40 | 0x02 | 0x04 | 0x08 | 0x10  # permanent, noarp, reachable, stale, delay, probe


def link_mac(ifindex: int) -> str | None:
    """The Ethernet address of host interface ``ifindex``; None if it does not exist (any more)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        try:
            return _mac(ipr, ifindex)
        except NetlinkError:
            return None


def neighbour_mac(ifindex: int, ip: str) -> str | None:
    """The Ethernet address the host's neighbour table gives ``ip`` on interface ``ifindex``
    (a pod behind its veth), if it has a usable one."""
    from pyroute2 import IPRoute

    addr = ipaddress.ip_address(ip)
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    with IPRoute() as ipr:
        for neigh in ipr.get_neighbours(family=family, ifindex=ifindex):
            dst, lladdr = neigh.get_attr("NDA_DST"), neigh.get_attr("NDA_LLADDR")
            if dst and lladdr and neigh["state"] & NUD_VALID and ipaddress.ip_address(dst) == addr:
                return str(lladdr)
    return None


def _route_args(ip: str) -> dict[str, Any]:
    addr = ipaddress.ip_address(ip)
    if addr.version == 4:
        return {"dst": f"{ip}/32", "family": socket.AF_INET, "scope": RT_SCOPE_LINK}
    return {"dst": f"{ip}/128", "family": socket.AF_INET6}


def create_pod(
    netns: str, host_ifname: str, ips: Sequence[str], *, create: bool = True, pod_ifname: str = POD_IFNAME
) -> PodLink:
    """Join namespace ``netns`` (a name or a path under /run/netns) to the host and route ``ips`` to it.

    With ``create`` the namespace is created first (it must not exist) and belongs to the
    pod; otherwise it must exist and is adopted (the caller keeps it). A veth pair joins
    it to the host: ``pod_ifname`` inside, ``host_ifname`` on the host, where the BPF
    programs attach. On failure everything created so far is removed again.
    Failures are OSErrors: FileExistsError when the namespace (created), the host
    interface or the pod's interface (in an adopted namespace) is already there.
    """
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    if len(host_ifname) > IFNAMSIZ:
        raise ValueError(f"interface name {host_ifname!r} is longer than {IFNAMSIZ} characters")
    name = name_of(netns)
    addrs = tuple(str(ipaddress.ip_address(ip)) for ip in ips)
    with IPRoute() as ipr:
        if ipr.link_lookup(ifname=host_ifname):
            raise FileExistsError(
                errno.EEXIST, f"interface {host_ifname} already exists on the host; delete the old endpoint first"
            )
    if create:
        create_netns(name)
    elif not os.path.exists(netns_path(name)):
        raise FileNotFoundError(errno.ENOENT, f"network namespace {netns_path(name)} does not exist")
    link = PodLink(netns_path(name), create, host_ifname, 0, ips=addrs)
    try:
        try:
            with IPRoute() as ipr:
                try:
                    ipr.link("add", ifname=host_ifname, kind="veth", peer={"ifname": pod_ifname, "net_ns_fd": name})
                except NetlinkError as exc:
                    if exc.code != errno.EEXIST:
                        raise
                    raise FileExistsError(
                        errno.EEXIST,
                        f"network namespace {name} already has an interface {pod_ifname} (another pod's network); "
                        "give the pod a namespace of its own",
                    ) from None
                host_index = int(ipr.link_lookup(ifname=host_ifname)[0])
                host_mac = _mac(ipr, host_index)
                _sysctl(f"/proc/sys/net/ipv6/conf/{host_ifname}/accept_dad", "0")
                ipr.link("set", index=host_index, state="up")

            pod_mac = in_netns(name, _setup_pod_side, pod_ifname, addrs, host_mac)

            with IPRoute() as ipr:
                for ip in addrs:
                    ipr.route("replace", oif=host_index, **_route_args(ip))
                    ipr.neigh("replace", dst=ip, lladdr=pod_mac, ifindex=host_index, state=NUD_PERMANENT)
        except NetlinkError as exc:  # an OSError, so callers need not know pyroute2
            raise OSError(exc.code, f"netlink refused setting up namespace {name}: {exc}") from exc
    except BaseException:
        delete_pod(link)
        raise
    log.info("pod network created", netns=name, veth=host_ifname, ifindex=host_index, ips=",".join(addrs))
    return dataclasses.replace(link, host_ifindex=host_index, host_mac=host_mac, pod_mac=pod_mac, pod_ifname=pod_ifname)


def adopt_pod(netns: str, host_ifname: str, ips: Sequence[str]) -> PodLink:
    """The network another CNI plugin gave a pod (chained mode): its host-side veth, as it is.

    Nothing is configured or changed; the link is the other plugin's (``link_owned`` False).
    FileNotFoundError when the namespace or the interface does not exist.
    """
    from pyroute2 import IPRoute

    name = name_of(netns)
    if not os.path.exists(netns_path(name)):
        raise FileNotFoundError(errno.ENOENT, f"network namespace {netns_path(name)} does not exist")
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=host_ifname)
        if not found:
            raise FileNotFoundError(
                errno.ENOENT,
                f"host interface {host_ifname} does not exist; the previous plugin's result names a veth it did "
                "not create on the host",
            )
        index = int(found[0])
        host_mac = _mac(ipr, index)
    addrs = tuple(str(ipaddress.ip_address(ip)) for ip in ips)
    return PodLink(netns_path(name), False, host_ifname, index, host_mac=host_mac, ips=addrs, link_owned=False)


def _sysctl(path: str, value: str) -> None:
    with contextlib.suppress(FileNotFoundError), open(path, "w") as f:
        f.write(value)


def _setup_pod_side(pod_ifname: str, addrs: tuple[str, ...], host_mac: str) -> str:
    """Runs inside the pod's namespace (see :func:`in_netns`)."""
    from pyroute2 import IPRoute

    # /proc/sys/net follows the namespace of the thread that opens it.
    _sysctl(f"/proc/sys/net/ipv6/conf/{pod_ifname}/accept_dad", "0")
    with IPRoute() as ipr:
        lo = ipr.link_lookup(ifname="lo")[0]
        ipr.link("set", index=lo, state="up")
        index = int(ipr.link_lookup(ifname=pod_ifname)[0])
        ipr.link("set", index=index, state="up")
        pod_mac = _mac(ipr, index)
        for ip in addrs:
            if ipaddress.ip_address(ip).version == 4:
                ipr.addr("add", index=index, address=ip, prefixlen=32)
            else:
                ipr.addr("add", index=index, address=ip, prefixlen=128, flags=IFA_F_NODAD)
        if any(ipaddress.ip_address(ip).version == 4 for ip in addrs):
            ipr.route("replace", dst=f"{GATEWAY_V4}/32", oif=index, scope=RT_SCOPE_LINK)
            ipr.route("replace", dst="0.0.0.0/0", gateway=GATEWAY_V4, oif=index)
            ipr.neigh("replace", dst=GATEWAY_V4, lladdr=host_mac, ifindex=index, state=NUD_PERMANENT)
        if any(ipaddress.ip_address(ip).version == 6 for ip in addrs):
            ipr.route("replace", dst="::/0", gateway=GATEWAY_V6, oif=index, family=socket.AF_INET6, flags=RTNH_F_ONLINK)
            ipr.neigh(
                "replace", dst=GATEWAY_V6, lladdr=host_mac, ifindex=index, state=NUD_PERMANENT, family=socket.AF_INET6
            )
    return pod_mac


def delete_pod(link: PodLink) -> None:
    """Remove the host veth (its routes, neighbours and pod end go with it) and an owned namespace; idempotent."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    if link.link_owned:
        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=link.host_ifname):
                with contextlib.suppress(NetlinkError):
                    ipr.link("del", index=index)
    if link.netns_owned:  # an adopted namespace is the caller's
        delete_netns(link.name)


def pod_alive(link: PodLink) -> bool:
    """Whether the namespace and the host veth of a pod still exist."""
    from pyroute2 import IPRoute

    if not os.path.exists(link.netns):
        return False
    with IPRoute() as ipr:
        return bool(ipr.link_lookup(ifname=link.host_ifname))


def list_netns(prefix: str = "") -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


class NetnsPodNetwork:
    """The endpoint manager's pod network over this module (blocking calls)."""

    def setup(
        self,
        *,
        netns: str,
        create: bool,
        host_ifname: str,
        addresses: Sequence[Address],
        pod_ifname: str = POD_IFNAME,
    ) -> PodLink:
        enable_forwarding()
        return create_pod(netns, host_ifname, [a.ip for a in addresses], create=create, pod_ifname=pod_ifname)

    def adopt(self, *, netns: str, host_ifname: str, addresses: Sequence[Address]) -> PodLink:
        enable_forwarding()
        return adopt_pod(netns, host_ifname, [a.ip for a in addresses])

    def teardown(self, link: PodLink) -> None:
        delete_pod(link)

    def alive(self, link: PodLink) -> bool:
        return pod_alive(link)

    def exists(self, netns: str) -> bool:
        return os.path.exists(netns)
