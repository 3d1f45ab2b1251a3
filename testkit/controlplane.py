"""A small working control plane for datapath tests: PolicyService, IdentityService and IPAMService.

It serves real gRPC on a free loopback port and publishes real orders and ipcache
entries on a real NATS server, so the datapath under test talks to it exactly as it
talks to the policy and ipam services. Policy is given directly as entries per
identity (the policy engine has its own tests); every change bumps the revision and
the node's order sequence and publishes the diff as a regeneration order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from palisade.v1 import (
    common_pb2,
    identity_pb2,
    identity_pb2_grpc,
    ipam_pb2,
    ipam_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from services.common.bus import IPCACHE_STREAM, REGEN_STREAM, Bus, ipcache_subject, regen_subject
from testkit.harness import creds

ING = common_pb2.DIRECTION_INGRESS
EGR = common_pb2.DIRECTION_EGRESS
TCP = common_pb2.PROTOCOL_TCP
ALLOW = common_pb2.VERDICT_ALLOW
DENY = common_pb2.VERDICT_DENY


def _key(e: common_pb2.PolicyEntry) -> bytes:
    return e.key.SerializeToString(deterministic=True)


@dataclasses.dataclass
class _Policy:
    enforcement: common_pb2.Enforcement
    entries: dict[bytes, common_pb2.PolicyEntry]
    fqdn_rules: tuple[common_pb2.FqdnRule, ...] = ()
    dns_rules: tuple[common_pb2.DnsRule, ...] = ()


class ControlPlane(
    policy_pb2_grpc.PolicyServiceServicer,
    identity_pb2_grpc.IdentityServiceServicer,
    ipam_pb2_grpc.IPAMServiceServicer,
):
    def __init__(self, bus: Bus, node: str, cidr: str = "10.244.7.0/24") -> None:
        self.bus = bus
        self.node = node
        self.net = ipaddress.ip_network(cidr)
        self.gateway = str(self.net.network_address + 1)
        self.revision = 1
        self.sequence = 0
        self.policies: dict[int, _Policy] = {}
        #: (endpoint id) -> (identity, revision) as reported.
        self.realized: dict[int, tuple[int, int]] = {}
        self.reports: list[policy_pb2.RealizedReport] = []
        self.resyncs: list[policy_pb2.ResyncRequest] = []
        self.ips: dict[str, str] = {}  # ip -> owner
        self.identities: dict[tuple[tuple[str, str, str], ...], int] = {}
        self.owner_identity: dict[str, int] = {}
        self.pods: dict[str, int] = {}  # "ns/name" -> identity known "from the bus"
        #: Pods whose object arrives just after the first ResolvePod for them says NOT_FOUND.
        self.arriving: dict[str, int] = {}
        #: While set, Resync answers UNAVAILABLE (a policy service that is not up yet).
        self.refuse_resync = False
        #: When set, awaited before an address is reserved (an IPAM whose answer takes its time).
        self.reserving: Callable[[ipam_pb2.AllocateIPRequest], Awaitable[None]] | None = None
        self.server: grpc.aio.Server | None = None
        #: The policy API answers as "policy", identities and addresses as "ipam", each on its own
        #: mutual-TLS port (a datapath checks which service it reached by the certificate).
        self.policy_port = 0
        self.ipam_port = 0
        self.changed = asyncio.Condition()

    @property
    def policy_address(self) -> str:
        return f"127.0.0.1:{self.policy_port}"

    @property
    def ipam_address(self) -> str:
        return f"127.0.0.1:{self.ipam_port}"

    async def start(self, port: int = 0) -> None:
        await self.bus.ensure_streams(REGEN_STREAM, IPCACHE_STREAM)
        self.server = grpc.aio.server()
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(self, self.server)
        identity_pb2_grpc.add_IdentityServiceServicer_to_server(self, self.server)
        ipam_pb2_grpc.add_IPAMServiceServicer_to_server(self, self.server)
        self.policy_port = self.server.add_secure_port(f"127.0.0.1:{port}", creds("policy").server_credentials())
        self.ipam_port = self.server.add_secure_port("127.0.0.1:0", creds("ipam").server_credentials())
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    # --- driving policy from the test -----------------------------------------------------

    async def set_policy(
        self,
        identity: int,
        entries: Iterable[common_pb2.PolicyEntry],
        *,
        ingress: bool = True,
        egress: bool = False,
        publish: bool = True,
    ) -> int:
        """Replace an identity's policy; publish the diff as the next order. Returns the revision."""
        new = _Policy(common_pb2.Enforcement(ingress=ingress, egress=egress), {_key(e): e for e in entries})
        old = self.policies.get(identity, _Policy(common_pb2.Enforcement(), {}))
        self.policies[identity] = new
        diff = common_pb2.IdentityPolicyDiff(
            identity=identity,
            enforcement=new.enforcement,
            add=[e for k, e in new.entries.items() if old.entries.get(k) != e],
            remove=[e for k, e in old.entries.items() if k not in new.entries],
        )
        return await self._publish([diff], publish=publish)

    async def set_names(
        self,
        identity: int,
        fqdn_rules: Iterable[common_pb2.FqdnRule],
        dns_rules: Iterable[common_pb2.DnsRule],
        publish: bool = True,
    ) -> int:
        """Replace an identity's FQDN and DNS rules: a full diff with names_changed, as the contract says."""
        old = self.policies.get(identity, _Policy(common_pb2.Enforcement(), {}))
        new = dataclasses.replace(old, fqdn_rules=tuple(fqdn_rules), dns_rules=tuple(dns_rules))
        self.policies[identity] = new
        diff = common_pb2.IdentityPolicyDiff(
            identity=identity,
            enforcement=new.enforcement,
            add=list(new.entries.values()),
            full=True,
            names_changed=True,
            fqdn_rules=new.fqdn_rules,
            dns_rules=new.dns_rules,
        )
        return await self._publish([diff], publish=publish)

    async def bump(self, publish: bool = True) -> int:
        """A revision that changes nothing on this node (a pure revision bump)."""
        return await self._publish([], publish=publish)

    async def _publish(self, diffs: list[common_pb2.IdentityPolicyDiff], *, publish: bool) -> int:
        self.revision += 1
        self.sequence += 1
        order = policy_pb2.RegenerationOrder(
            node=self.node, sequence=self.sequence, revision=self.revision, diffs=diffs
        )
        if publish:
            await self.bus.publish(regen_subject(self.node), order)
        return self.revision

    async def publish_raw(self, order: policy_pb2.RegenerationOrder) -> None:
        await self.bus.publish(regen_subject(self.node), order)

    async def wait_realized(self, revision: int, endpoints: Iterable[int], timeout: float = 30.0) -> None:
        """Until every endpoint reported ``revision`` (or later)."""
        wanted = set(endpoints)

        def done() -> bool:
            return all(self.realized.get(ep, (0, 0))[1] >= revision for ep in wanted)

        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(done), timeout)

    # --- PolicyService ---------------------------------------------------------------------

    async def Resync(
        self, request: policy_pb2.ResyncRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ResyncResponse:
        self.resyncs.append(request)
        if self.refuse_resync:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the policy service is starting")
        wanted = set(request.identities)
        out = policy_pb2.ResyncResponse(revision=self.revision, sequence=self.sequence)
        for identity, policy in sorted(self.policies.items()):
            if wanted and identity not in wanted:
                continue
            out.policies.append(
                common_pb2.IdentityPolicy(
                    identity=identity,
                    enforcement=policy.enforcement,
                    entries=list(policy.entries.values()),
                    fqdn_rules=policy.fqdn_rules,
                    dns_rules=policy.dns_rules,
                )
            )
        return out

    async def ReportRealized(
        self, request: policy_pb2.ReportRealizedRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ReportRealizedResponse:
        async with self.changed:
            for report in request.reports:
                self.reports.append(report)
                if report.deleted:
                    self.realized.pop(report.endpoint_id, None)
                else:
                    self.realized[report.endpoint_id] = (report.identity, report.revision)
            self.changed.notify_all()
        return policy_pb2.ReportRealizedResponse()

    # --- IdentityService -------------------------------------------------------------------

    async def AllocateIdentity(
        self, request: identity_pb2.AllocateIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.AllocateIdentityResponse:
        labels = tuple(sorted((x.source, x.key, x.value) for x in request.labels))
        new = labels not in self.identities
        identity = self.identities.setdefault(labels, 256 + len(self.identities))
        self.owner_identity[request.owner] = identity
        # A copy: addresses are allocated meanwhile (a datapath asks for both at once).
        for ip, owner in list(self.ips.items()):
            if owner == request.owner:
                await self._ipcache(ip, identity, owner)
        return identity_pb2.AllocateIdentityResponse(identity=identity_pb2.Identity(id=identity), new=new)

    async def ReleaseIdentity(
        self, request: identity_pb2.ReleaseIdentityRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ReleaseIdentityResponse:
        self.owner_identity.pop(request.owner, None)
        return identity_pb2.ReleaseIdentityResponse(last_reference=True)

    async def ResolvePod(
        self, request: identity_pb2.ResolvePodRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.ResolvePodResponse:
        key = f"{request.namespace}/{request.name}"
        identity = self.pods.get(key)
        if identity is None and key in self.arriving:
            # The pod object lands right after this answer (while the endpoint is being made).
            self.pods[key] = self.arriving.pop(key)
        if identity is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.namespace}/{request.name} is unknown")
        return identity_pb2.ResolvePodResponse(identity=identity_pb2.Identity(id=identity or 0), node=self.node)

    async def relabel_pod(self, namespace: str, pod: str, identity: int) -> None:
        """As ipam does when the watcher reports new labels: new identity, new ipcache entry."""
        owner = f"pod/{namespace}/{pod}"
        self.pods[f"{namespace}/{pod}"] = identity
        for ip, held in list(self.ips.items()):
            if held == owner:
                await self._ipcache(ip, identity, owner)

    # --- IPAMService -----------------------------------------------------------------------

    async def AllocateIP(
        self, request: ipam_pb2.AllocateIPRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.IPAllocation:
        if self.reserving is not None:
            await self.reserving(request)
        if request.ip:
            if ipaddress.ip_address(request.ip) not in self.net and not request.outside_pool:
                # As ipam answers: an address chosen elsewhere needs outside_pool.
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"cannot reserve {request.ip}: outside the pod CIDR {self.net}"
                )
            holder = self.ips.get(request.ip)
            if holder not in (None, request.owner):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.ip} belongs to {holder}")
            ip = request.ip
        else:
            if request.owner in self.ips.values():
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{request.owner} already has an address")
            ip = next(str(a) for a in list(self.net.hosts())[1:] if str(a) not in self.ips)
        self.ips[ip] = request.owner
        identity = self.owner_identity.get(request.owner) or self.pods.get(request.owner.removeprefix("pod/"))
        if identity:
            await self._ipcache(ip, identity, request.owner)
        return self._alloc(ip, request.owner)

    def _alloc(self, ip: str, owner: str) -> ipam_pb2.IPAllocation:
        return ipam_pb2.IPAllocation(
            ip=ip, node=self.node, owner=owner, family=ipam_pb2.FAMILY_IPV4, cidr=str(self.net), gateway=self.gateway
        )

    async def ReleaseIP(
        self, request: ipam_pb2.ReleaseIPRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.ReleaseIPResponse:
        if request.ip not in self.ips:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.ip} is not allocated")
        del self.ips[request.ip]
        await self.bus.publish(
            ipcache_subject(f"{request.ip}/32"), identity_pb2.IpcacheEntry(prefix=f"{request.ip}/32", deleted=True)
        )
        return ipam_pb2.ReleaseIPResponse()

    async def ListAllocations(
        self, request: ipam_pb2.ListAllocationsRequest, context: grpc.aio.ServicerContext
    ) -> ipam_pb2.ListAllocationsResponse:
        return ipam_pb2.ListAllocationsResponse(allocations=[self._alloc(ip, o) for ip, o in sorted(self.ips.items())])

    async def publish_ipcache(self, prefix: str, identity: int, deleted: bool = False) -> None:
        await self.bus.publish(
            ipcache_subject(prefix), identity_pb2.IpcacheEntry(prefix=prefix, identity=identity, deleted=deleted)
        )

    async def _ipcache(self, ip: str, identity: int, owner: str) -> None:
        _, namespace, pod = owner.split("/", 2)
        entry = identity_pb2.IpcacheEntry(
            prefix=f"{ip}/32", identity=identity, node=self.node, namespace=namespace, pod=pod
        )
        await self.bus.publish(ipcache_subject(entry.prefix), entry)


@contextlib.asynccontextmanager
async def control_plane(nats_url: str, node: str, **options: Any) -> AsyncIterator[ControlPlane]:
    """A started control plane (policy, identity and IPAM services) for ``node``, on its own bus connection."""
    bus = await Bus.connect([nats_url], name="control-plane", tls=creds())
    plane = ControlPlane(bus, node, **options)  # type: ignore[abstract]
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()
        await bus.close()
