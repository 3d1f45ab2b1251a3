"""An in-memory datapath with the real one's semantics, for tests and benchmarks without root.

Policy goes through the same encoding as the kernel map (``maps.policymap``), so
dumps, diffs and verdicts (:meth:`FakeDatapath.evaluate`) match the real datapath.
What the real datapath keeps pinned in bpffs, the fake keeps per base dir for the life
of the process (a class-level table), so close-and-reopen restores like a restart.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import threading
import time
from collections.abc import Iterable

from services.datapath.datapath import (
    DEFAULT_BASE_DIR,
    UnknownEndpoint,
    check_endpoint_id,
    check_identity,
)
from services.datapath.loader import ProgramConfig
from services.datapath.maps import ipcachemap, metricsmap, policymap
from services.datapath.maps.endpointmap import EndpointEntry
from services.datapath.maps.policymap import Prefix, PrefixMap
from services.datapath.types import (
    CounterKey,
    Counters,
    CounterValue,
    Direction,
    EndpointSpec,
    Enforcement,
    FlowEvent,
    Frontend,
    L4Proto,
    LbService,
    LbState,
    PinnedEndpoint,
    PolicyChange,
    PolicyEntry,
    Reason,
    Verdict,
    is_local_identity,
)


@dataclasses.dataclass
class _FakeKernel:
    """What the fake keeps "pinned": survives close() and a new open() of the same base dir."""

    endpoints: dict[int, EndpointEntry] = dataclasses.field(default_factory=dict)
    attached: set[int] = dataclasses.field(default_factory=set)
    policy: dict[int, PrefixMap] = dataclasses.field(default_factory=dict)
    enforcement: dict[int, Enforcement] = dataclasses.field(default_factory=dict)
    ipcache: dict[str, int] = dataclasses.field(default_factory=dict)
    counters: dict[CounterKey, CounterValue] = dataclasses.field(default_factory=dict)
    flows: list[FlowEvent] = dataclasses.field(default_factory=list)
    services: dict[Frontend, LbState] = dataclasses.field(default_factory=dict)
    next_backend: int = 1
    #: dns_steering: (endpoint, port, protocol) -> the DNS proxy's port.
    dns_steering: dict[tuple[int, int, int], int] = dataclasses.field(default_factory=dict)


class FakeDatapath:
    """The datapath facade's API over :class:`_FakeKernel` state, plus flow simulation."""

    _pinned: dict[str, _FakeKernel] = {}
    _pinned_lock = threading.Lock()

    def __init__(self, base_dir: str, kernel: _FakeKernel, config: ProgramConfig) -> None:
        self.base_dir = base_dir
        self.config = config
        self.max_endpoint_id = metricsmap.max_endpoint_id(config.sizes)
        self._k = kernel
        self._world = config.world_identity
        self._lock = threading.RLock()
        self._closed = False
        self._flow_ready = threading.Condition(self._lock)
        #: Endpoints this instance attached, and each migrate_conntrack: released, and which it had.
        self.attached_here: set[int] = set()
        self.migrations: list[tuple[bool, set[int]]] = []

    @classmethod
    def open(
        cls, base_dir: str = DEFAULT_BASE_DIR, *, config: ProgramConfig | None = None, attach: str = ""
    ) -> FakeDatapath:
        with cls._pinned_lock:
            kernel = cls._pinned.setdefault(base_dir, _FakeKernel())
        return cls(base_dir, kernel, config or ProgramConfig())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("datapath is closed")

    def attach_endpoint(self, spec: EndpointSpec) -> None:
        with self._lock:
            self._check_open()
            check_endpoint_id(spec.id, self.config.sizes)
            for other in self._k.endpoints.values():
                if other.ifindex == spec.ifindex and other.id != spec.id:
                    raise ValueError(f"ifindex {spec.ifindex} already belongs to endpoint {other.id}")
            old = self._k.endpoints.get(spec.id)
            if old is not None:
                self._k.attached.discard(old.ifindex)
            self._k.endpoints[spec.id] = EndpointEntry(spec.id, spec.ifindex, spec.identity, spec.ips)
            self._k.attached.add(spec.ifindex)
            self.attached_here.add(spec.id)

    def reap_links(self, keep: Iterable[int] = ()) -> int:
        return 0  # the fake pins no links: a detached endpoint's programs are off at once

    def detach_endpoint(self, ep_id: int, *, veth_going: bool = False) -> bool:
        with self._lock:
            self._check_open()
            record = self._k.endpoints.pop(ep_id, None)
            if record is None:
                self._k.policy.pop(ep_id, None)
                self._k.enforcement.pop(ep_id, None)
                return False
            self._k.attached.discard(record.ifindex)
            self._k.policy.pop(ep_id, None)
            self._k.enforcement.pop(ep_id, None)
            for key in [k for k in self._k.counters if k.endpoint_id == ep_id]:
                del self._k.counters[key]
            return True

    def set_identity(self, ep_id: int, identity: int) -> None:
        check_identity(identity)
        with self._lock:
            self._check_open()
            record = self._k.endpoints.get(ep_id)
            if record is None:
                raise UnknownEndpoint(ep_id)
            self._k.endpoints[ep_id] = dataclasses.replace(record, identity=identity)

    def apply_policy(
        self,
        ep_id: int,
        enforcement: Enforcement,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange:
        writes, stale = policymap.encode_delta(ep_id, add, remove, keep)
        with self._lock:
            self._check_open()
            return self._write(ep_id, enforcement, writes, stale)

    def sync_policy(self, ep_id: int, enforcement: Enforcement, entries: Iterable[PolicyEntry]) -> PolicyChange:
        desired = policymap.encode(ep_id, policymap.normalize(entries))
        with self._lock:
            self._check_open()
            held = self._k.policy.get(ep_id, {})
            # As the real datapath: entries of node-local (learned) identities are the DNS proxy's.
            current = {p: v for p, v in held.items() if not is_local_identity(p.identity)}
            writes, stale = policymap.diff(current, desired)
            return self._write(ep_id, enforcement, writes, stale)

    def _write(self, ep_id: int, enforcement: Enforcement, writes: PrefixMap, stale: list[Prefix]) -> PolicyChange:
        prefixes = self._k.policy.setdefault(ep_id, {})
        prefixes.update(writes)
        for prefix in stale:
            prefixes.pop(prefix, None)
        changed = self._k.enforcement.get(ep_id) != enforcement
        self._k.enforcement[ep_id] = enforcement
        return PolicyChange(added=len(writes), removed=len(stale), enforcement_changed=changed)

    def dump_policy(self, ep_id: int) -> tuple[Enforcement, list[PolicyEntry]]:
        with self._lock:
            self._check_open()
            return self._k.enforcement.get(ep_id, Enforcement()), policymap.decode(self._k.policy.get(ep_id, {}))

    def ipcache_upsert(self, prefix: str, identity: int) -> None:
        check_identity(identity)
        with self._lock:
            self._check_open()
            self._k.ipcache[str(ipcachemap.parse_prefix(prefix))] = identity

    def ipcache_delete(self, prefix: str) -> bool:
        with self._lock:
            self._check_open()
            return self._k.ipcache.pop(str(ipcachemap.parse_prefix(prefix)), None) is not None

    def dns_steer_set(self, ep_id: int, port: int, protocol: int, proxy_port: int) -> None:
        with self._lock:
            self._check_open()
            self._k.dns_steering[(ep_id, port, protocol)] = proxy_port

    def dns_steer_delete(self, ep_id: int, port: int, protocol: int) -> bool:
        with self._lock:
            self._check_open()
            return self._k.dns_steering.pop((ep_id, port, protocol), None) is not None

    def dns_steer_dump(self) -> dict[tuple[int, int, int], int]:
        with self._lock:
            self._check_open()
            return dict(self._k.dns_steering)

    def ipcache_lookup(self, ip: str) -> int | None:
        address = ipaddress.ip_address(ip)
        with self._lock:
            self._check_open()
            held = [ipaddress.ip_network(p) for p in self._k.ipcache]
            best = max((n for n in held if address in n), key=lambda n: n.prefixlen, default=None)
            return None if best is None else self._k.ipcache[str(best)]

    def ipcache_dump(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            return dict(self._k.ipcache)

    def lb_upsert(self, service: LbService) -> LbState:
        with self._lock:
            self._check_open()
            old = self._k.services.get(service.frontend)
            used = {s.id for s in self._k.services.values()}
            service_id = old.id if old is not None else min(set(range(1, len(used) + 2)) - used)
            kept = {b: i for i, b in old.backends.items()} if old is not None else {}
            ids = {}
            for backend in dict.fromkeys(service.backends):
                backend_id = kept.get(backend)
                if backend_id is None:
                    backend_id, self._k.next_backend = self._k.next_backend, self._k.next_backend + 1
                ids[backend_id] = backend
            state = LbState(service.frontend, service_id, ids, service.affinity_timeout)
            self._k.services[service.frontend] = state
            return state

    def lb_delete(self, frontend: Frontend) -> bool:
        with self._lock:
            self._check_open()
            return self._k.services.pop(frontend, None) is not None

    def lb_services(self) -> list[LbState]:
        with self._lock:
            self._check_open()
            return sorted(self._k.services.values(), key=lambda s: s.frontend)

    def counters(self, endpoints: Iterable[int] | None = None) -> Counters:
        with self._lock:
            self._check_open()
            wanted = None if endpoints is None else set(endpoints)
            values = {k: v for k, v in self._k.counters.items() if wanted is None or k.endpoint_id in wanted}
            return Counters(values=values, events_lost=0)

    def read_flows(self, timeout_ms: int = 0) -> list[FlowEvent]:
        with self._flow_ready:
            self._check_open()
            if not self._k.flows and timeout_ms > 0:
                self._flow_ready.wait(timeout_ms / 1000)
            out, self._k.flows[:] = list(self._k.flows), []
            return out

    def skip_flows(self, timeout_ms: int = 0) -> int:
        return len(self.read_flows(timeout_ms))

    def take_flows(self, timeout_ms: int, limit: int) -> tuple[list[FlowEvent], int]:
        events = self.read_flows(timeout_ms)
        if not limit or len(events) <= limit:
            return events, 0
        return events[:limit], len(events) - limit

    def migrate_conntrack(self, release: bool = True) -> int:
        with self._lock:
            self._check_open()
            self.migrations.append((release, set(self.attached_here)))
            return 0  # the fake keeps no conntrack

    def pinned_endpoints(self) -> list[PinnedEndpoint]:
        with self._lock:
            self._check_open()
            return [
                PinnedEndpoint(
                    id=r.id,
                    ifindex=r.ifindex,
                    identity=r.identity,
                    ips=r.ips,
                    enforcement=self._k.enforcement.get(r.id, Enforcement()),
                    attached=r.ifindex in self._k.attached,
                )
                for r in sorted(self._k.endpoints.values(), key=lambda r: r.id)
            ]

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def teardown(self) -> None:
        with self._lock:
            self._check_open()
            self._closed = True
        with self._pinned_lock:
            self._pinned.pop(self.base_dir, None)

    # -- simulation, for tests of the code that drives the datapath ----------

    def resolve_identity(self, ip: str) -> int:
        """Identity of an address as the program resolves it: local endpoint, ipcache LPM, world."""
        with self._lock:
            for record in self._k.endpoints.values():
                if ip in record.ips:
                    return record.identity
            addr = ipaddress.ip_address(ip)
            best: tuple[int, int] | None = None
            for prefix, identity in self._k.ipcache.items():
                net = ipaddress.ip_network(prefix)
                if addr.version == net.version and addr in net and (best is None or net.prefixlen > best[0]):
                    best = (net.prefixlen, identity)
            return self._world if best is None else best[1]

    def evaluate(
        self, ep_id: int, direction: Direction, remote_ip: str, protocol: L4Proto | int, port: int = 0
    ) -> tuple[Verdict, Reason]:
        """The verdict the real program would give a new flow of this endpoint."""
        number = protocol.number if isinstance(protocol, L4Proto) else protocol
        with self._lock:
            return policymap.evaluate(
                self._k.policy.get(ep_id, {}),
                self._k.enforcement.get(ep_id, Enforcement()),
                ep_id=ep_id,
                direction=direction,
                remote_identity=self.resolve_identity(remote_ip),
                protocol=number,
                port=port if number in (6, 17, 132) else 0,
            )

    def simulate_flow(
        self,
        ep_id: int,
        direction: Direction,
        remote_ip: str,
        protocol: L4Proto | int,
        port: int = 0,
        *,
        remote_port: int = 40000,
    ) -> FlowEvent:
        """Judge a new flow like the program, count it and queue its flow event."""
        verdict, reason = self.evaluate(ep_id, direction, remote_ip, protocol, port)
        number = protocol.number if isinstance(protocol, L4Proto) else protocol
        with self._flow_ready:
            record = self._k.endpoints.get(ep_id)
            if record is None:
                raise UnknownEndpoint(ep_id)
            remote_id = self.resolve_identity(remote_ip)
            local_ip = next(
                (
                    ip
                    for ip in record.ips
                    if ipaddress.ip_address(ip).version == ipaddress.ip_address(remote_ip).version
                ),
                "",
            )
            egress = direction is Direction.EGRESS
            event = FlowEvent(
                time=time.time(),
                endpoint_id=ep_id,
                ifindex=record.ifindex,
                direction=direction,
                verdict=verdict,
                reason=reason,
                source_identity=record.identity if egress else remote_id,
                destination_identity=remote_id if egress else record.identity,
                source_ip=local_ip if egress else remote_ip,
                destination_ip=remote_ip if egress else local_ip,
                source_port=remote_port if not egress else 40000,
                destination_port=port,
                protocol=number,
            )
            key = CounterKey(ep_id, reason, direction)
            old = self._k.counters.get(key, CounterValue(0, 0))
            self._k.counters[key] = CounterValue(old.packets + 1, old.bytes)
            self._k.flows.append(event)
            self._flow_ready.notify_all()
            return event
