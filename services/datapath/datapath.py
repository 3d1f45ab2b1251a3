"""The datapath facade: endpoints, policy, ipcache and flows over pinned BPF maps.

A synchronous library; the datapath service calls it through ``asyncio.to_thread``.
Every method takes one lock, so calls from several threads are serialized
(``read_flows`` has its own lock so a blocking read never holds up writers).

State lives in the kernel, pinned under ``base_dir``: :meth:`Datapath.close`
leaves programs attached and maps pinned (enforcement continues while the agent
is down); :meth:`Datapath.open` in a new process finds them again and
:meth:`Datapath.pinned_endpoints` says what survived. :meth:`Datapath.teardown`
removes everything.

The facade holds no policy of its own: the realizer above it owns what each
endpoint's map should hold and hands down either a delta (:meth:`Datapath.apply_policy`,
which encodes and writes only the entries that change) or the whole policy
(:meth:`Datapath.sync_policy`, which diffs against the kernel's map: resync and repair).

Policy writes never open a window that denies traffic both the old and the
new policy allow: new and changed prefixes are written first, then the
enforcement flags, then stale prefixes are removed, and finally the policy
epoch is bumped so conntrack re-checks established flows against the result
(flows the new policy denies stop; the others continue).

Relabel protocol (an endpoint E moves from identity A to B):

1. ``sync_policy(E, ...)`` with B's policy. E's entries are keyed by endpoint
   id, not identity, so this is an in-place diff: entries in both policies
   stay throughout.
2. Peers whose policy must admit B get their new entries (adds) first.
3. ``set_identity(E, B)``: one map write per key of E, then an epoch bump.
4. Peers drop entries that only existed for A.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from services.common.log import get_logger
from services.datapath import maps as bpf_maps
from services.datapath import netns
from services.datapath.loadbalancer import LoadBalancer
from services.datapath.loader import LINKS_DIR, PROGRAMS_DIR, Loader, ProgramConfig, Template, default_attach
from services.datapath.maps import (
    ct4map,
    ctmap,
    deliverymap,
    dnsmap,
    endpointmap,
    enforcementmap,
    eventsmap,
    ipcachemap,
    lbaffinitymap,
    lbbackendmap,
    lbctmap,
    lbportmap,
    lbrevnatmap,
    lbservicemap,
    metricsmap,
    policymap,
    snatmap,
    statemap,
)
from services.datapath.maps.bpf import MapLayoutError, PinnedMap, ensure_bpffs, unpin
from services.datapath.maps.ctmap import CtEntry, CtMap
from services.datapath.maps.deliverymap import DeliveryMap, DeliveryTarget
from services.datapath.maps.dnsmap import DnsSteerMap
from services.datapath.maps.endpointmap import EndpointEntry, EndpointMap
from services.datapath.maps.enforcementmap import EnforcementMap
from services.datapath.maps.eventsmap import EventReader
from services.datapath.maps.ipcachemap import IPCacheMap
from services.datapath.maps.lbaffinitymap import LbAffinityMap
from services.datapath.maps.lbbackendmap import LbBackendMap
from services.datapath.maps.lbctmap import LbCtEntry, LbCtMap
from services.datapath.maps.lbportmap import LbPortMap
from services.datapath.maps.lbrevnatmap import LbRevNatMap
from services.datapath.maps.lbservicemap import LbServiceMap
from services.datapath.maps.metricsmap import MetricsMap
from services.datapath.maps.policymap import PolicyMap, Prefix, PrefixMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.maps.snatmap import SnatEntry, SnatMap
from services.datapath.maps.statemap import StateMap
from services.datapath.policywriter import WriterLock, hints_of, write_policy
from services.datapath.types import (
    IDENTITY_WORLD,
    MAX_IDENTITY,
    Counters,
    EndpointSpec,
    Enforcement,
    FlowEvent,
    Frontend,
    LbService,
    LbState,
    PinnedEndpoint,
    PolicyChange,
    PolicyEntry,
    is_local_identity,
)

log = get_logger("datapath")

DEFAULT_BASE_DIR = "/sys/fs/bpf/palisade"


class UnknownEndpoint(KeyError):
    """No endpoint with this id is attached."""


class CounterSource(Protocol):
    """The packet counters part of the facade (safe from any thread)."""

    def counters(self, endpoints: Iterable[int] | None = None) -> Counters: ...


@runtime_checkable
class DatapathAPI(Protocol):
    """What the datapath service needs; :class:`Datapath` and ``fake.FakeDatapath`` implement it."""

    #: The highest endpoint id the maps hold (``metricsmap.max_endpoint_id`` of the map sizes).
    max_endpoint_id: int

    def attach_endpoint(self, spec: EndpointSpec) -> None: ...
    def detach_endpoint(self, ep_id: int, *, veth_going: bool = False) -> bool: ...
    def reap_links(self, keep: Iterable[int] = ()) -> int: ...
    def set_identity(self, ep_id: int, identity: int) -> None: ...
    def apply_policy(
        self,
        ep_id: int,
        enforcement: Enforcement,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange: ...
    def sync_policy(self, ep_id: int, enforcement: Enforcement, entries: Iterable[PolicyEntry]) -> PolicyChange: ...
    def dump_policy(self, ep_id: int) -> tuple[Enforcement, list[PolicyEntry]]: ...
    def ipcache_upsert(self, prefix: str, identity: int) -> None: ...
    def ipcache_delete(self, prefix: str) -> bool: ...
    def ipcache_lookup(self, ip: str) -> int | None: ...
    def ipcache_dump(self) -> dict[str, int]: ...
    def dns_steer_set(self, ep_id: int, port: int, protocol: int, proxy_port: int) -> None: ...
    def dns_steer_delete(self, ep_id: int, port: int, protocol: int) -> bool: ...
    def dns_steer_dump(self) -> dict[tuple[int, int, int], int]: ...
    def lb_upsert(self, service: LbService) -> LbState: ...
    def lb_delete(self, frontend: Frontend) -> bool: ...
    def lb_services(self) -> list[LbState]: ...
    def counters(self, endpoints: Iterable[int] | None = None) -> Counters: ...
    def read_flows(self, timeout_ms: int = 0) -> list[FlowEvent]: ...
    def skip_flows(self, timeout_ms: int = 0) -> int: ...
    def take_flows(self, timeout_ms: int, limit: int) -> tuple[list[FlowEvent], int]: ...
    def pinned_endpoints(self) -> list[PinnedEndpoint]: ...
    def migrate_conntrack(self, release: bool = True) -> int: ...
    def close(self) -> None: ...
    def teardown(self) -> None: ...


def check_identity(identity: int) -> None:
    if not 0 < identity <= MAX_IDENTITY:
        raise ValueError(f"identity {identity} out of range")


def check_endpoint_id(ep_id: int, sizes: MapSizes) -> None:
    """Refuse an endpoint id past the metrics map's slots (its packets would go uncounted)."""
    most = metricsmap.max_endpoint_id(sizes)
    if ep_id > most:
        raise ValueError(
            f"endpoint id {ep_id} is past {most}, the highest the metrics map counts "
            f"({sizes.metrics} slots, {metricsmap.SLOTS} an endpoint); give an id in 1..{most} or a larger "
            "MapSizes.metrics"
        )


