"""The endpoint manager: local pods, their identities, addresses and policy maps.

One task (:meth:`EndpointManager.run`) owns every endpoint and the desired policy of
every local identity; everything that changes them is a command on its queue, so
no lock exists and none is held across network I/O: calls to IPAMService,
IdentityService and PolicyService happen in the caller's task, before or after the
command that commits their result. BPF and netlink calls block, so they go through
``asyncio.to_thread``.

Desired and realized state are kept apart (as in Cilium's ``pkg/endpoint``): the
desired policy of an identity comes from orders and resyncs; what each endpoint's
map holds is tracked separately, written as deltas, and repaired from a full dump
of the kernel map periodically and after every resync.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import ipaddress
import os
import re
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from palisade.v1 import common_pb2, datapath_pb2, identity_pb2, identity_pb2_grpc, ipam_pb2, ipam_pb2_grpc, policy_pb2
from services.common.labels import LABEL_POD_NAMESPACE
from services.common.log import get_logger
from services.datapath import netns as netns_mod
from services.datapath import types as dt
from services.datapath.datapath import DatapathAPI
from services.datapath.orders import (
    OrderBatch,
    PolicyPort,
    Realized,
    Reporter,
    enforcement_from_proto,
    enforcement_to_proto,
    entry_from_proto,
    key_from_proto,
    rpc_error,
)
from services.datapath.state import Address, EndpointRecord, PortRecord, StateStore

log = get_logger("endpoints")

T = TypeVar("T")

MAX_ENDPOINT_ID = 4095
#: Kubernetes names: DNS-1123 labels for namespaces, subdomains for pods.
_NAMESPACE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_POD_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


# --- errors (the servicer maps each to a gRPC status code) ----------------------------------


class EndpointError(Exception):
    """A request that cannot be served; the message says what is wrong and what to do."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(EndpointError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class EndpointNotFound(EndpointError):
    code = grpc.StatusCode.NOT_FOUND


class EndpointExists(EndpointError):
    code = grpc.StatusCode.ALREADY_EXISTS


class UpstreamUnavailable(EndpointError):
    code = grpc.StatusCode.UNAVAILABLE


class DatapathFailure(EndpointError):
    code = grpc.StatusCode.INTERNAL


# --- the edges: datapath facade, pod network, IPAM ------------------------------------------


@dataclasses.dataclass(frozen=True)
class PodLink:
    """Where a pod's network was set up."""

    netns: str
    netns_owned: bool
    host_ifname: str
    host_ifindex: int


class PodNetwork(Protocol):
    """Network namespaces, veths, addresses and routes (blocking calls)."""

    def setup(self, *, netns: str, create: bool, host_ifname: str, addresses: Sequence[Address]) -> PodLink: ...

    def teardown(self, link: PodLink) -> None: ...

    def alive(self, link: PodLink) -> bool:
        """Whether the namespace and the host veth of a pod still exist."""
        ...


class NetnsPodNetwork:
    """:class:`PodNetwork` over ``services.datapath.netns``: namespaces live in /run/netns."""

    def setup(self, *, netns: str, create: bool, host_ifname: str, addresses: Sequence[Address]) -> PodLink:
        name = _netns_name(netns)
        ips = [a.ip for a in addresses]
        netns_mod.enable_forwarding()
        if not create:
            pod = _adopt_pod(name, host_ifname, ips)
            return PodLink(netns_mod.netns_path(name), False, pod.host_ifname, pod.host_ifindex)
        if os.path.exists(netns_mod.netns_path(name)):
            raise FileExistsError(f"network namespace {name} already exists; delete it or pass it as netns to adopt")
        # `ip netns` forks and execs; pyroute2's in-process namespace creation forks without exec,
        # which is not safe in a process running gRPC threads.
        _ip("netns", "add", name)
        try:
            pod = _adopt_pod(name, host_ifname, ips)
        except BaseException:
            _ip("netns", "del", name)
            raise
        return PodLink(netns_mod.netns_path(name), True, pod.host_ifname, pod.host_ifindex)

    def teardown(self, link: PodLink) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=link.host_ifname):
                with contextlib.suppress(NetlinkError):
                    ipr.link("del", index=index)
        if link.netns_owned and os.path.exists(link.netns):  # adopted namespaces are the caller's
            _ip("netns", "del", _netns_name(link.netns))

    def alive(self, link: PodLink) -> bool:
        from pyroute2 import IPRoute

        if not os.path.exists(link.netns):
            return False
        with IPRoute() as ipr:
            return bool(ipr.link_lookup(ifname=link.host_ifname))


def _netns_name(netns: str) -> str:
    """The name under /run/netns of a namespace given by name or path."""
    path = Path(netns)
    if path.parent != Path(netns_mod.NETNS_DIR) and len(path.parts) > 1:
        raise ValueError(
            f"network namespace {netns} is not under {netns_mod.NETNS_DIR}; bind-mount it there (ip netns attach)"
        )
    return path.name


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)} failed: {result.stderr.strip() or result.returncode}")


