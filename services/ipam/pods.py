"""Pod identities and ipcache entries: from the Kubernetes deltas on the bus, and for API endpoints.

One task owns all pod state and applies events from a queue in order: object
changes, IPAM allocations and identity references made over gRPC, lost node
leases, and the post-sync sweep. Changes of distinct pods that touch distinct
owners and addresses are applied together (a *wave*: their etcd transactions and
bus publishes go in flight at once), since applying them in any order gives the
same state; every other event, and any pod change that overlaps one before it, waits
for the wave before it to end, so each pod's and each address's changes keep their order.

For each pod it computes the identity labels (its own labels, its namespace's labels,
service account, cluster), holds a reference on that identity under the pod's node
(owner ``pod/<ns>/<name>``), and publishes an ipcache entry per pod address. A label change (of the pod or its
namespace) moves the reference in one transaction; a pod that goes, finishes or
loses its node drops its reference and its entries are tombstoned.

Endpoints created through the datapath API with explicit labels (the dev node,
``palisade connectivity probe``) are not on the bus: the datapath takes their
identity reference (IdentityService.AllocateIdentity) and their address
(IPAMService.AllocateIP, with the pod's named ports) itself. ipam *joins* the two:
whenever one owner holds both an identity reference and an address on a node, the
address gets an ipcache entry (identity, node, namespace/pod from the owner, named
ports), stored and published like a bus pod's; when either goes, the entry is
tombstoned. Both halves live in etcd, so a restarted ipam rebuilds the joins (its
named ports from the stored entries) at the post-sync sweep, and the sweep never
releases what such an owner holds.

A reference on a CIDR identity (the policy service holds one per prefix policies name, see
:class:`CidrHolder`) gets the ipcache entry prefix -> identity, the lowest claimant of its
prefix: a pod's or a node's address wins over it, and it comes back when they go.

A pod known from the bus wins over an API endpoint with the same owner: while the
bus has the pod (or, until the sweep, a tombstone of it), no join is published for
that owner, and a reference the API moves or drops for an active bus pod on its
node is taken back for the bus pod's labels.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
from collections.abc import Callable, Mapping
from typing import Any

from palisade.v1 import identity_pb2
from services.common.errors import Code
from services.common.labels import LabelSet, ReservedIdentity
from services.common.log import get_logger
from services.ipam.errors import IpamError
from services.ipam.identities import IdentityAllocator
from services.ipam.ipalloc import IPAllocator
from services.ipam.kv import StoreUnavailable
from services.ipam.model import Identity, Kind, kind_of
from services.ipam.podwatch import (
    Change,
    NamedPort,
    ObjectKind,
    Pod,
    host_prefix,
    parse_owner,
    parse_pod,
    pod_owner,
)
from services.ipam.publish import IdentityPublisher, IpcacheWriter

log = get_logger("pods")

PodKey = tuple[str, str]

#: Pod changes applied together at most.
WAVE = 128


@dataclasses.dataclass(frozen=True, slots=True)
class K8sChanged:
    change: Change


NamedPorts = tuple[tuple[str, NamedPort], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerChanged:
    """An IPAM allocation for ``owner`` on ``node`` was made or released."""

    node: str
    owner: str
    #: The named ports given with an allocation; None when the event says nothing about them.
    named_ports: NamedPorts | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ReferenceChanged:
    """An identity reference of ``owner`` on ``node`` was taken (``held``) or dropped over IdentityService."""

    node: str
    owner: str
    held: bool


@dataclasses.dataclass(frozen=True, slots=True)
class NodeResync:
    """The node's lease was lost: take the references of its pods again."""

    node: str


@dataclasses.dataclass(frozen=True, slots=True)
class Sweep:
    """The initial state is in: drop what etcd still holds for pods that are gone."""

    done: asyncio.Future[None]


Event = K8sChanged | OwnerChanged | ReferenceChanged | NodeResync | Sweep


@dataclasses.dataclass(frozen=True, slots=True)
class ApiOwner:
    """The entries of an API endpoint: whatever ``owner`` holds on ``node``."""

    node: str
    owner: str


