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
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from services.common.log import get_logger

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
class PodNetwork:
    """A pod's namespace and veth pair as created."""

    netns: str
    host_ifname: str
    host_ifindex: int
    host_mac: str
    pod_ifname: str
    pod_mac: str
    ips: tuple[str, ...]


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


def create_netns(name: str) -> None:
    from pyroute2 import netns

    if os.path.exists(netns_path(name)):
        raise FileExistsError(errno.EEXIST, "network namespace exists", name)
    netns.create(name)


def delete_netns(name: str) -> None:
    from pyroute2 import netns

    if os.path.exists(netns_path(name)):
        netns.remove(name)


def in_netns(name: str, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a thread that has entered the namespace ``name``.

    Network namespaces are per thread, so the rest of the process stays where
    it is; sockets created by ``fn`` keep belonging to ``name`` afterwards.
    """
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(netns_path(name), os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns: {os.strerror(code)}", name)
            finally:
                os.close(fd)
            result.append(fn(*args))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _mac(ipr: Any, index: int) -> str:
    return str(ipr.get_links(index)[0].get_attr("IFLA_ADDRESS"))


def _route_args(ip: str) -> dict[str, Any]:
    addr = ipaddress.ip_address(ip)
    if addr.version == 4:
        return {"dst": f"{ip}/32", "family": socket.AF_INET, "scope": RT_SCOPE_LINK}
    return {"dst": f"{ip}/128", "family": socket.AF_INET6}


def create_pod(netns: str, host_ifname: str, ips: Sequence[str], *, pod_ifname: str = POD_IFNAME) -> PodNetwork:
    """Create namespace ``netns`` with a veth to the host named ``host_ifname`` and route ``ips`` to it.

    On failure everything created so far is removed again.
    """
    from pyroute2 import IPRoute

    if len(host_ifname) > IFNAMSIZ:
        raise ValueError(f"interface name {host_ifname!r} is longer than {IFNAMSIZ} characters")
    addrs = tuple(str(ipaddress.ip_address(ip)) for ip in ips)
    create_netns(netns)
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=host_ifname, kind="veth", peer={"ifname": pod_ifname, "net_ns_fd": netns})
            host_index = int(ipr.link_lookup(ifname=host_ifname)[0])
            host_mac = _mac(ipr, host_index)
            _sysctl(f"/proc/sys/net/ipv6/conf/{host_ifname}/accept_dad", "0")
            ipr.link("set", index=host_index, state="up")

        pod_mac = in_netns(netns, _setup_pod_side, pod_ifname, addrs, host_mac)

        with IPRoute() as ipr:
            for ip in addrs:
                ipr.route("replace", oif=host_index, **_route_args(ip))
                ipr.neigh("replace", dst=ip, lladdr=pod_mac, ifindex=host_index, state=NUD_PERMANENT)
    except BaseException:
        delete_pod(netns, host_ifname)
        raise
    log.info("pod network created", netns=netns, veth=host_ifname, ifindex=host_index, ips=",".join(addrs))
    return PodNetwork(netns, host_ifname, host_index, host_mac, pod_ifname, pod_mac, addrs)


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


def delete_pod(netns: str, host_ifname: str) -> None:
    """Remove the veth (its routes and neighbours go with it) and the namespace; idempotent."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=host_ifname):
            with contextlib.suppress(NetlinkError):
                ipr.link("del", index=index)
    delete_netns(netns)


def list_netns(prefix: str = "") -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