def _adopt_pod(name: str, host_ifname: str, ips: Sequence[str]) -> netns_mod.PodNetwork:
    """Join an existing namespace to the host with a new veth (create_pod without creating the namespace)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        if ipr.link_lookup(ifname=host_ifname):
            raise ValueError(f"interface {host_ifname} already exists on the host; delete the old endpoint first")
        ipr.link("add", ifname=host_ifname, kind="veth", peer={"ifname": netns_mod.POD_IFNAME, "net_ns_fd": name})
        index = int(ipr.link_lookup(ifname=host_ifname)[0])
        host_mac = str(ipr.get_links(index)[0].get_attr("IFLA_ADDRESS"))
        ipr.link("set", index=index, state="up")
    try:
        pod_mac = netns_mod.in_netns(name, netns_mod._setup_pod_side, netns_mod.POD_IFNAME, tuple(ips), host_mac)
        with IPRoute() as ipr:
            for ip in ips:
                ipr.route("replace", oif=index, **netns_mod._route_args(ip))
                ipr.neigh("replace", dst=ip, lladdr=pod_mac, ifindex=index, state=netns_mod.NUD_PERMANENT)
    except BaseException:
        with IPRoute() as ipr:
            ipr.link("del", index=index)
        raise
    return netns_mod.PodNetwork(
        netns_mod.netns_path(name), host_ifname, index, host_mac, netns_mod.POD_IFNAME, pod_mac, tuple(ips)
    )


class IpamPort(Protocol):
    """What the datapath needs from IdentityService and IPAMService."""

    async def allocate_identity(self, labels: Sequence[common_pb2.Label], node: str, owner: str) -> int: ...

    async def release_identity(self, identity: int, node: str, owner: str) -> None: ...

    async def resolve_pod(self, namespace: str, name: str) -> int: ...

    async def allocate_ip(
        self, node: str, owner: str, family: int, ip: str = "", ports: Sequence[PortRecord] = ()
    ) -> ipam_pb2.IPAllocation:
        """An address for ``owner``; ``ports`` are the pod's container ports (the named ones reach the ipcache)."""
        ...

    async def release_ip(self, node: str, ip: str, owner: str) -> None: ...

    async def allocations(self, node: str) -> list[ipam_pb2.IPAllocation]: ...


class GrpcIpam:
    """IdentityService and IPAMService over one gRPC channel."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self._identity = identity_pb2_grpc.IdentityServiceStub(channel)
        self._ipam = ipam_pb2_grpc.IPAMServiceStub(channel)
        self._timeout = timeout

    async def allocate_identity(self, labels: Sequence[common_pb2.Label], node: str, owner: str) -> int:
        request = identity_pb2.AllocateIdentityRequest(labels=list(labels), node=node, owner=owner)
        response = await self._identity.AllocateIdentity(request, timeout=self._timeout)
        return int(response.identity.id)

    async def release_identity(self, identity: int, node: str, owner: str) -> None:
        request = identity_pb2.ReleaseIdentityRequest(id=identity, node=node, owner=owner)
        await self._identity.ReleaseIdentity(request, timeout=self._timeout)

    async def resolve_pod(self, namespace: str, name: str) -> int:
        request = identity_pb2.ResolvePodRequest(namespace=namespace, name=name)
        response = await self._identity.ResolvePod(request, timeout=self._timeout)
        return int(response.identity.id)

    async def allocate_ip(
        self, node: str, owner: str, family: int, ip: str = "", ports: Sequence[PortRecord] = ()
    ) -> ipam_pb2.IPAllocation:
        request = ipam_pb2.AllocateIPRequest(node=node, owner=owner, family=family, ip=ip)  # type: ignore[arg-type]
        for port in ports:
            if port.name and port.name not in request.named_ports:  # the first of a name wins, as in a pod spec
                request.named_ports[port.name].port = port.port
                request.named_ports[port.name].protocol = port.protocol or common_pb2.PROTOCOL_TCP  # type: ignore[assignment]
        response: ipam_pb2.IPAllocation = await self._ipam.AllocateIP(request, timeout=self._timeout)
        return response

    async def release_ip(self, node: str, ip: str, owner: str) -> None:
        await self._ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node=node, ip=ip, owner=owner), timeout=self._timeout)

    async def allocations(self, node: str) -> list[ipam_pb2.IPAllocation]:
        response = await self._ipam.ListAllocations(ipam_pb2.ListAllocationsRequest(node=node), timeout=self._timeout)
        return list(response.allocations)


def _code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None


# --- desired policy ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IdentityPolicy:
    """The desired policy of one identity, and the order sequence it corresponds to."""

    identity: int
    enforcement: dt.Enforcement
    entries: Mapping[dt.PolicyKey, dt.PolicyEntry]
    sequence: int
    revision: int

    @classmethod
    def empty(cls, identity: int) -> IdentityPolicy:
        return cls(identity, dt.Enforcement(ingress=False, egress=False), {}, 0, 0)

    @classmethod
    def from_proto(cls, policy: common_pb2.IdentityPolicy, sequence: int, revision: int) -> IdentityPolicy:
        entries = {e.key: e for e in (entry_from_proto(p) for p in policy.entries)}
        return cls(policy.identity, enforcement_from_proto(policy.enforcement), entries, sequence, revision)

    def apply(self, diff: common_pb2.IdentityPolicyDiff, sequence: int, revision: int) -> IdentityPolicy:
        """This policy after ``diff`` (full replaces; otherwise removes, then adds). Pure."""
        entries: dict[dt.PolicyKey, dt.PolicyEntry] = {} if diff.full else dict(self.entries)
        if not diff.full:
            for removed in diff.remove:
                entries.pop(key_from_proto(removed.key), None)
        for added in diff.add:
            entry = entry_from_proto(added)
            entries[entry.key] = entry
        return IdentityPolicy(diff.identity, enforcement_from_proto(diff.enforcement), entries, sequence, revision)


# --- endpoints --------------------------------------------------------------------------------


@dataclasses.dataclass
class Endpoint:
    """One local pod. Mutated only by the manager task."""

    record: EndpointRecord
    state: datapath_pb2.EndpointState.ValueType = datapath_pb2.ENDPOINT_STATE_WAITING
    error: str = ""
    realized_revision: int = 0
    #: What this endpoint's map holds, as last written or dumped (None: unknown, sync fully).
    realized: dict[dt.PolicyKey, dt.PolicyEntry] | None = None
    realized_enforcement: dt.Enforcement | None = None

    @property
    def id(self) -> int:
        return self.record.id

    @property
    def identity(self) -> int:
        return self.record.identity

    def to_proto(self, node: str) -> datapath_pb2.Endpoint:
        r = self.record
        enforcement = self.realized_enforcement or dt.Enforcement(ingress=False, egress=False)
        return datapath_pb2.Endpoint(
            id=r.id,
            namespace=r.namespace,
            pod=r.pod,
            node=node,
            netns=r.netns,
            host_ifname=r.host_ifname,
            host_ifindex=r.host_ifindex,
            ips=list(r.ips),
            identity=r.identity,
            labels=[common_pb2.Label(source=s, key=k, value=v) for s, k, v in r.labels],
            state=self.state,
            realized_revision=self.realized_revision,
            error=self.error,
            enforcement=enforcement_to_proto(enforcement),
        )


@dataclasses.dataclass(frozen=True)
class EndpointRef:
    """How a request names an endpoint: by id, or by namespace/pod."""

    id: int = 0
    namespace: str = ""
    pod: str = ""

    @classmethod
    def from_request(cls, request: datapath_pb2.GetEndpointRequest | datapath_pb2.DeleteEndpointRequest) -> EndpointRef:
        ref = cls(request.id, request.namespace, request.pod)
        if not ref.id and not (ref.namespace and ref.pod):
            raise InvalidRequest("name the endpoint: give its id, or both namespace and pod")
        return ref

    def __str__(self) -> str:
        return f"endpoint {self.id}" if self.id else f"pod {self.namespace}/{self.pod}"


def host_ifname(namespace: str, pod: str) -> str:
    """The host-side veth name of a pod: ``lxc`` + 12 hex digits of a hash, like Cilium (<= 15 chars)."""
    return "lxc" + hashlib.sha256(f"{namespace}/{pod}".encode()).hexdigest()[:12]


def netns_name(namespace: str, pod: str) -> str:
    """Name of a namespace the datapath creates; unambiguous as namespaces cannot contain '_'."""
    return f"pal_{namespace}_{pod}"


def identity_labels(namespace: str, labels: Iterable[common_pb2.Label]) -> list[common_pb2.Label]:
    """The labels to allocate an identity for: the given ones plus the pod's namespace label."""
    out = [common_pb2.Label(source=x.source or "k8s", key=x.key, value=x.value) for x in labels]
    if not any(x.key == LABEL_POD_NAMESPACE for x in out):
        out.append(common_pb2.Label(source="k8s", key=LABEL_POD_NAMESPACE, value=namespace))
    return out


