"""Services on the bus into this node's load-balancer maps.

Follows ``palisade.k8s.service.>`` and ``palisade.k8s.endpointslice.>`` (the stream
keeps each object's last state). Start, as Cilium's agent does it (``initMaps`` ->
``RestoreServices`` -> the service handler): the facade has already read what the
maps held (ids kept, connections keep working); once both kinds are replayed,
every Service's frontends are written and the frontends no Service has any more
(deleted while the datapath was down) are removed. After that, a change to a
Service or to one of its slices rewrites that Service's frontends only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterable
from typing import Protocol

from palisade.v1 import k8s_pb2
from services.common.bus import Bus, Follower
from services.common.largeobjects import follow_deltas
from services.common.log import get_logger
from services.common.subjects import k8s_filter
from services.datapath.k8sservices import (
    ServiceInfo,
    SliceInfo,
    frontends,
    parse_service,
    parse_slice,
)
from services.datapath.types import Frontend, LbService, LbState

log = get_logger("services")


class LoadBalancerMaps(Protocol):
    """The service part of the BPF facade (blocking calls)."""

    def lb_upsert(self, service: LbService) -> LbState: ...

    def lb_delete(self, frontend: Frontend) -> bool: ...

    def lb_services(self) -> list[LbState]: ...


@dataclasses.dataclass(frozen=True)
class ServedFrontend:
    """A frontend as ``service list`` shows it: whose it is and what the maps hold."""

    namespace: str
    name: str
    port_name: str
    state: LbState
    local_only: bool


class ServiceSync:
    def __init__(self, datapath: LoadBalancerMaps, node: str) -> None:
        self._dp = datapath
        self._node = node
        self._services: dict[str, ServiceInfo] = {}
        #: (namespace, slice name) -> slice
        self._slices: dict[tuple[str, str], SliceInfo] = {}
        #: service key -> its slices' keys
        self._slices_by_service: dict[str, set[tuple[str, str]]] = {}
        #: service key -> the frontends written for it
        self._applied: dict[str, dict[Frontend, LbState]] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._followers: list[Follower] = []
        self.loaded = asyncio.Event()
        #: Ports not load-balanced, per service key (a protocol other than TCP, UDP and SCTP).
        self.skipped: dict[str, tuple[str, ...]] = {}
        self.writes = 0

    async def start(self, bus: Bus) -> None:
        """Follow both kinds; returns once they are replayed and the maps reconciled."""
        self._followers = [
            await follow_deltas(bus, k8s_filter("service"), self._on_service),
            await follow_deltas(bus, k8s_filter("endpointslice"), self._on_slice),
        ]
        for follower in self._followers:
            await follower.caught_up.wait()
        removed = await self._reconcile()
        self.loaded.set()
        if self._dirty:  # changed while the maps were being reconciled
            self._wake.set()
        log.info("services loaded", services=len(self._services), frontends=self.frontend_count(), stale=removed)

    async def stop(self) -> None:
        for follower in self._followers:
            await follower.stop()

    async def run(self) -> None:
        """Apply changes after the start, one Service at a time."""
        await self.loaded.wait()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                key = self._dirty.pop()
                try:
                    await self._apply(key)
                except Exception as exc:  # a full map, a kernel error: logged, retried on the next change
                    log.error("service not written", service=key, error=str(exc))

    def frontend_count(self) -> int:
        return sum(len(f) for f in self._applied.values())

    def served(self) -> list[ServedFrontend]:
        out = []
        for key, states in sorted(self._applied.items()):
            info = self._services.get(key)
            namespace, _, name = key.partition("/")
            names = {p.port: p.name for p in info.ports} if info else {}
            for state in sorted(states.values(), key=lambda s: s.frontend):
                port_name = names.get(state.frontend.port, "")
                out.append(ServedFrontend(namespace, name, port_name, state, bool(info and info.local_only)))
        return out

    # -- events --------------------------------------------------------------

    async def _on_service(self, subject: str, delta: k8s_pb2.K8sDelta) -> None:
        key = f"{delta.namespace}/{delta.name}"
        if delta.op == k8s_pb2.DELTA_OP_DELETE:
            self._services.pop(key, None)
        else:
            try:
                self._services[key] = parse_service(json.loads(delta.object_json))
            except (ValueError, TypeError) as exc:
                log.warning("service ignored: not a valid object", service=key, error=str(exc))
                return
        self._mark(key)

    async def _on_slice(self, subject: str, delta: k8s_pb2.K8sDelta) -> None:
        slice_key = (delta.namespace, delta.name)
        old = self._slices.pop(slice_key, None)
        if old is not None:
            self._slices_by_service.get(old.service_key, set()).discard(slice_key)
            self._mark(old.service_key)
        if delta.op != k8s_pb2.DELTA_OP_DELETE:
            try:
                info = parse_slice(json.loads(delta.object_json))
            except (ValueError, TypeError) as exc:
                log.warning(
                    "endpoint slice ignored: not a valid object",
                    slice=f"{delta.namespace}/{delta.name}",
                    error=str(exc),
                )
                return
            self._slices[slice_key] = info
            self._slices_by_service.setdefault(info.service_key, set()).add(slice_key)
            self._mark(info.service_key)

    def _mark(self, key: str) -> None:
        self._dirty.add(key)
        if self.loaded.is_set():
            self._wake.set()

    # -- writing ---------------------------------------------------------------

    def _slices_of(self, key: str) -> Iterable[SliceInfo]:
        return [self._slices[k] for k in sorted(self._slices_by_service.get(key, ()))]

    async def _apply(self, key: str) -> None:
        info = self._services.get(key)
        wanted: tuple[LbService, ...] = ()
        if info is not None:
            result = frontends(info, self._slices_of(key), self._node)
            wanted = result.services
            if result.skipped:
                self.skipped[key] = result.skipped
            else:
                self.skipped.pop(key, None)
        else:
            self.skipped.pop(key, None)
        old = self._applied.get(key, {})
        new: dict[Frontend, LbState] = {}
        for service in wanted:
            previous = old.get(service.frontend)
            if previous is not None and _same(previous, service):
                new[service.frontend] = previous
                continue
            new[service.frontend] = await asyncio.to_thread(self._dp.lb_upsert, service)
            self.writes += 1
        for frontend in old.keys() - new.keys():
            await asyncio.to_thread(self._dp.lb_delete, frontend)
            self.writes += 1
        if new:
            self._applied[key] = new
        else:
            self._applied.pop(key, None)
        log.debug("service written", service=key, frontends=len(new))

    async def _reconcile(self) -> int:
        """Write every Service, then remove what the maps hold that no Service has."""
        held = {s.frontend: s for s in await asyncio.to_thread(self._dp.lb_services)}
        self._dirty.clear()
        for key in sorted(self._services):
            await self._apply(key)
        wanted = {f for states in self._applied.values() for f in states}
        stale = [f for f in held if f not in wanted]
        for frontend in stale:
            await asyncio.to_thread(self._dp.lb_delete, frontend)
        return len(stale)


def _same(state: LbState, service: LbService) -> bool:
    return state.affinity_timeout == service.affinity_timeout and sorted(state.backends.values()) == sorted(
        set(service.backends)
    )