@dataclasses.dataclass(frozen=True, slots=True)
class NodeHost:
    """The entries of a node's own addresses (``remote-node``), from its Node object."""

    node: str


@dataclasses.dataclass(frozen=True, slots=True)
class CidrHolder:
    """The entry of a CIDR identity's prefix, while ``owner`` on ``node`` holds a reference on it.

    The policy service holds one for every prefix accepted policies name (node
    :data:`~services.common.labels.CIDR_HOLDER_NODE`, owner ``cidr/<prefix>``). Such an entry
    is the lowest claimant of its prefix: a pod's or a node's address always wins over it.
    """

    node: str
    owner: str


#: Who claims ipcache entries: a pod from the bus, an API owner on a node, a node itself, or a CIDR identity.
EntryKey = PodKey | ApiOwner | NodeHost | CidrHolder

#: The Node address types that are the node's (Cilium's node IPs): pods never use them.
_NODE_ADDRESS_TYPES = ("InternalIP", "ExternalIP")


def node_addresses(obj: Mapping[str, Any] | None) -> list[str]:
    """The addresses a Node object reports for itself (``status.addresses``), valid IPs only."""
    status = obj.get("status") if obj is not None else None
    found = status.get("addresses") if isinstance(status, Mapping) else None
    out = []
    for item in found if isinstance(found, list) else ():
        if isinstance(item, Mapping) and item.get("type") in _NODE_ADDRESS_TYPES:
            try:
                out.append(str(ipaddress.ip_address(str(item.get("address", "")))))
            except ValueError:
                continue
    return sorted(set(out))


@dataclasses.dataclass(frozen=True, slots=True)
class Applied:
    node: str
    labels: LabelSet
    identity: Identity


@dataclasses.dataclass(frozen=True, slots=True)
class Resolution:
    """What ipam knows of one pod (for ResolvePod)."""

    identity: Identity | None
    ips: tuple[str, ...]
    node: str
    #: Why the pod has no identity, when it has none.
    reason: str = ""


