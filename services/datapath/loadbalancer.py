"""Service frontends in the kernel maps: ids kept across restarts, writes ordered for live traffic.

The maps are the record (after Cilium's ``RestoreServices``): :class:`LoadBalancer`
reads them when the datapath opens, so a restarted agent keeps every service id
(connections in conntrack name it for reverse NAT) and every backend id (service
connections name it), and only then reconciles with the current Services.

Write order for an update, so a packet never finds a slot pointing nowhere:
new backends, the reverse NAT entry, the slots 1..n, the service slot (count n),
then slots above n and the backends that left, then, if any left, the service slot
again with a new revision. A backend that left loses its id; connections that had it
pick another live backend on their next packet. The revision tells the program so
without a lookup: a connection's entry keeps its backend's address and the revision
it was read at, and only an entry of an older revision looks its backend up again.
Revisions come from one counter for the node (restored above the maps' highest), so a
service deleted and created again never meets its predecessor's entries as current.

Not thread-safe: the facade calls it under its lock.
"""

from __future__ import annotations

import dataclasses

from services.datapath.maps.lbaffinitymap import LbAffinityMap
from services.datapath.maps.lbbackendmap import LbBackendMap
from services.datapath.maps.lbportmap import LbPortMap
from services.datapath.maps.lbrevnatmap import LbRevNatMap
from services.datapath.maps.lbservicemap import LbServiceMap, Master
from services.datapath.types import Backend, Frontend, LbService, LbState

#: Service ids are 16-bit (the reverse NAT index in conntrack entries); 0 means none.
MAX_SERVICE_ID = 0xFFFF
MAX_BACKEND_ID = 0xFFFFFFFF
#: Backend-set revisions are 32-bit (lb_service_value.revision); 0 is never written.
MAX_REVISION = 0xFFFFFFFF


class LoadBalancerFull(RuntimeError):
    """No service id is free (65,535 frontends on one node)."""