_FAMILIES = {ipam_pb2.FAMILY_IPV4: 4, ipam_pb2.FAMILY_IPV6: 6}


def validate_create(request: datapath_pb2.CreateEndpointRequest) -> None:
    if not request.namespace or not request.pod:
        raise InvalidRequest("namespace and pod are required; give the pod's namespace and name")
    if not _NAMESPACE_RE.match(request.namespace):
        raise InvalidRequest(f"namespace {request.namespace!r} is not a valid Kubernetes namespace name")
    if not _POD_RE.match(request.pod):
        raise InvalidRequest(f"pod {request.pod!r} is not a valid Kubernetes pod name")
    if request.netns:
        try:
            name = _netns_name(request.netns)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if not os.path.exists(netns_mod.netns_path(name)):
            raise InvalidRequest(f"network namespace {request.netns} does not exist; create it or leave netns empty")
    for family in request.families:
        if family not in _FAMILIES:
            raise InvalidRequest(f"family {family} is not IPv4 or IPv6")
    for label in request.labels:
        if not label.key:
            raise InvalidRequest("a label has an empty key; labels are source:key=value")
    for port in request.ports:
        if not 0 < port.port <= 65535:
            raise InvalidRequest(f"container port {port.name or port.port} is outside 1-65535")


@dataclasses.dataclass
class _Command:
    run: Callable[[], Awaitable[Any]]
    done: asyncio.Future[Any]