#: Maps holding nothing that must survive an upgrade which changes their layout: recreated
#: instead of refusing to open (every other map keeps state a restart must find).
_RECREATED_ON_LAYOUT_CHANGE = frozenset({metricsmap.NAME})


def _read_legacy_lb_ct(path: str) -> lbctmap.Legacy | None:
    """The entries of an lb_conntrack pinned with the layout before backend addresses, if it has it."""
    pinned = PinnedMap.open_any(os.path.dirname(path), os.path.basename(path))
    try:
        return lbctmap.read_legacy(pinned)
    finally:
        pinned.close()


class Datapath:
    """The real datapath: pinned maps plus the shared program template. Use :meth:`open`."""

    def __init__(self, base_dir: str, config: ProgramConfig, maps: dict[str, PinnedMap], loader: Loader) -> None:
        self.base_dir = base_dir
        self.config = config
        self.max_endpoint_id = metricsmap.max_endpoint_id(config.sizes)
        self._maps = maps
        self._loader = loader
        # First, so a failed compile leaves nothing half-built behind.
        self.template: Template = loader.template(config)
        self.ipcache = IPCacheMap(maps[ipcachemap.NAME])
        self.endpoint_map = EndpointMap(maps[endpointmap.NAME])
        self.delivery = DeliveryMap(maps[deliverymap.NAME])
        self.policy = PolicyMap(maps[policymap.NAME])
        self.enforcement = EnforcementMap(maps[enforcementmap.NAME])
        self.state = StateMap(maps[statemap.NAME])
        self.conntrack_map = CtMap(maps[ct4map.NAME], maps[ctmap.NAME])
        self.metrics = MetricsMap(maps[metricsmap.NAME])
        self._events = EventReader(maps[eventsmap.NAME])
        self.lb = LoadBalancer(
            LbServiceMap(maps[lbservicemap.NAME]),
            LbBackendMap(maps[lbbackendmap.NAME]),
            LbRevNatMap(maps[lbrevnatmap.NAME]),
            LbAffinityMap(maps[lbaffinitymap.NAME]),
            LbPortMap(maps[lbportmap.NAME]),
        )
        self.lb_conntrack_map = LbCtMap(maps[lbctmap.NAME])
        self.snat_map = SnatMap(maps[snatmap.NAME])
        self.dns_steering = DnsSteerMap(maps[dnsmap.NAME])
        self._lock = WriterLock(base_dir)
        self._events_lock = threading.Lock()
        self._closed = False
        # The endpoints the kernel holds, as written to endpoint_map (policy is not cached: the realizer owns it).
        self._endpoints: dict[int, EndpointEntry] = {r.id: r for r in self.endpoint_map.records()}
        self._sync_hints()
        self.migrate_conntrack(release=False)

    def _sync_hints(self) -> None:
        """Make every endpoint's hints exact, from one walk of the policy trie: an agent before hints
        left none, and one that stopped mid-change may have left them wider than needed."""
        held = self.policy.read()
        raw = self.enforcement.raw()
        for ep_id in held.keys() | raw.keys():
            bits = hints_of(held.get(ep_id, {}))
            flags = raw.get(ep_id)
            if flags is None or flags & ~enforcementmap.ENFORCE_MASK != bits | enforcementmap.HINTS_VALID:
                self.enforcement.set(ep_id, enforcementmap.from_flags(flags or 0), bits)

    @classmethod
    def open(
        cls, base_dir: str = DEFAULT_BASE_DIR, *, config: ProgramConfig | None = None, attach: str = ""
    ) -> Datapath:
        """Mount bpffs if needed, open or create the pinned maps, reuse or compile the programs.

        ``attach`` chooses how programs go on the veths: "tcx", "tc", or "auto" (see loader); empty,
        the configuration's default (:func:`default_attach`)."""
        config = config or ProgramConfig()
        attach = attach or default_attach(config)
        base_dir = os.path.abspath(base_dir)
        ensure_bpffs(base_dir)
        specs = [module.spec(config.sizes) for module in bpf_maps.ALL]
        maps: dict[str, PinnedMap] = {}
        created = False
        legacy_lb_ct: lbctmap.Legacy | None = None
        loader = Loader(base_dir, attach)
        try:
            for spec in specs:
                path = os.path.join(base_dir, spec.name)
                created |= not os.path.exists(path)
                try:
                    maps[spec.name] = PinnedMap.open_or_create(base_dir, spec)
                except MapLayoutError as exc:
                    if spec.name == lbctmap.NAME and (legacy_lb_ct := _read_legacy_lb_ct(path)) is not None:
                        log.warning("map replaced: its layout changed (entries carried over)", map=spec.name)
                        unpin(path)
                        created = True
                        maps[spec.name] = PinnedMap.open_or_create(base_dir, spec)
                        continue
                    if spec.name not in _RECREATED_ON_LAYOUT_CHANGE:
                        raise
                    log.warning(
                        "map recreated: its layout changed (counters restart from zero)", map=spec.name, error=str(exc)
                    )
                    unpin(path)
                    created = True
                    maps[spec.name] = PinnedMap.open_or_create(base_dir, spec)
            if created:
                # Pinned programs refer to the maps they were loaded with; new maps need new programs.
                loader.prune(keep=set())
            datapath = cls(base_dir, config, maps, loader)
            if legacy_lb_ct is not None:
                adopted = datapath.lb_conntrack_map.adopt(
                    legacy_lb_ct, datapath.lb.backends_by_id(), datapath.lb.revisions_by_service()
                )
                log.info("service connections carried over", map=lbctmap.NAME, entries=adopted)
        except BaseException:
            for m in maps.values():
                m.close()
            loader.close()
            raise
        loader.prune(keep={datapath.template.hash})
        log.info(
            "datapath opened",
            base_dir=base_dir,
            template=datapath.template.short,
            template_origin=datapath.template.origin,
            endpoints=len(datapath._endpoints),
        )
        return datapath

    # -- endpoints -----------------------------------------------------------

    def attach_endpoint(self, spec: EndpointSpec) -> None:
        """Register the endpoint in the maps, then attach (or re-attach) both programs to its veth.

        The kernel's attach runs outside the writer lock: a tcx link waits an RCU grace period
        per hook (~13 ms each), and policy, ipcache and DNS proxy writes of other endpoints need
        not wait for it. The endpoint's policy may be written before (it is keyed by id).
        """
        with self._lock:
            self._check_open()
            check_endpoint_id(spec.id, self.config.sizes)
            for other in self._endpoints.values():
                if other.ifindex == spec.ifindex and other.id != spec.id:
                    raise ValueError(f"ifindex {spec.ifindex} already belongs to endpoint {other.id}")
            record = EndpointEntry(spec.id, spec.ifindex, spec.identity, spec.ips)
            old = self._endpoints.get(spec.id)
            moved_from = 0
            if old is not None and (old.ifindex != record.ifindex or set(old.ips) - set(record.ips)):
                self._forget_delivery(old)
                self.endpoint_map.remove(old)
                if old.ifindex != record.ifindex:
                    moved_from = old.ifindex
            self.endpoint_map.write(record)
            self._endpoints[spec.id] = record
            template = self.template
        try:
            if moved_from:
                self._loader.detach(moved_from)
            self._loader.attach(template, spec.ifindex)
        except BaseException:
            with self._lock:
                # Leave no record claiming an endpoint whose programs never ran (and no program's
                # endpoint cache holding it: the epoch moves on every endpoint write).
                if self._endpoints.get(spec.id) is record:
                    self._forget_delivery(record)
                    self.endpoint_map.remove(record)
                    del self._endpoints[spec.id]
                    self.state.bump_epoch()
            raise
        with self._lock:
            if self._endpoints.get(spec.id) is not record:
                # Detached meanwhile: programs no record claims do not stay on the veth.
                if all(other.ifindex != spec.ifindex for other in self._endpoints.values()):
                    self._loader.detach(spec.ifindex)
                return
            # Only now: other endpoints' programs deliver straight to this one once it runs these.
            self._offer_delivery(record, spec.host_mac, spec.pod_mac)
            self.state.bump_epoch()
        log.info("endpoint attached", endpoint=spec.id, ifindex=spec.ifindex, identity=spec.identity)

    def _offer_delivery(self, record: EndpointEntry, host_mac: str = "", pod_mac: str = "") -> None:
        """Let other endpoints deliver to ``record``'s addresses directly: each one whose pod
        Ethernet address is known (given: Palisade chose both of its own veth's; else the neighbour
        entry on the veth, which another plugin's may not have yet). An address without goes
        through the host."""
        if not self.config.local_delivery:
            return
        given = bool(host_mac and pod_mac)
        if not given:
            host_mac = netns.link_mac(record.ifindex) or ""
        for ip in record.ips:
            if not given:
                pod_mac = (netns.neighbour_mac(record.ifindex, ip) or "") if host_mac else ""
            if host_mac and pod_mac:
                self.delivery.write(DeliveryTarget(ip, record.ifindex, pod_mac, host_mac))
            else:
                self.delivery.remove(ip, record.ifindex)
                log.info("pod reached through the host: its Ethernet address is unknown", ip=ip, ifindex=record.ifindex)

    def _forget_delivery(self, record: EndpointEntry) -> None:
        for ip in record.ips:
            self.delivery.remove(ip, record.ifindex)

    def detach_endpoint(self, ep_id: int, *, veth_going: bool = False) -> bool:
        """Detach the programs and forget the endpoint and its policy; False if it was unknown.

        The policy of an id never attached (written before its attach, which failed) goes too.
        ``veth_going``: another plugin deletes the veth next (a chained DEL). Its tcx links then
        stay until it goes, passing every packet (no endpoint is theirs any more), and
        :meth:`reap_links` unpins them: detaching a tcx link of a live veth waits a grace period.
        """
        with self._lock:
            self._check_open()
            record = self._endpoints.pop(ep_id, None)
            if record is None:
                self.policy.delete(self.policy.read(ep_id).get(ep_id, {}))
                self.enforcement.delete(ep_id)
                return False
            self._forget_delivery(record)
        # Outside the writer lock, as for the attach: detaching a tcx link of a live veth waits a
        # grace period. The endpoint's entry stays until its programs are off.
        if not (veth_going and self._loader.mechanism == "tcx"):
            self._loader.detach(record.ifindex)
        with self._lock:
            self.endpoint_map.remove(record)
            self.policy.delete(self.policy.read(ep_id).get(ep_id, {}))
            self.enforcement.delete(ep_id)
            self.metrics.delete_endpoint(ep_id)
            # Stale conntrack entries are harmless: the new epoch makes any hit re-check policy.
            self.state.bump_epoch()
            log.info("endpoint detached", endpoint=ep_id, ifindex=record.ifindex)
            return True

    def reap_links(self, keep: Iterable[int] = ()) -> int:
        """Unpin the program links of veths no endpoint holds (left by :meth:`detach_endpoint` with
        ``veth_going``): a gone veth's are only unpinned, a live one's detached. Returns how many veths.
        ``keep``: ifindexes of veths being deleted, whose links go with them (left for a later reap).

        Under the writer lock: an attach registers its endpoint before its programs go on, so a
        veth being attached is never reaped.
        """
        with self._lock:
            self._check_open()
            held = {r.ifindex for r in self._endpoints.values()} | set(keep)
            reaped = self._loader.release_links(keep=held)
        if reaped:
            log.info("program links of deleted endpoints released", veths=len(reaped))
        return len(reaped)

    def set_identity(self, ep_id: int, identity: int) -> None:
        """Relabel an endpoint (see the relabel protocol in the module docstring)."""
        check_identity(identity)
        with self._lock:
            self._check_open()
            record = self._endpoint(ep_id)
            if record.identity == identity:
                return
            record = dataclasses.replace(record, identity=identity)
            self.endpoint_map.write(record)
            self._endpoints[ep_id] = record
            self.state.bump_epoch()
            log.info("endpoint relabelled", endpoint=ep_id, identity=identity)

    def pinned_endpoints(self) -> list[PinnedEndpoint]:
        """Endpoints the pinned maps hold, with their enforcement and whether tc still runs them."""
        with self._lock:
            self._check_open()
            enforcement = self.enforcement.dump()
            out = []
            for record in self.endpoint_map.records():
                attachment = self._loader.attachment(record.ifindex)
                out.append(
                    PinnedEndpoint(
                        id=record.id,
                        ifindex=record.ifindex,
                        identity=record.identity,
                        ips=record.ips,
                        enforcement=enforcement.get(record.id, Enforcement()),
                        attached=attachment.complete,
                        template=attachment.template(),
                    )
                )
            return out

    def _endpoint(self, ep_id: int) -> EndpointEntry:
        record = self._endpoints.get(ep_id)
        if record is None:
            raise UnknownEndpoint(ep_id)
        return record

    # -- policy -------------------------------------------------------------

    def apply_policy(
        self,
        ep_id: int,
        enforcement: Enforcement,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange:
        """Incremental: write exactly this delta, encoding only the added and removed entries.

        ``keep`` are entries the map holds before and after that share a direction, remote
        identity, protocol and verdict with an added or removed one (see
        ``policymap.encode_delta``): a port block two entries share stays while either does.
        May be called before the endpoint is attached (policy is keyed by endpoint id).
        """
        writes, stale = policymap.encode_delta(ep_id, add, remove, keep)
        with self._lock:
            self._check_open()
            return self._write_policy(ep_id, enforcement, writes, stale)

    def apply_entries(
        self,
        ep_id: int,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange:
        """Like :meth:`apply_policy`, keeping the enforcement the map holds (the DNS proxy's writes:
        the realizer owns enforcement)."""
        writes, stale = policymap.encode_delta(ep_id, add, remove, keep)
        with self._lock:
            self._check_open()
            return self._write_policy(ep_id, self.enforcement.get(ep_id), writes, stale)

    def sync_policy(self, ep_id: int, enforcement: Enforcement, entries: Iterable[PolicyEntry]) -> PolicyChange:
        """Full: make the kernel map hold exactly ``entries``, diffing against what the kernel has.

        Entries whose remote identity is node-local (learned by the DNS proxy) are the proxy's:
        they stay, and count in the hints."""
        desired = policymap.encode(ep_id, policymap.normalize(entries))
        with self._lock:
            self._check_open()
            current = self.policy.read(ep_id).get(ep_id, {})
            learned = {p: v for p, v in current.items() if is_local_identity(p.identity)}
            current = {p: v for p, v in current.items() if p not in learned}
            writes, stale = policymap.diff(current, desired)
            hints = hints_of({**desired, **learned})
            return self._write_policy(ep_id, enforcement, writes, stale, exact_hints=hints)

    def _write_policy(
        self,
        ep_id: int,
        enforcement: Enforcement,
        writes: PrefixMap,
        stale: list[Prefix],
        exact_hints: int | None = None,
    ) -> PolicyChange:
        return write_policy(self.policy, self.enforcement, self.state, ep_id, enforcement, writes, stale, exact_hints)

    def dump_policy(self, ep_id: int) -> tuple[Enforcement, list[PolicyEntry]]:
        """Enforcement and entries as read back from the kernel maps (ranges re-assembled)."""
        with self._lock:
            self._check_open()
            prefixes = self.policy.read(ep_id).get(ep_id, {})
            return self.enforcement.get(ep_id), policymap.decode(prefixes)

    # -- ipcache ------------------------------------------------------------

    def ipcache_upsert(self, prefix: str, identity: int) -> None:
        check_identity(identity)
        with self._lock:
            self._check_open()
            self.ipcache.upsert(prefix, identity)
            self.state.bump_epoch()

    def ipcache_delete(self, prefix: str) -> bool:
        with self._lock:
            self._check_open()
            deleted = self.ipcache.delete(prefix)
            if deleted:
                self.state.bump_epoch()
            return deleted

    def ipcache_lookup(self, ip: str) -> int | None:
        """The identity the program gives ``ip`` (longest prefix), or None when no prefix holds it."""
        with self._lock:
            self._check_open()
            return self.ipcache.lookup(ip)

    def ipcache_dump(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            return self.ipcache.dump()

    # -- services -----------------------------------------------------------

    def lb_upsert(self, service: LbService) -> LbState:
        """Serve ``service``'s frontend with its backends (ids of kept backends are kept)."""
        with self._lock:
            self._check_open()
            return self.lb.upsert(service)

    def lb_delete(self, frontend: Frontend) -> bool:
        with self._lock:
            self._check_open()
            return self.lb.delete(frontend)

    def lb_services(self) -> list[LbState]:
        """Every frontend the maps serve (after a restart: what the previous run left)."""
        with self._lock:
            self._check_open()
            return sorted(self.lb.state.values(), key=lambda s: s.frontend)

    def lb_conntrack(self) -> list[LbCtEntry]:
        with self._lock:
            self._check_open()
            return self.lb_conntrack_map.entries()

    # -- observation --------------------------------------------------------

    def counters(self, endpoints: Iterable[int] | None = None) -> Counters:
        """The counters of ``endpoints`` (default: every endpoint held; each costs a few dozen map reads)."""
        with self._lock:
            self._check_open()
            held = self._endpoints.keys()
            return self.metrics.read(held if endpoints is None else [e for e in endpoints if e in held])

    def read_flows(self, timeout_ms: int = 0) -> list[FlowEvent]:
        """Drain flow events, waiting up to ``timeout_ms`` when none is pending."""
        with self._events_lock:
            self._check_open()
            return self._events.read(timeout_ms)

    def take_flows(self, timeout_ms: int, limit: int) -> tuple[list[FlowEvent], int]:
        """Like :meth:`read_flows`, decoding at most ``limit`` events (0: all) and counting the rest."""
        with self._events_lock:
            self._check_open()
            return self._events.take(timeout_ms, limit)

    def skip_flows(self, timeout_ms: int = 0) -> int:
        """Like :meth:`read_flows` for a reader nobody listens to: consume without decoding, return the count."""
        with self._events_lock:
            self._check_open()
            return self._events.skip(timeout_ms)

    def conntrack(self, ep_id: int | None = None) -> list[CtEntry]:
        with self._lock:
            self._check_open()
            return self.conntrack_map.entries(ep_id)

    def open_destinations(self) -> set[str]:
        """Remote addresses of live conntrack entries (a learned address stays while one is open)."""
        now = time.monotonic_ns()
        with self._lock:
            self._check_open()
            return {e.destination_ip for e in self.conntrack_map.entries() if e.expires_ns >= now}

    # -- DNS steering (the DNS proxy's) ------------------------------------

    def dns_steer_set(self, ep_id: int, port: int, protocol: int, proxy_port: int) -> None:
        with self._lock:
            self._check_open()
            self.dns_steering.set(ep_id, port, protocol, proxy_port)

    def dns_steer_delete(self, ep_id: int, port: int, protocol: int) -> bool:
        with self._lock:
            self._check_open()
            return self.dns_steering.delete(ep_id, port, protocol)

    def dns_steer_dump(self) -> dict[tuple[int, int, int], int]:
        with self._lock:
            self._check_open()
            return self.dns_steering.dump()

    def migrate_conntrack(self, release: bool = True) -> int:
        """Copy the IPv4 conntrack entries an older program kept in the IPv6 map to the IPv4 map
        (see ``ctmap``); ``release`` also removes them there. Open copies without releasing: the
        older programs still attached read them there until each endpoint is attached again. Once
        every endpoint runs this version's programs, a releasing pass copies what they wrote
        meanwhile and removes the rest."""
        with self._lock:
            self._check_open()
            copied = self.conntrack_map.migrate(release)
        if copied:
            log.info("conntrack entries copied to the IPv4 map", entries=copied, released=release)
        return copied

    def flush_conntrack(self, ep_id: int | None = None) -> int:
        """Forget tracked flows (of one endpoint), with the ports given to clashing ones."""
        with self._lock:
            self._check_open()
            self.snat_map.flush(ep_id)
            return self.conntrack_map.flush(ep_id)

    def snat(self) -> list[SnatEntry]:
        """Connections given a source port of their own (their tuple was another flow's)."""
        with self._lock:
            self._check_open()
            return self.snat_map.entries()

    def policy_epoch(self) -> int:
        with self._lock:
            self._check_open()
            return self.state.epoch()

    # -- lifecycle ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("datapath is closed")

    def close(self) -> None:
        """Release this process's handles; programs stay attached and maps pinned."""
        with self._lock, self._events_lock:
            if self._closed:
                return
            self._closed = True
            self._events.close()
            for m in self._maps.values():
                m.close()
            self._loader.close()
            log.info("datapath closed", base_dir=self.base_dir)
        self._lock.close()

    def teardown(self) -> None:
        """Detach every endpoint's programs and remove every pin under ``base_dir``."""
        with self._lock:
            self._check_open()
            ifindexes = {r.ifindex for r in self.endpoint_map.records()} | {r.ifindex for r in self._endpoints.values()}
            for ifindex in sorted(ifindexes):
                self._loader.detach(ifindex)
        self.close()
        _unpin_all(self.base_dir)
        log.info("datapath torn down", base_dir=self.base_dir)

    def __enter__(self) -> Datapath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unpin_all(base_dir: str) -> None:
    for module in bpf_maps.ALL:
        unpin(os.path.join(base_dir, module.NAME))
    shutil.rmtree(os.path.join(base_dir, PROGRAMS_DIR), ignore_errors=True)
    shutil.rmtree(os.path.join(base_dir, LINKS_DIR), ignore_errors=True)
    try:
        os.rmdir(base_dir)
    except OSError:  # something else lives there; leave it
        pass


def teardown_all(base_dir: str = DEFAULT_BASE_DIR) -> bool:
    """Remove a datapath's kernel state without opening it (no compile, any map sizes).

    Detaches the programs from every veth the pinned endpoints map names and
    removes every pin under ``base_dir``. Pod namespaces and veths are not
    touched. Returns False when there was nothing under ``base_dir``.
    """
    if not os.path.isdir(base_dir):
        return False
    records: list[EndpointEntry] = []
    if os.path.exists(os.path.join(base_dir, endpointmap.NAME)):
        pinned = PinnedMap.open_any(base_dir, endpointmap.NAME)
        try:
            same_layout = (pinned.spec.key_size, pinned.spec.value_size) == (
                ctypes.sizeof(endpointmap.EndpointKey),
                ctypes.sizeof(endpointmap.EndpointValue),
            )
            if same_layout:
                records = EndpointMap(pinned).records()
        finally:
            pinned.close()
    loader = Loader(base_dir)
    try:
        for record in records:
            loader.detach(record.ifindex)
    finally:
        loader.close()
    _unpin_all(base_dir)
    log.info("datapath torn down", base_dir=base_dir, endpoints=len(records))
    return True


__all__ = [
    "DEFAULT_BASE_DIR",
    "IDENTITY_WORLD",
    "Datapath",
    "DatapathAPI",
    "UnknownEndpoint",
    "teardown_all",
]
