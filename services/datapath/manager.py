"""The endpoint manager: the lifecycle of local pods (create, delete, relabel, restore, reclaim).

One task (:meth:`EndpointManager.run`) owns every endpoint and, through its
:class:`~services.datapath.realizer.Realizer`, the desired policy of every local
identity; everything that changes them is a command on its queue, so no lock exists
and none is held across network I/O: calls to IPAMService, IdentityService and
PolicyService happen in the caller's task, before or after the command that commits
their result. BPF and netlink calls block, so they go through ``asyncio.to_thread``.

Requests arrive translated (``wire``): nothing here sees protobuf or grpc. Failures of
other services arrive as :class:`UpstreamError` with their status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from services.common.errors import Code
from services.common.labels import LABEL_POD_NAMESPACE
from services.common.log import get_logger
from services.common.retry import retry
from services.common.stopwatch import Stopwatch
from services.datapath import deletequeue
from services.datapath import netns as netns_mod
from services.datapath import types as dt
from services.datapath.datapath import DatapathAPI
from services.datapath.endpoint import (
    Endpoint,
    EndpointRef,
    host_ifname,
    host_prefix,
    link_of,
    netns_name,
    spec_of,
)
from services.datapath.errors import (
    DatapathFailure,
    EndpointError,
    EndpointExists,
    EndpointNotFound,
    InvalidRequest,
    PreconditionFailed,
    UpstreamError,
    UpstreamUnavailable,
)
from services.datapath.fqdnmaps import NameEndpoint
from services.datapath.ipamclient import IpamPort, NodeIpam
from services.datapath.netns import PodLink, PodPlug
from services.datapath.realizer import IdentityPolicy, RealizationSink, Realizer
from services.datapath.state import EndpointRecord, EndpointStore
from services.datapath.validate import validate_labels, validate_request

log = get_logger("endpoints")


T = TypeVar("T")


class PodNetwork(Protocol):
    """Network namespaces, veths, addresses and routes (blocking calls); ``netns.NetnsPodNetwork`` in the service."""

    def plug(self, *, netns: str, create: bool, host_ifname: str, pod_ifname: str = "eth0") -> PodPlug:
        """The namespace (created, or adopted) joined to the host by a veth, nothing routed yet."""
        ...

    def address(self, plug: PodPlug, addresses: Sequence[dt.Address]) -> PodLink:
        """The addresses on the pod and routed to it; the caller tears the link down on failure."""
        ...

    def adopt(self, *, netns: str, host_ifname: str, ips: Sequence[str]) -> PodLink:
        """Chained CNI: the host-side veth another plugin made, as it is."""
        ...

    def teardown(self, link: PodLink) -> None: ...

    def alive(self, link: PodLink) -> bool:
        """Whether the namespace and the host veth of a pod still exist."""
        ...

    def exists(self, netns: str) -> bool:
        """Whether the network namespace (a path) exists, to be adopted."""
        ...


class PolicySource(Protocol):
    """What the manager needs from PolicyService: the policy of a new endpoint's identity."""

    async def resync(self, node: str, identities: Sequence[int] = ()) -> dt.ResyncState: ...


def identity_labels(namespace: str, labels: Sequence[dt.Label]) -> tuple[dt.Label, ...]:
    """The labels to allocate an identity for: the given ones plus the pod's namespace label."""
    out = [dt.Label(x.source or "k8s", x.key, x.value) for x in labels]
    if not any(x.key == LABEL_POD_NAMESPACE for x in out):
        out.append(dt.Label("k8s", LABEL_POD_NAMESPACE, namespace))
    return tuple(out)


class _PickRefused(Exception):
    """IPAM refused an address picked here; the create was undone and starts over."""

    def __init__(self, ip: str) -> None:
        super().__init__(f"IPAM refused the picked address {ip}")
        self.ip = ip


@dataclasses.dataclass
class _Command:
    run: Callable[[], Awaitable[Any]]
    done: asyncio.Future[Any]


