"""The pinned maps the DNS proxy process writes, opened without the program.

The datapath creates the maps and loads the program; the proxy (``dnsproxyd``) opens the pins
it needs (ipcache, policy, enforcement, state, conntrack) and writes only learned entries:
ipcache prefixes and policy entries of node-local identities. Both processes serialize writes
with the pin directory's :class:`~services.datapath.policywriter.WriterLock`, and the proxy's
policy writes keep the enforcement the datapath set (:meth:`LearnedMaps.apply_entries`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from services.datapath.maps import ct4map, ctmap, enforcementmap, ipcachemap, policymap, statemap
from services.datapath.maps.bpf import PinnedMap
from services.datapath.maps.ctmap import CtMap
from services.datapath.maps.enforcementmap import EnforcementMap
from services.datapath.maps.ipcachemap import IPCacheMap
from services.datapath.maps.policymap import PolicyMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.maps.statemap import StateMap
from services.datapath.policywriter import WriterLock, write_policy
from services.datapath.types import Enforcement, PolicyChange, PolicyEntry

_NEEDED = (ipcachemap, policymap, enforcementmap, statemap, ctmap, ct4map)


class MapsMissing(FileNotFoundError):
    """The datapath has not created the maps yet."""


class LearnedMaps:
    def __init__(self, base_dir: str, maps: dict[str, PinnedMap]) -> None:
        self.base_dir = base_dir
        self._maps = maps
        self._lock = WriterLock(base_dir)
        self.ipcache = IPCacheMap(maps[ipcachemap.NAME])
        self.policy = PolicyMap(maps[policymap.NAME])
        self.enforcement = EnforcementMap(maps[enforcementmap.NAME])
        self.state = StateMap(maps[statemap.NAME])
        self.conntrack_map = CtMap(maps[ct4map.NAME], maps[ctmap.NAME])

    @classmethod
    def open(cls, base_dir: str, sizes: MapSizes | None = None) -> LearnedMaps:
        sizes = sizes or MapSizes()
        base_dir = os.path.abspath(base_dir)
        maps: dict[str, PinnedMap] = {}
        try:
            for module in _NEEDED:
                spec = module.spec(sizes)
                if not os.path.exists(os.path.join(base_dir, spec.name)):
                    raise MapsMissing(f"{base_dir}/{spec.name} is not pinned yet: the datapath creates it")
                maps[spec.name] = PinnedMap.open(base_dir, spec)
        except BaseException:
            for m in maps.values():
                m.close()
            raise
        return cls(base_dir, maps)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                m.close()
        self._lock.close()

    def ipcache_upsert(self, prefix: str, identity: int) -> None:
        with self._lock:
            self.ipcache.upsert(prefix, identity)
            self.state.bump_epoch()

    def ipcache_delete(self, prefix: str) -> bool:
        with self._lock:
            deleted = self.ipcache.delete(prefix)
            if deleted:
                self.state.bump_epoch()
            return deleted

    def ipcache_lookup(self, ip: str) -> int | None:
        return self.ipcache.lookup(ip)

    def ipcache_dump(self) -> dict[str, int]:
        return self.ipcache.dump()

    def dump_policy(self, ep_id: int) -> tuple[Enforcement, list[PolicyEntry]]:
        with self._lock:
            prefixes = self.policy.read(ep_id).get(ep_id, {})
            return self.enforcement.get(ep_id), policymap.decode(prefixes)

    def apply_entries(
        self,
        ep_id: int,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange:
        writes, stale = policymap.encode_delta(ep_id, add, remove, keep)
        with self._lock:
            held = self.enforcement.get(ep_id)
            return write_policy(self.policy, self.enforcement, self.state, ep_id, held, writes, stale)

    def open_destinations(self) -> set[str]:
        now = time.monotonic_ns()
        return {e.destination_ip for e in self.conntrack_map.entries() if e.expires_ns >= now}