class PodManager:
    """Owns pod -> identity/ipcache state; feed it with :meth:`submit`, run :meth:`run`."""

    def __init__(
        self,
        allocator: IdentityAllocator,
        ipalloc: IPAllocator,
        identities: IdentityPublisher,
        ipcache: IpcacheWriter,
        *,
        cluster: str,
        retry_delay: float = 0.5,
    ) -> None:
        self._allocator = allocator
        self._ipalloc = ipalloc
        self._identities = identities
        self._ipcache = ipcache
        self._cluster = cluster
        self._retry_delay = retry_delay
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._pods: dict[PodKey, Pod] = {}
        self._namespaces: dict[str, Mapping[str, Any]] = {}
        self._applied: dict[PodKey, Applied] = {}
        self._entries: dict[EntryKey, dict[str, identity_pb2.IpcacheEntry]] = {}
        self._claims: dict[str, list[EntryKey]] = {}
        #: Named ports of API owners, as given with their addresses.
        self._ports: dict[tuple[str, str], NamedPorts] = {}
        #: (node, owner) references taken over IdentityService by this process and not dropped since.
        self._api_refs: set[tuple[str, str]] = set()
        #: Pods the bus deleted, until the sweep has released what they held.
        self._bus_gone: set[PodKey] = set()
        #: Nodes where each API owner's addresses have entries.
        self._joined: dict[str, set[str]] = {}
        self.swept = asyncio.Event()
        #: (node, owner) pairs looked at to join owners again after their changes (not the sweep's).
        self.rejoin_visits = 0
        #: Waves of more than one pod change applied, and the changes in them (for tests and metrics).
        self.waves = 0
        self.waved = 0

    # -- feeding -----------------------------------------------------------

    def submit(self, event: Event) -> None:
        self._queue.put_nowait(event)

    async def sweep(self) -> None:
        """Queue the post-sync sweep and wait until everything queued before it is applied."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.submit(Sweep(done))
        await done

    # -- views -------------------------------------------------------------

    def pod_count(self) -> int:
        return len(self._pods)

    def api_endpoint_count(self) -> int:
        """API owners whose addresses have ipcache entries."""
        return sum(len(nodes) for nodes in self._joined.values())

    def resolve(self, namespace: str, name: str) -> Resolution | None:
        key = (namespace, name)
        pod = self._pods.get(key)
        if pod is None:
            return None
        applied = self._applied.get(key)
        ips = tuple(e.prefix.split("/")[0] for e in self._entries.get(key, {}).values())
        if applied is None:
            if not pod.node:
                reason = "it is not scheduled to a node yet"
            elif pod.host_network:
                reason = "it uses the host network (it has the host's identity)"
            elif not pod.active:
                reason = f"it has finished (phase {pod.phase})"
            else:
                reason = "its identity could not be allocated yet (see ipam logs)"
            return Resolution(None, ips or pod.ips, pod.node, reason)
        return Resolution(applied.identity, ips, applied.node)

    # -- the loop ----------------------------------------------------------

    async def run(self) -> None:
        held_back: Event | None = None
        while True:
            event = held_back if held_back is not None else await self._queue.get()
            held_back = None
            wave = [event]
            taken = self._footprint(event)
            while taken is not None and len(wave) < WAVE and not self._queue.empty():
                following = self._queue.get_nowait()
                more = self._footprint(following)
                if more is None or not taken.isdisjoint(more):
                    held_back = following  # first of the next wave: nothing overtakes it
                    break
                taken |= more
                wave.append(following)
            if len(wave) == 1:
                await self._run_one(event)
                continue
            self.waves += 1
            self.waved += len(wave)
            await asyncio.gather(*(self._run_one(e) for e in wave))

    async def _run_one(self, event: Event) -> None:
        try:
            await self._apply(event)
        finally:
            if isinstance(event, Sweep):
                # Best effort: readiness and the collector never wait on a failed sweep.
                self.swept.set()
                if not event.done.done():
                    event.done.set_result(None)

    def _footprint(self, event: Event) -> set[object] | None:
        """What a pod change may touch: its pod, its owner and every address it or its owner holds.

        None for every other event (and a pod change that cannot be read): those run alone.
        """
        if not isinstance(event, K8sChanged) or event.change.kind != ObjectKind.POD:
            return None
        change = event.change
        key = (change.namespace, change.name)
        owner = pod_owner(*key)
        prefixes = set(self._entries.get(key, ()))
        nodes = self._allocator.owner_nodes(owner) | self._ipalloc.owner_nodes(owner)
        nodes |= self._joined.get(owner, set())
        if change.obj is not None:
            try:
                pod = parse_pod(change)
            except Exception:
                return None
            prefixes.update(host_prefix(ip) for ip in pod.ips)
            nodes.add(pod.node)
        for node in nodes:
            prefixes.update(host_prefix(ip) for ip in self._ipalloc.owner_ips(node, owner))
            prefixes.update(self._entries.get(ApiOwner(node, owner), ()))
            prefixes.update(self._entries.get(CidrHolder(node, owner), ()))
        return {("pod", key), ("owner", owner), *(("prefix", p) for p in prefixes)}

    async def _apply(self, event: Event) -> None:
        while True:
            try:
                await self._handle(event)
                return
            except StoreUnavailable as exc:
                # etcd is away: keep the event and try again, nothing is dropped.
                log.warning("pod event postponed, etcd unavailable", error=str(exc))
                await asyncio.sleep(self._retry_delay)
            except IpamError as exc:
                log.error("k8s event not applied", event=type(event).__name__, error=exc.message)
                return
            except Exception as exc:
                # One bad event must not stop every later one; the state stays as it was.
                log.error("pod event failed", event=type(event).__name__, error=repr(exc), exc_info=True)
                return

    async def _handle(self, event: Event) -> None:
        if isinstance(event, K8sChanged):
            await self._on_change(event.change)
        elif isinstance(event, OwnerChanged):
            if event.named_ports is not None:
                self._ports[(event.node, event.owner)] = event.named_ports
            key = parse_owner(event.owner)
            if key is not None and key in self._pods:
                await self._ensure(key)
            await self._join(event.node, event.owner)
        elif isinstance(event, ReferenceChanged):
            await self._on_reference(event)
        elif isinstance(event, NodeResync):
            for key, applied in list(self._applied.items()):
                if applied.node == event.node:
                    await self._ensure(key, force=True)
            await self._join_where(lambda node, _owner: node == event.node)
        else:
            await self._sweep()

    async def _on_reference(self, event: ReferenceChanged) -> None:
        holder = (event.node, event.owner)
        key = parse_owner(event.owner)
        if event.held:
            self._api_refs.add(holder)
            if key is not None:
                self._bus_gone.discard(key)  # taken after the bus deleted the pod: the API's now
        else:
            self._api_refs.discard(holder)
        pod = self._pods.get(key) if key is not None else None
        applied = self._applied.get(key) if key is not None else None
        taken = applied is not None and self._allocator.held(event.node, event.owner) == applied.identity.id
        if key is not None and pod is not None and pod.active and pod.node == event.node and not taken:
            # The bus pod wins: the API moved or dropped the reference ipam holds for it.
            log.warning(
                "api changed a bus pod's identity reference, taking it back",
                namespace=key[0],
                pod=key[1],
                node=event.node,
            )
            await self._ensure(key, force=True)
        await self._join(event.node, event.owner)

    async def _on_change(self, change: Change) -> None:
        if change.kind == ObjectKind.NAMESPACE:
            if change.obj is None:
                self._namespaces.pop(change.name, None)
            else:
                self._namespaces[change.name] = change.obj
            for key in [k for k in self._pods if k[0] == change.name]:
                await self._ensure(key)
        elif change.kind == ObjectKind.POD:
            key = (change.namespace, change.name)
            if change.obj is None:
                self._pods.pop(key, None)
                if not self.swept.is_set():
                    self._bus_gone.add(key)
            else:
                self._pods[key] = parse_pod(change)
                self._bus_gone.discard(key)
            await self._ensure(key)
            # After the bus pod's own entries, so an address both claim never flaps. Before the sweep
            # there is nothing to rejoin: the sweep joins everything once the bus state is in.
            await self._rejoin_owner(pod_owner(*key), scan=change.obj is None and self.swept.is_set())
        else:
            await self._ipalloc.observe_node(change.name, change.obj)
            # Each node address is the remote-node identity everywhere (its own datapath: host).
            await self._set_entries(
                NodeHost(change.name),
                {
                    host_prefix(ip): identity_pb2.IpcacheEntry(
                        prefix=host_prefix(ip), identity=int(ReservedIdentity.REMOTE_NODE), node=change.name
                    )
                    for ip in node_addresses(change.obj)
                },
            )
            if change.obj is None:
                await self._allocator.drop_node(change.name)
                self._api_refs = {h for h in self._api_refs if h[0] != change.name}
                for key, applied in list(self._applied.items()):
                    if applied.node == change.name:
                        await self._ensure(key, force=True)
                await self._join_where(lambda node, _owner: node == change.name)

    # -- one pod -----------------------------------------------------------

    async def _drop_reference(self, key: PodKey, applied: Applied) -> None:
        try:
            await self._allocator.release(applied.identity.id, applied.node, pod_owner(*key))
        except IpamError as exc:
            if exc.code != Code.NOT_FOUND:
                raise
            await self._allocator.release_owner(applied.node, pod_owner(*key))

    async def _ensure(self, key: PodKey, *, force: bool = False) -> None:
        pod = self._pods.get(key)
        applied = self._applied.get(key)
        if pod is None or not pod.active:
            if applied is not None:
                await self._drop_reference(key, applied)
                del self._applied[key]
                log.info("pod identity released", namespace=key[0], pod=key[1], id=applied.identity.id)
            await self._set_entries(key, {})
            return
        labels = pod.identity_labels(self._namespaces.get(pod.namespace), self._cluster)
        if applied is not None and applied.node != pod.node:
            await self._drop_reference(key, applied)
            del self._applied[key]
            applied = None
        if force or applied is None or applied.labels != labels:
            try:
                result = await self._allocator.allocate(labels, pod.node, pod.owner)
            except IpamError as exc:
                log.error("pod identity not allocated", namespace=key[0], pod=key[1], error=exc.message)
                return
            if result.new:
                await self._identities.created(result.identity, result.revision)
            else:
                await self._identities.seen(result.identity, result.revision)
            old = applied.identity.id if applied is not None else None
            applied = Applied(pod.node, labels, result.identity)
            self._applied[key] = applied
            if old != result.identity.id:
                log.info(
                    "pod identity set",
                    namespace=key[0],
                    pod=key[1],
                    id=result.identity.id,
                    previous=old or result.previous or 0,
                    node=pod.node,
                )
        ips = pod.ips or self._ipalloc.owner_ips(pod.node, pod.owner)
        entries = {}
        for ip in ips:
            prefix = host_prefix(ip)
            entry = identity_pb2.IpcacheEntry(
                prefix=prefix, identity=applied.identity.id, node=pod.node, namespace=key[0], pod=key[1]
            )
            for port_name, port in pod.named_ports:
                entry.named_ports[port_name].port = port.port
                entry.named_ports[port_name].protocol = port.protocol
            entries[prefix] = entry
        await self._set_entries(key, entries)

    # -- API endpoints -----------------------------------------------------

    def _bus_owns(self, key: PodKey | None) -> bool:
        """Whether the bus decides for this owner (it has the pod, or deleted it before the sweep)."""
        return key is not None and (key in self._pods or key in self._bus_gone)

    def _api_candidates(self) -> set[tuple[str, str]]:
        joined = {(node, owner) for owner, nodes in self._joined.items() for node in nodes}
        return self._allocator.owner_keys() | self._ipalloc.owner_keys() | joined

    async def _rejoin_owner(self, owner: str, *, scan: bool) -> None:
        """Join ``owner`` again where it has entries (and, with ``scan``, wherever it holds something).

        The allocators index their holdings by owner: a pod deletion looks at that owner's nodes
        only, never at every (node, owner) of the cluster.
        """
        nodes = set(self._joined.get(owner, ()))
        if scan:
            nodes |= self._allocator.owner_nodes(owner) | self._ipalloc.owner_nodes(owner)
        self.rejoin_visits += len(nodes)
        for node in sorted(nodes):
            await self._join(node, owner)

    async def _join_where(self, pick: Callable[[str, str], bool]) -> None:
        for node, owner in sorted(self._api_candidates()):
            if pick(node, owner):
                await self._join(node, owner)

    async def _claim_cidr(self, node: str, owner: str, identity: int | None) -> None:
        """Publish (or tombstone) the entry prefix -> CIDR identity while ``owner`` holds one on ``node``."""
        holder = CidrHolder(node, owner)
        entries: dict[str, identity_pb2.IpcacheEntry] = {}
        if identity is not None and kind_of(identity) is Kind.CIDR:
            labels = self._allocator.labels_of(identity)
            prefix = Identity(identity, labels).cidr if labels is not None else ""
            if prefix:
                entries[prefix] = identity_pb2.IpcacheEntry(prefix=prefix, identity=identity)
            else:
                log.error("cidr identity without a known prefix, no ipcache entry", node=node, owner=owner, id=identity)
        before = self._entries.get(holder)
        if not entries and before is None:
            return
        await self._set_entries(holder, entries)
        if entries and before != entries:
            log.info("cidr identity entry set", node=node, owner=owner, id=identity, prefix=next(iter(entries)))
        elif not entries:
            log.info("cidr identity entry dropped", node=node, owner=owner)

    async def _join(self, node: str, owner: str) -> None:
        """Publish (or tombstone) the ipcache entries of what ``owner`` holds on ``node``."""
        holder = ApiOwner(node, owner)
        identity = self._allocator.held(node, owner)
        await self._claim_cidr(node, owner, identity)
        cidr = identity is not None and kind_of(identity) is Kind.CIDR
        ips = self._ipalloc.owner_ips(node, owner)
        if identity is None and not ips:
            self._ports.pop((node, owner), None)
        key = parse_owner(owner)
        entries: dict[str, identity_pb2.IpcacheEntry] = {}
        if identity is not None and ips and not cidr and not self._bus_owns(key):
            namespace, pod = key if key is not None else ("", "")
            ports = self._api_ports(node, owner, ips)
            for ip in ips:
                prefix = host_prefix(ip)
                entry = identity_pb2.IpcacheEntry(
                    prefix=prefix, identity=identity, node=node, namespace=namespace, pod=pod
                )
                for port_name, port in ports:
                    entry.named_ports[port_name].port = port.port
                    entry.named_ports[port_name].protocol = port.protocol
                entries[prefix] = entry
        before = self._entries.get(holder)
        if not entries and before is None:
            return
        await self._set_entries(holder, entries)
        if entries:
            self._joined.setdefault(owner, set()).add(node)
        else:
            nodes = self._joined.get(owner, set())
            nodes.discard(node)
            if not nodes:
                self._joined.pop(owner, None)
        if entries and before is None:
            log.info("api endpoint joined", node=node, owner=owner, id=identity, ips=",".join(ips))
        elif not entries:
            log.info("api endpoint left", node=node, owner=owner)

    def _api_ports(self, node: str, owner: str, ips: tuple[str, ...]) -> NamedPorts:
        """The owner's named ports: as last given, else as stored with its entries (after a restart)."""
        known = self._ports.get((node, owner))
        if known is not None:
            return known
        key = parse_owner(owner) or ("", "")
        for ip in ips:
            stored = self._ipcache.entries.get(host_prefix(ip))
            if stored is not None and stored.node == node and (stored.namespace, stored.pod) == key:
                ports = tuple((name, NamedPort(p.port, p.protocol)) for name, p in sorted(stored.named_ports.items()))
                self._ports[(node, owner)] = ports
                return ports
        return ()

    def _api_holds(self, node: str, owner: str) -> bool:
        """Whether a reference of ``owner`` on ``node`` belongs to an API endpoint (the sweep keeps it)."""
        if (node, owner) in self._api_refs:
            return True
        return not self._bus_owns(parse_owner(owner)) and bool(self._ipalloc.owner_ips(node, owner))

    async def _set_entries(self, key: EntryKey, entries: dict[str, identity_pb2.IpcacheEntry]) -> None:
        old = self._entries.get(key, {})
        if entries:
            self._entries[key] = entries
        else:
            self._entries.pop(key, None)
        for prefix in sorted(set(old) - set(entries)):
            claimants = self._claims.get(prefix, [])
            if key in claimants:
                claimants.remove(key)
            if claimants:
                # Another pod claims the address too (e.g. it was reused): it is theirs now.
                await self._ipcache.upsert(self._entries[claimants[-1]][prefix])
            else:
                self._claims.pop(prefix, None)
                await self._ipcache.delete(prefix)
        for prefix, entry in sorted(entries.items()):
            claimants = self._claims.setdefault(prefix, [])
            if key in claimants:
                claimants.remove(key)
            if isinstance(key, CidrHolder):
                claimants.insert(0, key)  # the lowest claimant: any pod's or node's address wins over it
            else:
                claimants.append(key)
            if claimants[-1] == key:
                await self._ipcache.upsert(entry)

    async def _sweep(self) -> None:
        """Rejoin API endpoints, then forget what etcd holds for pods that went while ipam was away."""
        await self._join_where(lambda _node, _owner: True)
        for prefix in sorted(set(self._ipcache.entries) - set(self._claims)):
            await self._ipcache.delete(prefix)
            log.info("stale ipcache entry removed", prefix=prefix)
        for holder in await self._allocator.holders("pod/"):
            key = parse_owner(holder.owner)
            applied = self._applied.get(key) if key is not None else None
            if applied is not None and applied.node == holder.node:
                continue
            if self._api_holds(holder.node, holder.owner):
                continue
            try:
                await self._allocator.release(holder.identity, holder.node, holder.owner)
            except IpamError:
                continue
            log.info("stale pod reference released", node=holder.node, owner=holder.owner, id=holder.identity)
            await self._join(holder.node, holder.owner)
        self._bus_gone.clear()