class EndpointManager:
    """Owns local endpoints and the desired policy of their identities."""

    def __init__(
        self,
        *,
        node: str,
        datapath: DatapathAPI,
        network: PodNetwork,
        store: StateStore,
        ipam: IpamPort,
        policy: PolicyPort,
        reporter: Reporter,
        backoff_max: float = 5.0,
    ) -> None:
        self.node = node
        self._dp = datapath
        self._net = network
        self._store = store
        self._ipam = ipam
        self._policy = policy
        self._reporter = reporter
        self._backoff_max = backoff_max
        self._queue: asyncio.Queue[_Command] = asyncio.Queue()
        self.endpoints: dict[int, Endpoint] = {}
        #: Ids and pod keys of endpoints being created or deleted (not in ``endpoints`` yet / anymore).
        self._busy_ids: set[int] = set()
        self._busy_pods: set[str] = set()
        self.policies: dict[int, IdentityPolicy] = {}
        #: Identities whose policy is kept only because local endpoints still use them, although
        #: PolicyService no longer sends them here (removed, or missing from a resync): not
        #: trusted for new endpoints, and dropped once no endpoint uses them.
        self._orphaned: set[int] = set()
        #: Node-level position: sequence and revision of the last order or resync applied.
        self.sequence = 0
        self.revision = 0
        self.synced = False
        self._releases: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()

    # --- the owning task ---------------------------------------------------------------------

    async def run(self) -> None:
        """Execute commands one at a time, for the life of the service."""
        while True:
            command = await self._queue.get()
            if command.done.cancelled():
                continue
            try:
                result = await command.run()
            except Exception as exc:
                if not command.done.done():
                    command.done.set_exception(exc)
            else:
                if not command.done.done():
                    command.done.set_result(result)

    async def _do(self, fn: Callable[[], Awaitable[T]]) -> T:
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Command(fn, done))
        return await asyncio.shield(done)

    async def run_releases(self) -> None:
        """Release addresses and identity references of removed endpoints, retrying until IPAM answers."""
        while True:
            release = await self._releases.get()
            delay = 0.2
            while True:
                try:
                    await release()
                    break
                except Exception as exc:
                    log.warning("release failed, retrying", error=rpc_error(exc))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._backoff_max)

    # --- reads (safe from any task: the table is only replaced between awaits) ----------------

    def find(self, ref: EndpointRef) -> Endpoint:
        if ref.id:
            ep = self.endpoints.get(ref.id)
            if ep is not None and (not ref.namespace or ep.record.key == f"{ref.namespace}/{ref.pod}"):
                return ep
        else:
            for ep in self.endpoints.values():
                if ep.record.namespace == ref.namespace and ep.record.pod == ref.pod:
                    return ep
        raise EndpointNotFound(f"{ref} does not exist on node {self.node}; list endpoints to see what does")

    def by_ip(self, ip: str) -> Endpoint | None:
        for ep in self.endpoints.values():
            if ip in ep.record.ips:
                return ep
        return None

    def local_prefixes(self) -> dict[str, int]:
        """Host prefixes of local endpoints and their identities."""
        return {_host_prefix(ip): ep.identity for ep in self.endpoints.values() for ip in ep.record.ips}

    def realized_revision(self) -> int:
        """Lowest realized revision over endpoints (the node's when it has none)."""
        live = [ep.realized_revision for ep in self.endpoints.values()]
        return min(live) if live else self.revision

    async def read_policy_map(self, ref: EndpointRef) -> tuple[Endpoint, dt.Enforcement, list[dt.PolicyEntry]]:
        """The endpoint's policy map as the kernel holds it."""
        ep = self.find(ref)
        enforcement, entries = await asyncio.to_thread(self._dp.dump_policy, ep.id)
        return ep, enforcement, entries

    # --- create --------------------------------------------------------------------------------

    async def create(self, request: datapath_pb2.CreateEndpointRequest) -> Endpoint:
        validate_create(request)
        key = f"{request.namespace}/{request.pod}"
        owner = f"pod/{key}"
        ep_id = await self._do(lambda: self._reserve(key))
        undo: list[Callable[[], Awaitable[None]]] = []
        try:
            # 1. identity (network I/O, outside the owning task)
            labels: list[common_pb2.Label] = []
            if request.labels:
                labels = identity_labels(request.namespace, request.labels)
                identity = await self._upstream(
                    f"allocate an identity for {key}", self._ipam.allocate_identity(labels, self.node, owner)
                )
                undo.append(lambda: self._ipam.release_identity(identity, self.node, owner))
            else:
                identity = await self._resolve(request.namespace, request.pod)
            # 2. addresses (with the named ports, which ipam puts in the address's ipcache entry)
            ports = tuple(PortRecord(name=p.name, port=p.port, protocol=int(p.protocol)) for p in request.ports)
            addresses = []
            for family in request.families or [ipam_pb2.FAMILY_IPV4]:
                alloc = await self._allocate_ip(owner, family, ports)
                addresses.append(_address(alloc))
                undo.append(lambda ip=alloc.ip: self._ipam.release_ip(self.node, ip, owner))  # type: ignore[misc]
            # 3. namespace, veth, addresses, routes
            netns = request.netns or netns_mod.netns_path(netns_name(request.namespace, request.pod))
            try:
                link = await asyncio.to_thread(
                    self._net.setup,
                    netns=netns,
                    create=not request.netns,
                    host_ifname=host_ifname(request.namespace, request.pod),
                    addresses=addresses,
                )
            except (OSError, ValueError) as exc:
                raise DatapathFailure(f"cannot set up the network of {key}: {exc}") from exc
            undo.append(lambda: asyncio.to_thread(self._net.teardown, link))
            record = EndpointRecord(
                id=ep_id,
                namespace=request.namespace,
                pod=request.pod,
                netns=link.netns,
                netns_owned=link.netns_owned,
                host_ifname=link.host_ifname,
                host_ifindex=link.host_ifindex,
                addresses=tuple(addresses),
                labels=tuple((x.source, x.key, x.value) for x in labels),
                identity_owned=bool(labels),
                identity=identity,
                ports=ports,
                created_at=time.time(),
            )
            # 4. the identity's policy, fetched if no local endpoint has it yet
            fetched = await self._fetch_policy(identity)
            await asyncio.to_thread(self._store.save, record)
            undo.append(lambda: asyncio.to_thread(self._store.remove, ep_id))
            # 5. programs and maps
            ep = await self._do(lambda: self._commit(record, fetched))
        except BaseException as exc:
            for step in reversed(undo):
                try:
                    await step()
                except Exception as cleanup:
                    log.warning("cleanup after failed create failed", pod=key, error=rpc_error(cleanup))
            await self._do(lambda: self._unreserve(ep_id, key))
            log.warning("endpoint create failed", pod=key, error=str(exc))
            raise
        log.info("endpoint created", endpoint=ep.id, pod=key, identity=identity, ips=",".join(record.ips))
        return ep

    async def _reserve(self, key: str) -> int:
        if key in self._busy_pods or any(ep.record.key == key for ep in self.endpoints.values()):
            raise EndpointExists(f"pod {key} already has an endpoint on node {self.node}; delete it first")
        used = set(self.endpoints) | self._busy_ids
        for ep_id in range(1, MAX_ENDPOINT_ID + 1):
            if ep_id not in used:
                self._busy_ids.add(ep_id)
                self._busy_pods.add(key)
                return ep_id
        raise EndpointError(f"node {self.node} has {MAX_ENDPOINT_ID} endpoints, the most it can hold")

    async def _unreserve(self, ep_id: int, key: str) -> None:
        self._busy_ids.discard(ep_id)
        self._busy_pods.discard(key)

    async def _resolve(self, namespace: str, pod: str) -> int:
        try:
            return await self._ipam.resolve_pod(namespace, pod)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise EndpointNotFound(
                    f"pod {namespace}/{pod} is unknown to IdentityService; give its labels in the request, "
                    "or wait until the watcher published the pod"
                ) from None
            raise _unavailable(f"resolve the identity of {namespace}/{pod}", exc) from None

    async def _allocate_ip(self, owner: str, family: int, ports: Sequence[PortRecord]) -> ipam_pb2.IPAllocation:
        try:
            return await self._ipam.allocate_ip(self.node, owner, family, ports=ports)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise _unavailable(f"allocate an address for {owner}", exc) from None
        # A create that failed half-way (or a crash) left the owner's address allocated: adopt it.
        for alloc in await self._upstream(f"list allocations of {self.node}", self._ipam.allocations(self.node)):
            if alloc.owner == owner and (alloc.family or ipam_pb2.FAMILY_IPV4) == family:
                # Reserving it again by address is idempotent and hands ipam this request's ports.
                return await self._upstream(
                    f"reserve {alloc.ip} for {owner}", self._ipam.allocate_ip(self.node, owner, family, alloc.ip, ports)
                )
        raise UpstreamUnavailable(f"IPAMService says {owner} already has an address but does not list it; retry")

    async def _upstream(self, what: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(what, exc) from None

    async def _fetch_policy(self, identity: int) -> IdentityPolicy | None:
        """The identity's policy from PolicyService unless orders keep it here already."""
        if identity in self.policies and identity not in self._orphaned:
            return None
        try:
            response = await self._policy.resync(self.node, [identity])
        except Exception as exc:
            # Not fatal: the endpoint waits, and the order that brings its identity fills it in.
            log.warning("policy of new identity not fetched", identity=identity, error=rpc_error(exc))
            return None
        for policy in response.policies:
            if policy.identity == identity:
                return IdentityPolicy.from_proto(policy, response.sequence, response.revision)
        return IdentityPolicy(
            identity, dt.Enforcement(ingress=False, egress=False), {}, response.sequence, response.revision
        )

    async def _commit(self, record: EndpointRecord, fetched: IdentityPolicy | None) -> Endpoint:
        self._busy_ids.discard(record.id)
        self._busy_pods.discard(record.key)
        if fetched is not None:
            self._learn(fetched)
        ep = Endpoint(record)
        try:
            await asyncio.to_thread(self._dp.attach_endpoint, _spec(record))
            for ip in record.ips:
                await asyncio.to_thread(self._dp.ipcache_upsert, _host_prefix(ip), record.identity)
        except Exception as exc:
            try:
                await asyncio.to_thread(self._dp.detach_endpoint, record.id)
            except Exception:
                pass
            raise DatapathFailure(f"cannot attach BPF programs for {record.key}: {exc}") from exc
        self.endpoints[record.id] = ep
        await self._realize(ep, full=True)
        return ep

    def _learn(self, policy: IdentityPolicy) -> None:
        current = self.policies.get(policy.identity)
        if current is None or current.sequence < policy.sequence or policy.identity in self._orphaned:
            self.policies[policy.identity] = policy
            self._orphaned.discard(policy.identity)

    def _used_identities(self) -> set[int]:
        return {ep.identity for ep in self.endpoints.values()}

    def _drop_orphans(self) -> None:
        """Forget kept policies no local endpoint uses any more."""
        for identity in self._orphaned - self._used_identities():
            self._orphaned.discard(identity)
            self.policies.pop(identity, None)
            log.debug("orphaned identity policy dropped", identity=identity)

    # --- delete --------------------------------------------------------------------------------

    async def delete(self, ref: EndpointRef) -> None:
        record = await self._do(lambda: self._remove(ref))
        try:
            await asyncio.to_thread(self._net.teardown, _link(record))
        except Exception as exc:
            log.warning("network teardown failed", pod=record.key, error=str(exc))
        await asyncio.to_thread(self._store.remove, record.id)
        await self._do(lambda: self._unreserve(record.id, record.key))
        errors = []
        for ip in record.ips:
            try:
                await self._ipam.release_ip(self.node, ip, record.owner)
            except Exception as exc:
                if _code(exc) != grpc.StatusCode.NOT_FOUND:
                    errors.append(f"address {ip}: {rpc_error(exc)}")
                    self._releases.put_nowait(lambda ip=ip: self._ipam.release_ip(self.node, ip, record.owner))  # type: ignore[misc]
        if record.identity_owned:
            try:
                await self._ipam.release_identity(record.identity, self.node, record.owner)
            except Exception as exc:
                if _code(exc) != grpc.StatusCode.NOT_FOUND:
                    errors.append(f"identity {record.identity}: {rpc_error(exc)}")
                    self._releases.put_nowait(
                        lambda: self._ipam.release_identity(record.identity, self.node, record.owner)
                    )
        log.info("endpoint deleted", endpoint=record.id, pod=record.key)
        if errors:
            raise UpstreamUnavailable(
                f"endpoint {record.id} ({record.key}) is deleted, but IPAM did not take back "
                + "; ".join(errors)
                + "; the datapath keeps retrying in the background"
            )

    async def _remove(self, ref: EndpointRef) -> EndpointRecord:
        ep = self.find(ref)
        self._busy_ids.add(ep.id)
        self._busy_pods.add(ep.record.key)
        del self.endpoints[ep.id]
        self._reporter.deleted(ep.id, ep.identity, ep.record.key)
        self._drop_orphans()
        await asyncio.to_thread(self._dp.detach_endpoint, ep.id)
        for ip in ep.record.ips:
            try:
                await asyncio.to_thread(self._dp.ipcache_delete, _host_prefix(ip))
            except (KeyError, OSError):
                pass
        return ep.record

    # --- policy ----------------------------------------------------------------------------------

    async def apply_order(self, batch: OrderBatch) -> None:
        await self._do(lambda: self._apply_order(batch))

    async def _apply_order(self, batch: OrderBatch) -> None:
        updated: dict[int, IdentityPolicy] = {}
        for diff in batch.diffs:  # computed in full first: a bad entry rejects the whole order
            current = self.policies.get(diff.identity) or IdentityPolicy.empty(diff.identity)
            if current.sequence >= batch.sequence:
                continue  # this identity was fetched after the order was made
            updated[diff.identity] = current.apply(diff, batch.sequence, batch.revision)
        used = self._used_identities()
        for identity in batch.removed:
            if identity in updated or identity not in self.policies:
                continue
            if self.policies[identity].sequence >= batch.sequence:
                continue  # fetched (so named to PolicyService) after the order was made
            if identity in used:
                # Not hosted here as far as PolicyService knows (the ipcache moved on first), yet an
                # endpoint still has it: keep enforcing what it had rather than open it up; the
                # endpoint's next report tells PolicyService, or the endpoint moves on.
                self._orphaned.add(identity)
                log.info("removed identity kept for its local endpoints", identity=identity)
            else:
                del self.policies[identity]
                self._orphaned.discard(identity)
        self.policies.update(updated)
        self._orphaned -= set(updated)
        changed = set(updated)
        self.sequence, self.revision = batch.sequence, batch.revision
        for ep in list(self.endpoints.values()):
            if ep.identity in changed:
                await self._realize(ep, full=False)
            elif ep.state == datapath_pb2.ENDPOINT_STATE_READY:
                ep.realized_revision = max(ep.realized_revision, batch.revision)
        self._report(self.endpoints.values(), arrived=batch.arrived)

    async def apply_resync(self, response: policy_pb2.ResyncResponse) -> None:
        await self._do(lambda: self._apply_resync(response))

    async def _apply_resync(self, response: policy_pb2.ResyncResponse) -> None:
        fresh = {
            p.identity: IdentityPolicy.from_proto(p, response.sequence, response.revision) for p in response.policies
        }
        orphaned = set()
        for ep in self.endpoints.values():
            if ep.identity not in fresh and ep.identity in self.policies:
                # PolicyService does not list it yet (its ipcache entry is on the way): keep what we have.
                log.info("identity missing from resync, keeping its policy", identity=ep.identity, endpoint=ep.id)
                fresh[ep.identity] = self.policies[ep.identity]
                orphaned.add(ep.identity)
        self.policies = fresh
        self._orphaned = orphaned
        self.sequence, self.revision = response.sequence, response.revision
        self.synced = True
        for ep in list(self.endpoints.values()):
            await self._realize(ep, full=True)
        self._report(self.endpoints.values())

    async def _realize(self, ep: Endpoint, *, full: bool) -> None:
        """Bring the endpoint's map to its identity's desired policy."""
        desired = self.policies.get(ep.identity)
        if desired is None:
            if not self.synced:
                return  # stays WAITING / RESTORING until the first resync
            desired = IdentityPolicy.empty(ep.identity)
        previous = ep.state
        ep.state = datapath_pb2.ENDPOINT_STATE_REGENERATING
        try:
            if full or ep.realized is None:
                await asyncio.to_thread(
                    self._dp.sync_policy, ep.id, desired.enforcement, list(desired.entries.values())
                )
            else:
                add = [e for k, e in desired.entries.items() if ep.realized.get(k) != e]
                remove = [k for k in ep.realized if k not in desired.entries]
                if add or remove or ep.realized_enforcement != desired.enforcement:
                    await asyncio.to_thread(self._dp.apply_policy, ep.id, desired.enforcement, add, remove)
        except Exception as exc:
            ep.state = datapath_pb2.ENDPOINT_STATE_FAILED
            ep.error = f"writing the policy map failed: {exc}; the periodic repair retries"
            ep.realized = None
            log.error("policy map write failed", endpoint=ep.id, identity=ep.identity, error=str(exc))
            return
        ep.realized = dict(desired.entries)
        ep.realized_enforcement = desired.enforcement
        ep.realized_revision = max(desired.revision, self.revision)
        ep.state = datapath_pb2.ENDPOINT_STATE_READY
        ep.error = ""
        del previous

    def _report(self, endpoints: Iterable[Endpoint], arrived: float | None = None) -> None:
        self._reporter.add(
            (
                Realized(ep.id, ep.identity, ep.realized_revision, ep.record.key)
                for ep in endpoints
                if ep.state == datapath_pb2.ENDPOINT_STATE_READY and ep.realized_revision
            ),
            arrived,
        )

    async def repair(self) -> int:
        """Dump every endpoint's map and rewrite those that drifted; returns how many were repaired."""
        return await self._do(self._repair)

    async def _repair(self) -> int:
        repaired = 0
        for ep in list(self.endpoints.values()):
            desired = self.policies.get(ep.identity)
            if desired is None:
                continue
            try:
                enforcement, entries = await asyncio.to_thread(self._dp.dump_policy, ep.id)
            except Exception as exc:
                log.warning("policy map dump failed", endpoint=ep.id, error=str(exc))
                enforcement, entries = dt.Enforcement(ingress=False, egress=False), []
                ep.realized = None
            actual = {e.key: e for e in entries}
            if actual == dict(desired.entries) and enforcement == desired.enforcement:
                ep.realized = actual
                continue
            log.warning(
                "policy map drifted, repairing", endpoint=ep.id, entries=len(actual), desired=len(desired.entries)
            )
            ep.realized = None
            await self._realize(ep, full=True)
            repaired += 1
        if repaired:
            self._report(self.endpoints.values())
        return repaired

    # --- identity changes --------------------------------------------------------------------------

    async def relabel(self, ref: EndpointRef, labels: Sequence[common_pb2.Label]) -> Endpoint:
        """Give a pod new labels: allocate their identity, then switch the endpoint to it."""
        ep = self.find(ref)
        record = ep.record
        new_labels = identity_labels(record.namespace, labels)
        identity = await self._upstream(
            f"allocate an identity for {record.key}", self._ipam.allocate_identity(new_labels, self.node, record.owner)
        )
        label_tuples = tuple((x.source, x.key, x.value) for x in new_labels)
        return await self.switch_identity(record.id, identity, labels=label_tuples)

    async def ipcache_identity(self, prefix: str, identity: int, namespace: str, pod: str) -> None:
        """The ipcache says a local address now has ``identity``: relabel its endpoint.

        Endpoints whose identity the datapath allocated from labels given in the request
        change only through :meth:`relabel`; the ipcache merely echoes those.
        """
        ep = self.by_ip(prefix.split("/", 1)[0])
        if ep is None or ep.record.identity_owned or ep.identity == identity:
            return
        if pod and (namespace, pod) != (ep.record.namespace, ep.record.pod):
            log.warning(
                "ipcache names another pod for a local address; ignored",
                prefix=prefix,
                pod=f"{namespace}/{pod}",
                endpoint=ep.id,
            )
            return
        await self.switch_identity(ep.id, identity)

    async def switch_identity(
        self, ep_id: int, identity: int, *, labels: tuple[tuple[str, str, str], ...] | None = None
    ) -> Endpoint:
        """Move an endpoint to ``identity`` without a window where traffic both allow is dropped.

        The new identity's entries are written into the endpoint's map first, then the
        endpoint's identity is switched, then the ipcache entry of its addresses.
        """
        fetched = await self._fetch_policy(identity)
        return await self._do(lambda: self._switch(ep_id, identity, fetched, labels))

    async def _switch(
        self,
        ep_id: int,
        identity: int,
        fetched: IdentityPolicy | None,
        labels: tuple[tuple[str, str, str], ...] | None,
    ) -> Endpoint:
        ep = self.endpoints.get(ep_id)
        if ep is None:
            raise EndpointNotFound(f"endpoint {ep_id} was deleted while its identity changed")
        if fetched is not None:
            self._learn(fetched)
        old = ep.identity
        record = dataclasses.replace(
            ep.record,
            identity=identity,
            labels=ep.record.labels if labels is None else labels,
            identity_owned=ep.record.identity_owned or labels is not None,
        )
        if old == identity and record == ep.record:
            return ep
        ep.record = record
        await self._realize(ep, full=True)  # 1. the new identity's entries
        await asyncio.to_thread(self._dp.set_identity, ep_id, identity)  # 2. the switch
        for ip in record.ips:  # 3. what peers see
            await asyncio.to_thread(self._dp.ipcache_upsert, _host_prefix(ip), identity)
        await asyncio.to_thread(self._store.save, record)
        self._drop_orphans()
        self._report([ep])
        log.info("endpoint identity changed", endpoint=ep_id, pod=record.key, old=old, new=identity)
        return ep

    # --- restore --------------------------------------------------------------------------------

    async def restore(self) -> list[EndpointRecord]:
        """Re-adopt the endpoints of the state directory; clean up those whose pod is gone.

        The pinned programs and maps enforced the whole time; attaching again only
        replaces the programs in place. Returns the restored records, whose addresses
        and identities :meth:`reclaim` confirms with IPAM afterwards.
        """
        await asyncio.to_thread(self._store.prepare)
        records, problems = await asyncio.to_thread(self._store.load_all)
        for problem in problems:
            log.warning("endpoint state skipped", error=str(problem))
        pinned = set(await asyncio.to_thread(_pinned_ids, self._dp))
        restored: list[EndpointRecord] = []
        for record in records:
            if not await asyncio.to_thread(self._net.alive, _link(record)):
                log.info("stale endpoint removed: its namespace is gone", endpoint=record.id, pod=record.key)
                await self._do(lambda r=record: self._drop_stale(r))  # type: ignore[misc]
                continue
            try:
                await self._do(lambda r=record: self._readopt(r))  # type: ignore[misc]
            except Exception as exc:
                log.error("endpoint restore failed", endpoint=record.id, pod=record.key, error=str(exc))
                continue
            restored.append(record)
        known = {r.id for r in records}
        for ep_id in sorted(pinned - known):
            log.info("pinned endpoint without state detached", endpoint=ep_id)
            await asyncio.to_thread(self._dp.detach_endpoint, ep_id)
        log.info("endpoints restored", restored=len(restored), stale=len(records) - len(restored))
        return restored

    async def _readopt(self, record: EndpointRecord) -> None:
        await asyncio.to_thread(self._dp.attach_endpoint, _spec(record))
        for ip in record.ips:
            await asyncio.to_thread(self._dp.ipcache_upsert, _host_prefix(ip), record.identity)
        self.endpoints[record.id] = Endpoint(record, state=datapath_pb2.ENDPOINT_STATE_RESTORING)

    async def _drop_stale(self, record: EndpointRecord) -> None:
        await asyncio.to_thread(self._dp.detach_endpoint, record.id)
        for ip in record.ips:
            try:
                await asyncio.to_thread(self._dp.ipcache_delete, _host_prefix(ip))
            except (KeyError, OSError):
                pass
        try:
            await asyncio.to_thread(self._net.teardown, _link(record))
        except Exception as exc:
            log.warning("stale endpoint teardown failed", endpoint=record.id, error=str(exc))
        await asyncio.to_thread(self._store.remove, record.id)
        # PolicyService may know it from before the restart (its pod is not in the ipcache).
        self._reporter.deleted(record.id, record.identity, record.key)
        for ip in record.ips:
            self._releases.put_nowait(lambda ip=ip: self._release_ip_quietly(ip, record.owner))  # type: ignore[misc]
        if record.identity_owned:
            self._releases.put_nowait(lambda: self._release_identity_quietly(record.identity, record.owner))

    async def _release_ip_quietly(self, ip: str, owner: str) -> None:
        try:
            await self._ipam.release_ip(self.node, ip, owner)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise

    async def _release_identity_quietly(self, identity: int, owner: str) -> None:
        try:
            await self._ipam.release_identity(identity, self.node, owner)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def reclaim(self, records: Sequence[EndpointRecord]) -> None:
        """Reserve each restored endpoint's exact addresses and re-take its identity, retrying until IPAM answers."""
        for record in records:
            delay = 0.2
            while True:
                try:
                    await self._reclaim_one(record)
                    break
                except EndpointError as exc:
                    await self._do(lambda r=record, e=exc: self._fail(r.id, str(e)))  # type: ignore[misc]
                    break
                except Exception as exc:
                    log.warning("reclaim failed, retrying", endpoint=record.id, error=rpc_error(exc))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._backoff_max)

    async def _reclaim_one(self, record: EndpointRecord) -> None:
        for address in record.addresses:
            family = ipam_pb2.FAMILY_IPV6 if address.family == 6 else ipam_pb2.FAMILY_IPV4
            try:
                await self._ipam.allocate_ip(self.node, record.owner, family, address.ip, record.ports)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    continue  # still ours: the allocation outlived the restart
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    raise EndpointError(
                        f"address {address.ip} of {record.key} could not be reserved again ({exc.details()}); "
                        "delete and recreate the endpoint"
                    ) from None
                raise
        if record.identity_owned:
            labels = [common_pb2.Label(source=s, key=k, value=v) for s, k, v in record.labels]
            identity = await self._ipam.allocate_identity(labels, self.node, record.owner)
        else:
            try:
                identity = await self._ipam.resolve_pod(record.namespace, record.pod)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                identity = record.identity
        if identity != record.identity:
            await self.switch_identity(record.id, identity)
        log.debug("endpoint reclaimed", endpoint=record.id, pod=record.key)

    async def _fail(self, ep_id: int, error: str) -> None:
        ep = self.endpoints.get(ep_id)
        if ep is not None:
            ep.state = datapath_pb2.ENDPOINT_STATE_FAILED
            ep.error = error
            log.error("endpoint failed", endpoint=ep_id, error=error)


