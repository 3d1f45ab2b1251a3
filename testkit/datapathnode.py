"""The session node of the datapath tests: one compiled datapath, three pods and an outside host."""

from __future__ import annotations

import dataclasses

from services.datapath.datapath import Datapath
from services.datapath.netns import PodLink
from services.datapath.types import Direction, EndpointSpec, Reason

#: Ports the echo servers listen on in every pod (so a failure is the policy, never a refusal).
TCP_PORTS = (3868, 7000, 8080, 8081, 8999, 9000, 9005, 9010, 9011)
UDP_PORTS = (5353, 5354, 7000, 8080)

IDENTITY_A = 1001
IDENTITY_B = 1002
IDENTITY_C = 1003


@dataclasses.dataclass(frozen=True)
class Pod:
    name: str
    net: PodLink
    ep_id: int
    identity: int
    v4: str
    v6: str

    @property
    def spec(self) -> EndpointSpec:
        return EndpointSpec(self.ep_id, self.net.host_ifindex, self.net.host_ifname, self.net.ips, self.identity)


@dataclasses.dataclass(frozen=True)
class Node:
    """A node with three attached pods (a, b, c) and an outside host (ext, not an endpoint)."""

    run_id: str
    dp: Datapath
    a: Pod
    b: Pod
    c: Pod
    ext: PodLink
    #: ext's addresses: two inside ``cidr``, one outside every ipcache prefix the tests add.
    ext_in: str
    ext_except: str
    ext_outside: str
    #: The /25 the CIDR tests put in the ipcache (ext_in and ext_except are in it).
    cidr: str
    #: ext's IPv6 address and a /124 holding it.
    ext_v6: str
    cidr_v6: str
    pods: tuple[Pod, ...]


def clear_services(dp: Datapath) -> None:
    """Remove every Service frontend (with its backends) and forget the connections through them,
    as each Services test leaves the session node."""
    for state in dp.lb_services():
        dp.lb_delete(state.frontend)
    dp.flush_conntrack()


def drops(dp: Datapath, ep_id: int, direction: Direction | None = None) -> int:
    """Packets this endpoint dropped so far (policy deny and default deny)."""
    counters = dp.counters()
    return sum(
        counters.packets(endpoint_id=ep_id, reason=reason, direction=direction)
        for reason in (Reason.POLICY_DENY, Reason.DEFAULT_DENY)
    )
