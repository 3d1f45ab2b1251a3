"""The ipcache: ``palisade.ipcache.>`` into the BPF LPM map, and relabels of local pods.

Node addresses come as ``remote-node``; the ones of this datapath's own node are
installed as ``host`` (Cilium's reserved identities 6 and 1). The stream keeps the last
entry per address, so following it from the start replays
the current ipcache; after the replay, prefixes the map holds but the stream no
longer has (deleted while the datapath was down) are removed. Tombstones delete.

Addresses of local endpoints are the endpoint manager's: their map entries always
carry the endpoint's identity. When an entry for a local pod's address brings a new
identity (the pod was relabelled and ipam re-resolved it), the endpoint is switched
to that identity, new policy first.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Mapping
from typing import Protocol

from palisade.v1 import identity_pb2
from services.common.bus import Bus, Follower
from services.common.labels import ReservedIdentity
from services.common.log import get_logger
from services.datapath.types import is_cidr_identity, is_local_identity

log = get_logger("ipcache")

SUBJECT = "palisade.ipcache.>"


class IpcacheMap(Protocol):
    """The LPM map part of the BPF facade (blocking calls)."""

    def ipcache_upsert(self, prefix: str, identity: int) -> None: ...

    def ipcache_delete(self, prefix: str) -> object: ...

    def ipcache_dump(self) -> Mapping[str, int]: ...

    def ipcache_lookup(self, ip: str) -> int | None: ...


class LocalEndpoints(Protocol):
    """The endpoint manager, as the ipcache sees it."""

    def local_prefixes(self) -> dict[str, int]: ...

    def local_identity(self, prefix: str) -> int | None: ...

    async def ipcache_identity(self, prefix: str, identity: int, namespace: str, pod: str) -> None: ...


def normalize(prefix: str) -> str:
    """``10.0.0.5`` and ``10.0.0.5/32`` name one prefix; host bits are cleared."""
    return str(ipaddress.ip_network(prefix.strip(), strict=False))


class IpcacheSync:
    """Keeps the LPM map equal to the ipcache stream (plus the local endpoints' addresses)."""

    def __init__(
        self,
        datapath: IpcacheMap,
        endpoints: LocalEndpoints,
        node: str = "",
        on_cidrs: Callable[[Mapping[str, int]], object] | None = None,
    ) -> None:
        self._dp = datapath
        self._endpoints = endpoints
        #: Told the CIDR prefixes (ipam's CIDR identities) once loaded and whenever they change:
        #: the DNS proxy's learned addresses keep what the prefix holding them allowed.
        self._on_cidrs = on_cidrs
        self.cidrs: dict[str, int] = {}
        #: This datapath's node: its own addresses are ``host``, other nodes' ``remote-node``.
        self._node = node
        #: The desired ipcache: prefix -> identity, as the stream says.
        self.entries: dict[str, int] = {}
        #: Address (no prefix length) -> "namespace/name" of the pod owning it, for flows' names.
        self.pods: dict[str, str] = {}
        self.loaded = asyncio.Event()
        self.updates = 0
        self._follower: Follower | None = None

    def holds(self, ip: str) -> bool:
        """Whether the stream has an entry for the address (someone in the cluster holds it)."""
        return normalize(ip) in self.entries

    async def start(self, bus: Bus) -> None:
        """Replay the stream into the map, remove what it no longer has, then keep following."""
        self._follower = await bus.follow(SUBJECT, identity_pb2.IpcacheEntry, self._on_entry)
        await self._follower.caught_up.wait()
        removed = await self._prune()
        self.loaded.set()
        self._tell_cidrs()
        log.info("ipcache loaded", prefixes=len(self.entries), stale_removed=removed)

    async def stop(self) -> None:
        if self._follower is not None:
            await self._follower.stop()

    async def _on_entry(self, subject: str, entry: identity_pb2.IpcacheEntry) -> None:
        try:
            prefix = normalize(entry.prefix)
        except ValueError:
            log.warning("ipcache entry with a bad prefix ignored", subject=subject, prefix=entry.prefix)
            return
        before = self.cidrs.get(prefix)
        identity = 0 if entry.deleted else entry.identity
        if is_cidr_identity(identity):
            self.cidrs[prefix] = identity
        else:
            self.cidrs.pop(prefix, None)
        await self._apply(prefix, entry, cidr=before is not None or is_cidr_identity(identity))
        if self.cidrs.get(prefix) != before:
            self._tell_cidrs()  # after the map holds the change: the file says what the map has

    async def _apply(self, prefix: str, entry: identity_pb2.IpcacheEntry, *, cidr: bool) -> None:
        # One look for the entry's prefix: every node sees every pod's entry of the cluster.
        local = self._endpoints.local_identity(prefix)
        address = prefix.partition("/")[0]
        if entry.deleted or not entry.identity:
            self.entries.pop(prefix, None)
            self.pods.pop(address, None)
            if local is not None:
                return  # the endpoint still exists here: its address keeps its identity
            if cidr and await self._learned_holds(prefix):
                return
            await asyncio.to_thread(self._dp.ipcache_delete, prefix)
        else:
            identity = entry.identity
            if identity == ReservedIdentity.REMOTE_NODE and entry.node and entry.node == self._node:
                identity = ReservedIdentity.HOST  # as Cilium: this node's own addresses are the host
            self.entries[prefix] = identity
            if entry.pod:
                self.pods[address] = f"{entry.namespace}/{entry.pod}"
            else:
                self.pods.pop(address, None)
            if local is not None:
                if local != identity:
                    await self._endpoints.ipcache_identity(prefix, identity, entry.namespace, entry.pod)
                return
            if cidr and await self._learned_holds(prefix):
                return
            await asyncio.to_thread(self._dp.ipcache_upsert, prefix, identity)
        self.updates += 1

    async def _learned_holds(self, prefix: str) -> bool:
        """True when the DNS proxy's learned address holds exactly ``prefix`` (a CIDR /32 of an
        address a pod resolved): the proxy's entry stays, and the proxy puts the CIDR's back
        when the address expires."""
        network = ipaddress.ip_network(prefix)
        if network.prefixlen != network.max_prefixlen:
            return False
        held = await asyncio.to_thread(self._dp.ipcache_lookup, str(network.network_address))
        return held is not None and is_local_identity(held)

    def _tell_cidrs(self) -> None:
        if self._on_cidrs is not None and self.loaded.is_set():
            try:
                self._on_cidrs(dict(self.cidrs))
            except OSError as exc:
                log.error("CIDR prefixes not published to the DNS proxy", error=str(exc))

    async def _prune(self) -> int:
        held = await asyncio.to_thread(self._dp.ipcache_dump)
        keep = set(self.entries) | set(self._endpoints.local_prefixes())
        # Node-local identities are the DNS proxy's learned addresses, not the stream's.
        stale = [p for p, ident in held.items() if normalize(p) not in keep and not is_local_identity(ident)]
        for prefix in stale:
            await asyncio.to_thread(self._dp.ipcache_delete, prefix)
        return len(stale)