def _unavailable(what: str, exc: grpc.aio.AioRpcError) -> EndpointError:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        err: EndpointError = InvalidRequest(f"cannot {what}: {exc.details()}")
    elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        err = UpstreamUnavailable(f"cannot {what}: IPAM is not reachable ({exc.details()}); retry when it is up")
    else:
        err = EndpointError(f"cannot {what}: {code.name}: {exc.details()}")
        err.code = code
    return err


def _address(alloc: ipam_pb2.IPAllocation) -> Address:
    family = 6 if alloc.family == ipam_pb2.FAMILY_IPV6 or ":" in alloc.ip else 4
    return Address(ip=alloc.ip, cidr=alloc.cidr, gateway=alloc.gateway, family=family)


def _host_prefix(ip: str) -> str:
    return f"{ip}/{ipaddress.ip_address(ip).max_prefixlen}"


def _spec(record: EndpointRecord) -> dt.EndpointSpec:
    return dt.EndpointSpec(
        id=record.id,
        ifindex=record.host_ifindex,
        host_ifname=record.host_ifname,
        ips=tuple(record.ips),
        identity=record.identity,
    )


def _link(record: EndpointRecord) -> PodLink:
    return PodLink(record.netns, record.netns_owned, record.host_ifname, record.host_ifindex)


def _pinned_ids(dp: DatapathAPI) -> list[int]:
    return [p.id for p in dp.pinned_endpoints()]