class LoadBalancer:
    def __init__(
        self,
        services: LbServiceMap,
        backends: LbBackendMap,
        revnat: LbRevNatMap,
        affinity: LbAffinityMap,
        ports: LbPortMap,
    ) -> None:
        self._services = services
        self._backends = backends
        self._revnat = revnat
        self._affinity = affinity
        #: Each service's backend-set revision (lb_service_value.revision).
        self._revisions: dict[Frontend, int] = {}
        self.state: dict[Frontend, LbState] = self._restore()
        self._last_revision = max(self._revisions.values(), default=0)
        for frontend, revision in list(self._revisions.items()):
            if revision == 0:
                # Written before services had revisions: a fresh one, so no entry stamped 0 (or
                # zeroed) can ever pass for current.
                self._revisions[frontend] = self._new_revision()
                state = self.state[frontend]
                master = Master(state.id, len(state.backends), state.affinity_timeout, self._revisions[frontend])
                self._services.write_master(frontend, master)
        self._ports = ports
        ports.reset(frontend.port for frontend in self.state)
        used = [b for s in self.state.values() for b in s.backends]
        self._next_backend = max(used, default=0) + 1
        #: Ids held by a service or still in the reverse NAT map (left by a crash mid-delete).
        self._service_ids = {s.id for s in self.state.values()} | revnat.ids()
        self._next_service = 1

    def _restore(self) -> dict[Frontend, LbState]:
        """What the maps hold; slots with no service slot or naming no backend are dropped."""
        backends = self._backends.read()
        masters: dict[Frontend, Master] = {}
        slots: dict[Frontend, dict[int, int]] = {}
        for frontend, slot, value in self._services.read():
            if slot == 0:
                masters[frontend] = Master(
                    int(value.rev_nat), int(value.count), int(value.affinity_s), int(value.revision)
                )
            else:
                slots.setdefault(frontend, {})[slot] = int(value.backend_id)
        state: dict[Frontend, LbState] = {}
        for frontend, master in masters.items():
            ids = [slots.get(frontend, {}).get(i) for i in range(1, master.count + 1)]
            held = {i: backends[i] for i in ids if i is not None and i in backends}
            state[frontend] = LbState(frontend, master.id, held, master.affinity_timeout)
            self._revisions[frontend] = master.revision
        return state

    def upsert(self, service: LbService) -> LbState:
        """Make the maps serve ``service``; backends it keeps keep their ids."""
        frontend = service.frontend
        old = self.state.get(frontend)
        if old is None:
            self._ports.hold(frontend.port)  # a hint only: set before the service is
        service_id = old.id if old is not None else self._free_service_id()
        old_backends = old.backends if old is not None else {}
        by_backend = {b: i for i, b in old_backends.items()}
        wanted = list(dict.fromkeys(service.backends))
        ids: dict[int, Backend] = {}
        for backend in wanted:
            backend_id = by_backend.get(backend)
            if backend_id is None:
                backend_id = self._new_backend_id()
                self._backends.write(backend_id, backend)
            ids[backend_id] = backend
        self._revnat.write(service_id, frontend)
        for slot, backend_id in enumerate(ids, 1):
            self._services.write_slot(frontend, slot, backend_id)
        revision = self._revisions.get(frontend) if old is not None else None
        if revision is None:
            revision = self._new_revision()
        master = Master(service_id, len(ids), service.affinity_timeout, revision)
        self._services.write_master(frontend, master)
        for slot in range(len(ids) + 1, len(old_backends) + 1):
            self._services.delete(frontend, slot)
        left = old_backends.keys() - ids.keys()
        for backend_id in left:
            self._backends.delete(backend_id)
        if left:
            # Only now: a packet that read the old revision while a backend that left was still in
            # its map may have stamped its entry with the old revision; the new one makes it look again.
            revision = self._new_revision()
            self._services.write_master(frontend, dataclasses.replace(master, revision=revision))
        self._revisions[frontend] = revision
        state = LbState(frontend, service_id, ids, service.affinity_timeout)
        self.state[frontend] = state
        return state

    def delete(self, frontend: Frontend) -> bool:
        old = self.state.pop(frontend, None)
        if old is None:
            return False
        self._services.delete(frontend)
        self._revisions.pop(frontend, None)
        for slot in range(1, len(old.backends) + 1):
            self._services.delete(frontend, slot)
        for backend_id in old.backends:
            self._backends.delete(backend_id)
        self._revnat.delete(old.id)
        self._ports.release(frontend.port)
        self._affinity.forget_service(old.id)
        self._service_ids.discard(old.id)
        return True

    def backends_by_id(self) -> dict[int, Backend]:
        """Every backend the maps hold, by backend id."""
        return {i: b for s in self.state.values() for i, b in s.backends.items()}

    def revisions_by_service(self) -> dict[int, int]:
        """Every service's revision, by service id."""
        return {s.id: self._revisions[f] for f, s in self.state.items()}

    def revision(self, frontend: Frontend) -> int | None:
        """The backend-set revision the service slot of ``frontend`` carries (None: no such service)."""
        return self._revisions.get(frontend)

    def _free_service_id(self) -> int:
        if len(self._service_ids) >= MAX_SERVICE_ID:
            raise LoadBalancerFull(f"all {MAX_SERVICE_ID} service ids are in use on this node")
        # Round-robin: a deleted service's id is reused last (its connections are gone by then).
        candidate = self._next_service
        while candidate in self._service_ids:
            candidate = candidate % MAX_SERVICE_ID + 1
        self._next_service = candidate % MAX_SERVICE_ID + 1
        self._service_ids.add(candidate)
        return candidate

    def _new_revision(self) -> int:
        self._last_revision = self._last_revision % MAX_REVISION + 1
        return self._last_revision

    def _new_backend_id(self) -> int:
        backend_id = self._next_backend
        self._next_backend = 1 if backend_id >= MAX_BACKEND_ID else backend_id + 1
        return backend_id