class EndpointManager:
    """Owns local endpoints; its realizer owns their policy."""

    def __init__(
        self,
        *,
        node: str,
        datapath: DatapathAPI,
        network: PodNetwork,
        store: EndpointStore,
        ipam: IpamPort,
        policy: PolicySource,
        reporter: RealizationSink,
        backoff_max: float = 5.0,
        names: Callable[[list[NameEndpoint]], object] | None = None,
        published: Callable[[str], bool] = lambda ip: False,
    ) -> None:
        self.node = node
        self._dp = datapath
        self._net = network
        self._store = store
        self._ipam = ipam
        self._node_ipam = NodeIpam(ipam, node)
        self._policy = policy
        self._reporter = reporter
        self._backoff_max = backoff_max
        self._queue: asyncio.Queue[_Command] = asyncio.Queue()
        self.endpoints: dict[int, Endpoint] = {}
        self.realizer = Realizer(datapath=datapath, endpoints=self.endpoints, reporter=reporter)
        #: Ids and pod keys of endpoints being created or deleted (not in ``endpoints`` yet / anymore).
        self._busy_ids: set[int] = set()
        self._busy_pods: set[str] = set()
        #: Addresses of creates whose programs go in before IPAM confirmed the addresses (chained,
        #: or picked here).
        self._unconfirmed_ips: set[str] = set()
        #: Whether the ipcache has an entry for an address (someone holds it): not picked here.
        self._published = published
        #: Address -> id of the endpoint in the table that has it (ipcache entries ask per address).
        self._by_ip: dict[str, int] = {}
        self._releases: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        #: Policy fetches in flight, by identity (see :meth:`_fetch_policy`).
        self._fetches: dict[int, asyncio.Task[IdentityPolicy | None]] = {}
        #: Networks of deleted CNI endpoints being torn down, by host veth name (see :meth:`delete`).
        self._teardowns: dict[str, tuple[EndpointRecord, asyncio.Task[None]]] = {}
        #: Told the endpoints and their name rules after every command (the DNS proxy's publisher).
        self._names = names
        #: What the last publication was made of (see :meth:`_publish_names`).
        self._names_made_of: tuple[tuple[int, int, tuple[dt.Address, ...], int], ...] | None = None

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
            self._publish_names()

    def name_endpoints(self) -> list[NameEndpoint]:
        """Every local endpoint with its identity's name rules (none until its policy is known)."""
        out = []
        for ep in self.endpoints.values():
            policy = self.realizer.policies.get(ep.identity)
            if policy is None:
                out.append(NameEndpoint(ep.id, ep.identity, ep.record.ips, dt.NO_NAMES))
                continue
            out.append(NameEndpoint(ep.id, ep.identity, ep.record.ips, policy.names, policy.aliased))
        return out

    def _publish_names(self) -> None:
        # Not before the first resync: restored endpoints without their rules would withdraw the
        # steering and the proxy's learned names until the policy came back.
        if self._names is None or not self.realizer.synced:
            return
        # After every command, so cheaply: what it is made of (endpoints, their addresses and their
        # identities' policy versions) is compared before anything is built.
        policies = self.realizer.policies
        made_of = tuple(
            (ep.id, ep.identity, ep.record.addresses, p.version if (p := policies.get(ep.identity)) else 0)
            for ep in self.endpoints.values()
        )
        if made_of == self._names_made_of:
            return
        try:
            self._names(self.name_endpoints())
        except OSError as exc:
            log.error("DNS proxy endpoints not published", error=str(exc))
            return
        self._names_made_of = made_of

    async def _do(self, fn: Callable[[], Awaitable[T]]) -> T:
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Command(fn, done))
        return await asyncio.shield(done)

    async def run_releases(self) -> None:
        """Release addresses and identity references of removed endpoints, retrying until IPAM answers."""
        while True:
            release = await self._releases.get()
            await retry("release to IPAM", release, maximum=self._backoff_max)

    # --- policy, through the owning task -----------------------------------------------------------

    async def apply_order(self, batch: dt.OrderBatch) -> None:
        await self._do(lambda: self.realizer.apply_order(batch))

    async def apply_resync(self, state: dt.ResyncState) -> None:
        await self._do(lambda: self.realizer.apply_resync(state))

    async def sweep(self, queue: Path) -> int:
        """Apply queued CNI deletions and delete endpoints whose adopted namespace vanished; returns how many.

        Then the program links that chained DELs left on their veths are released (see :meth:`_detach`).
        """
        removed = 0
        for item in await asyncio.to_thread(deletequeue.pending, queue):
            ref = EndpointRef(container_id=item.container_id)
            try:
                await self.delete(ref)
                removed += 1
                log.info("queued CNI deletion applied", container=item.container_id, pod=f"{item.namespace}/{item.pod}")
            except EndpointNotFound:
                pass  # never added, or deleted already: nothing to do, as for DEL itself
            except UpstreamUnavailable as exc:
                log.warning("queued CNI deletion applied; IPAM release pending", error=str(exc))
            await asyncio.to_thread(deletequeue.done, item)
        for ep in list(self.endpoints.values()):
            record = ep.record
            if record.netns_owned or await asyncio.to_thread(self._net.exists, record.netns):
                continue
            # The runtime removed the sandbox without a DEL (or it was lost): nothing can use the endpoint.
            log.info("endpoint removed: its network namespace vanished", endpoint=ep.id, pod=record.key)
            with contextlib.suppress(EndpointNotFound, UpstreamUnavailable):
                await self.delete(EndpointRef(ep.id))
                removed += 1
        await asyncio.to_thread(self._dp.reap_links, self._going_ifindexes())
        return removed

    async def repair(self) -> int:
        """Dump every endpoint's map and rewrite those that drifted; returns how many were repaired."""
        return await self._do(self.realizer.repair)

    @property
    def revision(self) -> int:
        """The revision of the last order or resync applied."""
        return self.realizer.revision

    # --- reads (safe from any task: the table is only replaced between awaits) ----------------

    def find(self, ref: EndpointRef) -> Endpoint:
        if ref.id:
            ep = self.endpoints.get(ref.id)
            if ep is not None and (not ref.namespace or ep.record.key == f"{ref.namespace}/{ref.pod}"):
                return ep
        elif ref.pod:
            for ep in self.endpoints.values():
                if ep.record.namespace == ref.namespace and ep.record.pod == ref.pod:
                    return ep
        else:
            for ep in self.endpoints.values():
                if ep.record.container_id == ref.container_id:
                    return ep
        raise EndpointNotFound(f"{ref} does not exist on node {self.node}; list endpoints to see what does")

    def _held_here(self, ips: set[str]) -> bool:
        """Whether an endpoint of this node, or a chained create not yet confirmed, has one of ``ips``."""
        return bool(ips & self._unconfirmed_ips) or any(self.by_ip(ip) is not None for ip in ips)

    def by_ip(self, ip: str) -> Endpoint | None:
        ep_id = self._by_ip.get(ip)
        return None if ep_id is None else self.endpoints.get(ep_id)

    def _enter(self, ep: Endpoint) -> None:
        """Into the table (the only way in: the address index follows it)."""
        self.endpoints[ep.id] = ep
        for ip in ep.record.ips:
            self._by_ip[ip] = ep.id

    def _leave(self, ep: Endpoint) -> None:
        del self.endpoints[ep.id]
        for ip in ep.record.ips:
            if self._by_ip.get(ip) == ep.id:
                del self._by_ip[ip]

    def local_prefixes(self) -> dict[str, int]:
        """Host prefixes of local endpoints and their identities."""
        return {host_prefix(ip): ep.identity for ep in self.endpoints.values() for ip in ep.record.ips}

    def local_identity(self, prefix: str) -> int | None:
        """The identity of the local endpoint whose host prefix ``prefix`` is (None: no such endpoint)."""
        address = prefix.partition("/")[0]
        ep = self.by_ip(address)
        if ep is None or host_prefix(address) != prefix:
            return None
        return ep.identity

    def realized_revision(self) -> int:
        """Lowest realized revision over endpoints (the node's when it has none)."""
        live = [ep.realized_revision for ep in self.endpoints.values()]
        return min(live) if live else self.realizer.revision

    async def read_policy_map(self, ref: EndpointRef) -> tuple[Endpoint, dt.Enforcement, list[dt.PolicyEntry]]:
        """The endpoint's policy map as the kernel holds it."""
        ep = self.find(ref)
        enforcement, entries = await asyncio.to_thread(self._dp.dump_policy, ep.id)
        return ep, enforcement, entries

    # --- create --------------------------------------------------------------------------------

    async def create(self, request: dt.EndpointRequest) -> Endpoint:
        """Create the endpoint of a pod: identity, addresses, network, programs and first policy.

        A caller that goes away meanwhile (a deadline, a cancelled call) does not stop it half-way:
        parts of it run in threads and owner commands that finish whatever the caller does, so
        the create runs to its end and what it made is then deleted again. Nothing is left behind
        (no veth, address, identity reference or reservation of the pod).
        """
        task = asyncio.ensure_future(self._create(request))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await self._undo_abandoned(task, request.key)
            raise

    async def _undo_abandoned(self, task: asyncio.Future[Endpoint], key: str) -> None:
        """Wait for a create whose caller went away, and delete what it made (a failed one undid itself)."""
        try:
            # Shielded again: cancelled once more (the service stopping), the create still
            # finishes rather than stopping half-way; it is then an endpoint like any other.
            ep = await asyncio.shield(task)
        except Exception:
            return
        log.info("endpoint created for a caller that went away; deleting it", endpoint=ep.id, pod=key)
        try:
            await self.delete(EndpointRef(ep.id))
        except EndpointNotFound:
            pass  # deleted meanwhile (the runtime's DEL after its ADD timed out)
        except Exception as exc:
            log.warning("deleting an abandoned endpoint failed", endpoint=ep.id, pod=key, error=str(exc))

    async def _create(self, request: dt.EndpointRequest) -> Endpoint:
        try:
            return await self._create_once(request, pick=True)
        except _PickRefused as refused:
            # Another process took the address meanwhile (or the node's CIDR changed): the create
            # was undone whole; ipam chooses this time.
            log.info("picked address refused by IPAM; asking it for one", pod=request.key, ip=refused.ip)
            return await self._create_once(request, pick=False)

    @property
    def address_picks(self) -> tuple[int, int]:
        """Addresses picked here that IPAM recorded, and that it refused (see addresspick)."""
        return self._node_ipam.picks_recorded, self._node_ipam.picks_refused

    def _taken(self, ip: str) -> bool:
        return self._held_here({ip}) or self._published(ip)

    def _pick(self, wanted: Sequence[tuple[int, str]]) -> tuple[dt.Address, ...]:
        """Addresses picked here for a create that asks for none (empty: ipam chooses)."""
        picked = []
        for family, ip in wanted:
            address = None if ip else self._node_ipam.picker.pick(family, self._taken)
            if address is None:
                return ()
            picked.append(address)
        return tuple(picked)

    async def _create_once(self, request: dt.EndpointRequest, *, pick: bool) -> Endpoint:
        watch = Stopwatch()
        wanted = validate_request(request)
        key = request.key
        owner = f"pod/{key}"
        netns = request.netns and netns_mod.netns_path(netns_mod.name_of(request.netns))
        if request.container_id:
            # A runtime's ADD: a sandbox of the same id (ADD repeated) or of the same pod (a new
            # sandbox before the old one's DEL) is replaced, as CNI expects.
            for old in [e for e in self.endpoints.values() if e.record.container_id == request.container_id
                        or e.record.key == key]:  # fmt: skip
                log.info("endpoint replaced by a new sandbox", endpoint=old.id, pod=old.record.key)
                with contextlib.suppress(EndpointNotFound, UpstreamUnavailable):
                    await self.delete(EndpointRef(old.id))
        ep_id = await self._do(lambda: self._reserve(key, netns))
        watch.lap("reserve")
        if netns and not await asyncio.to_thread(self._net.exists, netns):
            await self._do(lambda: self._unreserve(ep_id, key))
            raise InvalidRequest(f"netns: network namespace {netns} does not exist; create it or leave netns empty")
        undo: list[Callable[[], Awaitable[None]]] = []
        policy: asyncio.Task[IdentityPolicy | None] | None = None
        labels: tuple[dt.Label, ...] = identity_labels(request.namespace, request.labels) if request.labels else ()
        identity = dt.IDENTITY_INIT

        async def identity_and_policy() -> None:
            # 1. identity, then its policy fetched (if no local endpoint has it yet) while the rest is made
            nonlocal identity, policy
            started = time.perf_counter()
            identity = await self._identity_of(request, labels, owner, undo)
            watch.record("identity", time.perf_counter() - started)
            policy = asyncio.create_task(self._fetch_policy(identity), name=f"policy of {key}")

        async def allocate_addresses() -> None:
            # 2. addresses (with the named ports, which ipam puts in the address's ipcache entry);
            # those picked here (in ``wanted``'s order) are recorded by ipam, or refused, and the
            # create then starts over
            started = time.perf_counter()
            for n, (family, ip) in enumerate(wanted):
                if picked:
                    recorded = await self._node_ipam.reserve_picked(owner, picked[n], request.ports)
                    if recorded is None:
                        raise _PickRefused(picked[n].ip)
                    address = recorded
                else:
                    address = await self._node_ipam.allocate_ip(
                        owner, family, request.ports, ip, outside_pool=request.outside_pool
                    )
                addresses.append(address)
                undo.append(lambda ip=address.ip: self._ipam.release_ip(self.node, ip, owner))  # type: ignore[misc]
            watch.record("address", time.perf_counter() - started)

        async def network() -> PodLink | PodPlug:
            # 3. namespace and veth, nothing routed yet (or, chained, the veth another plugin made)
            started = time.perf_counter()
            made = await self._pod_network(request, netns)
            link = made if isinstance(made, PodLink) else made.link
            undo.append(lambda: asyncio.to_thread(self._net.teardown, link))
            watch.record("network", time.perf_counter() - started)
            return made

        async def addresses_and_network() -> PodLink:
            # The addresses are allocated while the namespace and the veth are made (picked here:
            # known already); each branch runs to its end, so the undo list is complete when
            # either fails.
            branches = [network()] if picked else [network(), allocate_addresses()]
            made, *recorded = await asyncio.gather(*branches, return_exceptions=True)
            for result in (*recorded, made):
                if isinstance(result, BaseException):
                    if isinstance(made, PodPlug):
                        made.close()
                    raise result
            if isinstance(made, PodLink):
                return made
            assert isinstance(made, PodPlug)
            started = time.perf_counter()
            try:
                link = await asyncio.to_thread(self._net.address, made, picked or addresses)
            except (OSError, ValueError) as exc:
                raise DatapathFailure(f"cannot set up the network of {key}: {exc}") from exc
            watch.record("routes", time.perf_counter() - started)
            return link

        addresses: list[dt.Address] = []
        # Chained, the other plugin chose the addresses and set them up: nothing before the commit
        # needs IPAM's answer, so reserving them goes on while the first policy and the programs go
        # in (its round trip was the longest step of a chained ADD). The pod's ipcache entries and
        # its state wait for it. Not when an endpoint of this node has one of the addresses (a
        # duplicate from the other plugin's IPAM): the programs' entries for it would replace that
        # endpoint's, so IPAM must refuse first.
        #
        # Standalone, a create that asks for no address gets the next one of the node's CIDR picked
        # here (see addresspick): IPAM records it meanwhile in the same way, so the pod's network is
        # made without waiting for IPAM's round trip first.
        chosen = {ip for _, ip in wanted}
        reservation: asyncio.Future[None] | None = None
        picked: tuple[dt.Address, ...] = ()
        if request.adopt_host_ifname:
            if all(chosen) and not self._held_here(chosen):
                self._unconfirmed_ips |= chosen
                reservation = asyncio.ensure_future(allocate_addresses())
        elif pick and not any(chosen):
            picked = self._pick(wanted)
            if picked:
                chosen = {a.ip for a in picked}
                self._unconfirmed_ips |= chosen
                reservation = asyncio.ensure_future(allocate_addresses())
        try:
            # The identity and the pod's network need nothing of each other: both go at once, each
            # recording its undo steps as it makes progress (both run to their end before a failure
            # of either is raised, so the undo list is complete).
            outcome = await asyncio.gather(
                identity_and_policy(),
                network() if request.adopt_host_ifname and reservation is not None else addresses_and_network(),
                return_exceptions=True,
            )
            for result in outcome:
                if isinstance(result, BaseException):
                    raise result
            link = outcome[1]
            assert isinstance(link, PodLink)
            watch.lap("identity_address_network")
            first_addresses = picked or tuple(addresses)
            if reservation is not None and not picked:
                # Provisional until IPAM answers (which adds each address's pod CIDR and gateway).
                first_addresses = tuple(dt.Address(ip=ip, cidr="", gateway="", family=family) for family, ip in wanted)
            record = EndpointRecord(
                id=ep_id,
                namespace=request.namespace,
                pod=request.pod,
                netns=link.netns,
                netns_owned=link.netns_owned,
                host_ifname=link.host_ifname,
                host_ifindex=link.host_ifindex,
                addresses=first_addresses,
                labels=labels,
                identity_owned=bool(labels),
                identity=identity,
                ports=request.ports,
                created_at=time.time(),
                container_id=request.container_id,
                ifname=link.pod_ifname,
                mac=link.pod_mac,
                link_owned=link.link_owned,
                host_mac=link.host_mac,
            )
            # 4. the identity's policy
            assert policy is not None
            fetched = await policy
            watch.lap("policy")
            undo.append(lambda: asyncio.to_thread(self._store.remove, ep_id))
            # 5. the first policy, in the owning task, before any packet meets the programs
            undo.append(lambda: self._detach_id(ep_id))
            ep = await self._do(lambda: self._first_policy(record, fetched))
            watch.lap("first_policy")
            # 6. state, programs and ipcache entries, outside the owning task: the kernel's attach
            # waits grace periods, and the owner applies orders and creates other endpoints meanwhile
            try:
                await asyncio.to_thread(self._attach, record, confirmed=reservation is None)
            except Exception as exc:
                raise DatapathFailure(f"cannot attach BPF programs for {record.key}: {exc}") from exc
            watch.lap("attach")
            if reservation is not None:
                # A refused reservation (another pod holds the address) undoes the create here,
                # before the address's ipcache entry on this node was touched (picked here: and
                # the create starts over with an address IPAM chooses).
                await reservation
                watch.lap("address_reserved")
                record = dataclasses.replace(record, addresses=tuple(addresses))
                await asyncio.to_thread(self._confirm, record)
                watch.lap("store")
            # 7. into the table, with what orders changed since the first write
            await self._do(lambda: self._commit(ep, fetched, watch, record))
        except BaseException as exc:
            if reservation is not None:
                # Its release is in the undo list only once it has ended.
                with contextlib.suppress(BaseException):
                    await reservation
            if policy is not None:
                if not policy.done():
                    policy.cancel()
                with contextlib.suppress(BaseException):
                    await policy
                # A fetched answer this endpoint will not commit is not kept for others: it would age.
                shared = self._fetches.get(identity)
                if shared is not None and shared.done():
                    del self._fetches[identity]
            for step in reversed(undo):
                try:
                    await step()
                except Exception as cleanup:
                    log.warning("cleanup after failed create failed", pod=key, error=str(cleanup))
            await self._do(lambda: self._unreserve(ep_id, key))
            if not isinstance(exc, _PickRefused):
                log.warning("endpoint create failed", pod=key, error=str(exc))
            raise
        finally:
            if reservation is not None:
                self._unconfirmed_ips -= chosen
        if identity == dt.IDENTITY_INIT:
            # The pod may have become known while the endpoint was being made: its ipcache entry then
            # arrived before there was an endpoint to move, so ask once more now that there is one.
            try:
                known = await self._node_ipam.resolve_pod(request.namespace, request.pod)
            except EndpointError:
                known = dt.IDENTITY_INIT
            if known != dt.IDENTITY_INIT:
                ep = await self.switch_identity(ep.id, known)
            watch.lap("late_identity")
        ips = ",".join(record.ips)
        log.info("endpoint created", endpoint=ep.id, pod=key, identity=ep.identity, ips=ips, **watch.fields())
        return ep

    def _attach(self, record: EndpointRecord, *, confirmed: bool) -> None:
        """The programs on the veth; with addresses IPAM ``confirmed``, the state file before them and
        the pod's ipcache entries after them (one thread hop, out of the loop: a file written on a
        disk-backed state directory costs about a millisecond)."""
        if confirmed:
            self._store.save(record)
        self._dp.attach_endpoint(spec_of(record))
        if confirmed:
            self._ipcache_upsert(record)

    def _confirm(self, record: EndpointRecord) -> None:
        """State and ipcache entries of a chained endpoint whose programs went in before IPAM's answer."""
        self._store.save(record)
        self._ipcache_upsert(record)

    def _ipcache_upsert(self, record: EndpointRecord) -> None:
        for ip in record.ips:
            self._dp.ipcache_upsert(host_prefix(ip), record.identity)

    async def _identity_of(
        self,
        request: dt.EndpointRequest,
        labels: tuple[dt.Label, ...],
        owner: str,
        undo: list[Callable[[], Awaitable[None]]],
    ) -> int:
        """The new endpoint's identity: allocated for its labels, or its pod's (init while unknown)."""
        key = request.key
        if labels:
            identity = await self._node_ipam.call(
                f"allocate an identity for {key}", self._ipam.allocate_identity(labels, self.node, owner)
            )
            undo.append(lambda: self._ipam.release_identity(identity, self.node, owner))
            return identity
        try:
            return await self._node_ipam.resolve_pod(request.namespace, request.pod)
        except EndpointNotFound:
            if not request.init_identity:
                raise
            # The pod object is late (CNI ADD can come first): init until ipam publishes its identity.
            log.info("pod not known yet: endpoint starts with the init identity", pod=key)
            return dt.IDENTITY_INIT

    async def _pod_network(self, request: dt.EndpointRequest, netns: str) -> PodLink | PodPlug:
        """Namespace and veth of a new endpoint, unrouted (or, chained, the veth another plugin made)."""
        key = request.key
        try:
            if request.adopt_host_ifname:
                return await asyncio.to_thread(
                    self._net.adopt, netns=netns, host_ifname=request.adopt_host_ifname, ips=request.ips
                )
            await self._teardown_done(host_ifname(request.namespace, request.pod))
            return await asyncio.to_thread(
                self._net.plug,
                netns=netns or netns_mod.netns_path(netns_name(request.namespace, request.pod)),
                create=not netns,
                host_ifname=host_ifname(request.namespace, request.pod),
                pod_ifname=request.ifname or netns_mod.POD_IFNAME,
            )
        except FileNotFoundError as exc:
            raise PreconditionFailed(f"cannot set up the network of {key}: {exc.strerror or exc}") from None
        except FileExistsError as exc:
            field = "netns" if netns else "pod"
            raise PreconditionFailed(f"{field}: cannot set up the network of {key}: {exc.strerror or exc}") from None
        except (OSError, ValueError) as exc:
            raise DatapathFailure(f"cannot set up the network of {key}: {exc}") from exc

    async def _reserve(self, key: str, netns: str) -> int:
        if key in self._busy_pods or any(ep.record.key == key for ep in self.endpoints.values()):
            raise EndpointExists(f"pod {key} already has an endpoint on node {self.node}; delete it first")
        holder = next((ep for ep in self.endpoints.values() if netns and ep.record.netns == netns), None)
        if holder is not None:
            raise EndpointExists(
                f"netns: network namespace {netns} already holds endpoint {holder.id} ({holder.record.key}); "
                "delete that endpoint first or give the pod its own namespace"
            )
        used = set(self.endpoints) | self._busy_ids
        most = self._dp.max_endpoint_id
        for ep_id in range(1, most + 1):
            if ep_id not in used:
                self._busy_ids.add(ep_id)
                self._busy_pods.add(key)
                return ep_id
        raise EndpointError(
            f"node {self.node} has {most} endpoints, the most its metrics map counts; delete one first",
            Code.RESOURCE_EXHAUSTED,
        )

    async def _unreserve(self, ep_id: int, key: str) -> None:
        self._busy_ids.discard(ep_id)
        self._busy_pods.discard(key)

    async def _fetch_policy(self, identity: int) -> IdentityPolicy | None:
        """The identity's policy from PolicyService unless orders keep it here already.

        Endpoints of one identity created together (a rollout's burst) share one fetch: its answer
        stays shared until the owning task has learnt it (:meth:`_learnt`), so none of them asks again
        in between; a failed fetch is forgotten at once, for the next endpoint to try again.
        """
        if self.realizer.knows(identity):
            return None
        pending = self._fetches.get(identity)
        if pending is None:
            pending = asyncio.create_task(self._fetch_policy_once(identity), name=f"policy of identity {identity}")
            self._fetches[identity] = pending
            pending.add_done_callback(lambda done: self._forget_failed_fetch(identity, done))
        return await asyncio.shield(pending)

    def _forget_failed_fetch(self, identity: int, done: asyncio.Task[IdentityPolicy | None]) -> None:
        if self._fetches.get(identity) is done and (done.cancelled() or done.exception() or done.result() is None):
            del self._fetches[identity]

    def _learnt(self, fetched: IdentityPolicy | None) -> None:
        """Take a fetched policy (in the owning task); later endpoints of its identity need no fetch."""
        if fetched is None:
            return
        self.realizer.learn(fetched)
        pending = self._fetches.get(fetched.identity)
        if pending is not None and pending.done():
            del self._fetches[fetched.identity]

    async def _fetch_policy_once(self, identity: int) -> IdentityPolicy | None:
        try:
            state = await self._policy.resync(self.node, [identity])
        except Exception as exc:
            # Not fatal: the endpoint waits, and the order that brings its identity fills it in.
            log.warning("policy of new identity not fetched", identity=identity, error=str(exc))
            return None
        for policy in state.policies:
            if policy.identity == identity:
                return IdentityPolicy.of(policy, state.sequence, state.revision)
        return IdentityPolicy.empty(identity, state.sequence, state.revision)

    async def _first_policy(self, record: EndpointRecord, fetched: IdentityPolicy | None) -> Endpoint:
        """Write the identity's policy into the new endpoint's map (keyed by id; nothing attached yet).

        The endpoint is not in the table yet: orders applied until :meth:`_commit` do not reach it,
        and :meth:`_commit` writes what they changed.
        """
        self._learnt(fetched)
        ep = Endpoint(record)
        await self.realizer.realize(ep, full=True)
        return ep

    async def _detach_id(self, ep_id: int) -> None:
        """Programs and policy of an endpoint whose creation failed (whatever of them was written)."""
        await asyncio.to_thread(self._dp.detach_endpoint, ep_id)

    async def _commit(
        self, ep: Endpoint, fetched: IdentityPolicy | None, watch: Stopwatch, record: EndpointRecord
    ) -> None:
        watch.lap("queue")
        ep.record = record  # with IPAM's answer for the addresses reserved meanwhile (chained)
        self._busy_ids.discard(record.id)
        self._busy_pods.discard(record.key)
        # Again: the identity's kept policy may have been dropped meanwhile (its last endpoint deleted).
        self._learnt(fetched)
        self._enter(ep)
        await self.realizer.realize(ep, full=False)
        # Reported at once: orders applied before it existed did not report it, and the next one
        # may be long in coming (bumps are held back), while PolicyService waits for its first policy.
        self.realizer.report([ep])
        watch.lap("commit")

    # --- delete --------------------------------------------------------------------------------

    async def delete(self, ref: EndpointRef) -> None:
        watch = Stopwatch()
        record = await self._do(lambda: self._remove(ref))
        watch.lap("remove")
        # Outside the owning task (its id stays reserved until the end, so no new endpoint takes it).
        if record.link_owned and record.container_id:
            # A runtime's DEL of a veth of our own: the endpoint leaves the maps and the ipcache now,
            # and its veth (with its routes and program links) is deleted after the answer. Deleting
            # a veth costs the kernel ~20-40 ms of grace periods, and the runtime removes the
            # sandbox's namespace next anyway. Its state is kept aside until then, so a restart
            # finishes the teardown; an ADD for the same pod waits for it (the same veth name).
            await self._detach(record, veth_going=True)
            watch.lap("detach")
            try:
                going: Path | None = await asyncio.to_thread(self._store.mark_going, record.id)
            except FileNotFoundError:
                going = None  # no state was written: nothing to finish after a restart
            self._teardown_later(record, going)
            watch.lap("store")
        else:
            # A veth of our own goes first: its program links go with it, where detaching them while
            # it is there costs the kernel an RCU grace period per hook (~13 ms each with tcx); its
            # maps keep enforcing until then. Another plugin's veth stays: the programs come off first.
            if record.link_owned:
                await self._teardown(record)
                watch.lap("network")
            await self._detach(record, veth_going=not record.link_owned)
            watch.lap("detach")
            if not record.link_owned:
                await self._teardown(record)
                watch.lap("network")
            await asyncio.to_thread(self._store.remove, record.id)
        await self._do(lambda: self._unreserve(record.id, record.key))
        watch.lap("store")
        # Every address and the identity reference at once: one IPAM round trip, not one each.
        errors: list[str] = []

        async def release(what: str, give_back: Callable[[], Awaitable[None]]) -> None:
            try:
                await give_back()
            except UpstreamError as exc:
                if exc.code is not Code.NOT_FOUND:
                    errors.append(f"{what}: {exc}")
                    self._releases.put_nowait(give_back)

        releases = [
            release(f"address {ip}", functools.partial(self._ipam.release_ip, self.node, ip, record.owner))
            for ip in record.ips
        ]
        if record.identity_owned:
            releases.append(
                release(
                    f"identity {record.identity}",
                    functools.partial(self._ipam.release_identity, record.identity, self.node, record.owner),
                )
            )
        await asyncio.gather(*releases)
        watch.lap("release")
        log.info("endpoint deleted", endpoint=record.id, pod=record.key, **watch.fields())
        if errors:
            raise UpstreamUnavailable(
                f"endpoint {record.id} ({record.key}) is deleted, but IPAM did not take back "
                + "; ".join(errors)
                + "; the datapath keeps retrying in the background"
            )

    async def _remove(self, ref: EndpointRef) -> EndpointRecord:
        """Take the endpoint out of the table (no order or resync reaches it after this); its id stays busy."""
        ep = self.find(ref)
        self._busy_ids.add(ep.id)
        self._busy_pods.add(ep.record.key)
        self._leave(ep)
        self._reporter.deleted(ep.id, ep.identity, ep.record.key)
        self.realizer.drop_orphans()
        return ep.record

    async def _detach(self, record: EndpointRecord, *, veth_going: bool = False) -> None:
        """Programs, maps and ipcache entries of a removed endpoint.

        Another plugin's veth keeps its programs until it goes (it deletes it after this DEL, and
        they pass every packet once the endpoint is out of the maps); :meth:`sweep` unpins them.
        """
        await asyncio.to_thread(functools.partial(self._dp.detach_endpoint, record.id, veth_going=veth_going))
        for ip in record.ips:
            try:
                await asyncio.to_thread(self._dp.ipcache_delete, host_prefix(ip))
            except (KeyError, OSError):
                pass

    async def _teardown(self, record: EndpointRecord) -> None:
        try:
            await asyncio.to_thread(self._net.teardown, link_of(record))
        except Exception as exc:
            log.warning("network teardown failed", pod=record.key, error=str(exc))

    def _teardown_later(self, record: EndpointRecord, going: Path | None) -> None:
        """Delete a deleted endpoint's network off the caller's path (see :meth:`delete`)."""
        name = record.host_ifname

        async def run() -> None:
            try:
                await self._teardown(record)
                # Its links are defunct now (the veth is gone): unpinned, nothing waited for.
                await asyncio.to_thread(self._dp.reap_links, self._going_ifindexes(but=name))
                if going is not None:
                    await asyncio.to_thread(self._store.forget, going)
            finally:
                if self._teardowns.get(name, (None, None))[1] is task:
                    del self._teardowns[name]

        task = asyncio.create_task(run(), name=f"teardown of {record.key}")
        self._teardowns[name] = (record, task)

    def _going_ifindexes(self, but: str = "") -> list[int]:
        """The veths being deleted (their links go with them: never detached while they do)."""
        return [r.host_ifindex for name, (r, _task) in self._teardowns.items() if name != but]

    async def _teardown_done(self, host_ifname: str) -> None:
        """Wait until a deleted endpoint's veth of this name is gone (a new pod takes the name)."""
        pending = self._teardowns.get(host_ifname)
        if pending is not None:
            await asyncio.shield(pending[1])

    async def settled(self) -> None:
        """Wait until the networks of every deleted endpoint are torn down."""
        while self._teardowns:
            await asyncio.gather(*[asyncio.shield(t) for _record, t in list(self._teardowns.values())])

    # --- identity changes --------------------------------------------------------------------------

    async def relabel(self, ref: EndpointRef, labels: Sequence[dt.Label]) -> Endpoint:
        """Give a pod new labels: allocate their identity, then switch the endpoint to it."""
        if not labels:
            raise InvalidRequest("labels: give the pod's new labels; an endpoint without labels has no identity")
        validate_labels(labels)
        ep = self.find(ref)
        record = ep.record
        new_labels = identity_labels(record.namespace, labels)
        identity = await self._node_ipam.call(
            f"allocate an identity for {record.key}", self._ipam.allocate_identity(new_labels, self.node, record.owner)
        )
        return await self.switch_identity(record.id, identity, labels=new_labels)

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
        self, ep_id: int, identity: int, *, labels: tuple[dt.Label, ...] | None = None
    ) -> Endpoint:
        """Move an endpoint to ``identity`` (see :meth:`Realizer.switch_identity`), fetching its policy first."""
        fetched = await self._fetch_policy(identity)
        return await self._do(lambda: self._switch(ep_id, identity, fetched, labels))

    async def _switch(
        self,
        ep_id: int,
        identity: int,
        fetched: IdentityPolicy | None,
        labels: tuple[dt.Label, ...] | None,
    ) -> Endpoint:
        ep = self.endpoints.get(ep_id)
        if ep is None:
            raise EndpointNotFound(f"endpoint {ep_id} was deleted while its identity changed")
        self._learnt(fetched)
        old = ep.identity
        record = dataclasses.replace(
            ep.record,
            identity=identity,
            labels=ep.record.labels if labels is None else labels,
            identity_owned=ep.record.identity_owned or labels is not None,
        )
        if record == ep.record:
            return ep
        ep.record = record
        await self.realizer.switch_identity(ep)
        await asyncio.to_thread(self._store.save, record)
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
        pinned = {p.id for p in await asyncio.to_thread(self._dp.pinned_endpoints)}
        restored: list[EndpointRecord] = []
        for record in records:
            if not await asyncio.to_thread(self._net.alive, link_of(record)):
                log.info("stale endpoint removed: its namespace is gone", endpoint=record.id, pod=record.key)
                await self._do(lambda r=record: self._drop_stale(r))  # type: ignore[misc]
                continue
            try:
                await self._do(lambda r=record: self._readopt(r))  # type: ignore[misc]
            except Exception as exc:
                log.error("endpoint restore failed", endpoint=record.id, pod=record.key, error=str(exc))
                continue
            restored.append(record)
        for path, record in await asyncio.to_thread(self._store.going):
            # Deleted (DEL answered) but its veth not yet removed when the datapath stopped.
            log.info("teardown of a deleted endpoint finished", endpoint=record.id, pod=record.key)
            await self._teardown(record)
            await asyncio.to_thread(self._store.forget, path)
        known = {r.id for r in records}
        for ep_id in sorted(pinned - known):
            log.info("pinned endpoint without state detached", endpoint=ep_id)
            await asyncio.to_thread(self._dp.detach_endpoint, ep_id)
        # Links a chained DEL left before the restart, whose veth may be gone by now.
        await asyncio.to_thread(self._dp.reap_links)
        # Every endpoint now runs this version's programs: conntrack entries the version before
        # wrote in a layout this one no longer reads are copied, and released there.
        await asyncio.to_thread(self._dp.migrate_conntrack, True)
        log.info("endpoints restored", restored=len(restored), stale=len(records) - len(restored))
        return restored

    async def _readopt(self, record: EndpointRecord) -> None:
        await asyncio.to_thread(self._dp.attach_endpoint, spec_of(record))
        for ip in record.ips:
            await asyncio.to_thread(self._dp.ipcache_upsert, host_prefix(ip), record.identity)
        self._enter(Endpoint(record, state=dt.EndpointState.RESTORING))

    async def _drop_stale(self, record: EndpointRecord) -> None:
        await asyncio.to_thread(self._dp.detach_endpoint, record.id)
        for ip in record.ips:
            try:
                await asyncio.to_thread(self._dp.ipcache_delete, host_prefix(ip))
            except (KeyError, OSError):
                pass
        try:
            await asyncio.to_thread(self._net.teardown, link_of(record))
        except Exception as exc:
            log.warning("stale endpoint teardown failed", endpoint=record.id, error=str(exc))
        await asyncio.to_thread(self._store.remove, record.id)
        # PolicyService may know it from before the restart (its pod is not in the ipcache).
        self._reporter.deleted(record.id, record.identity, record.key)
        for ip in record.ips:
            self._releases.put_nowait(lambda ip=ip: self._node_ipam.release_ip_quietly(ip, record.owner))  # type: ignore[misc]
        if record.identity_owned:
            self._releases.put_nowait(lambda: self._node_ipam.release_identity_quietly(record.identity, record.owner))

    async def reclaim(self, records: Sequence[EndpointRecord]) -> None:
        """Reserve each restored endpoint's exact addresses and re-take its identity, retrying until IPAM answers."""
        for record in records:

            async def attempt(record: EndpointRecord = record) -> None:
                try:
                    await self._reclaim_one(record)
                except EndpointError as exc:  # IPAM answered: retrying cannot help
                    error = str(exc)
                    await self._do(lambda: self._fail(record.id, error))

            await retry("reclaim endpoint", attempt, maximum=self._backoff_max, fields={"endpoint": record.id})

    async def _reclaim_one(self, record: EndpointRecord) -> None:
        for address in record.addresses:
            try:
                await self._ipam.allocate_ip(self.node, record.owner, address.family, address.ip, record.ports)
            except UpstreamError as exc:
                if exc.code is Code.ALREADY_EXISTS:
                    continue  # still ours: the allocation outlived the restart
                if exc.code in (Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT):
                    raise EndpointError(
                        f"address {address.ip} of {record.key} could not be reserved again ({exc.message}); "
                        "delete and recreate the endpoint"
                    ) from None
                raise
        if record.identity_owned:
            identity = await self._ipam.allocate_identity(record.labels, self.node, record.owner)
        else:
            try:
                identity = await self._ipam.resolve_pod(record.namespace, record.pod)
            except UpstreamError as exc:
                if exc.code is not Code.NOT_FOUND:
                    raise
                identity = record.identity
        if identity != record.identity:
            await self.switch_identity(record.id, identity)
        log.debug("endpoint reclaimed", endpoint=record.id, pod=record.key)

    async def _fail(self, ep_id: int, error: str) -> None:
        ep = self.endpoints.get(ep_id)
        if ep is not None:
            ep.state = dt.EndpointState.FAILED
            ep.error = error
            log.error("endpoint failed", endpoint=ep_id, error=error)
