"""The ipcache as the policy service needs it: which identities live on which node.

Pure bookkeeping over ``palisade.ipcache.<ip>`` entries: where each address lives,
the identities present on every node (the span of a policy change), the
endpoints (pods) per node, and each identity's named ports (union over its pods).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from services.common.labels import ReservedIdentity
from services.policy.engine.identity import MAX_CLUSTER_IDENTITY, MIN_CLUSTER_IDENTITY
from services.policy.engine.model import IPAddress, IpProto

NamedPortSet = frozenset[tuple[str, IpProto, int]]
K = TypeVar("K")
V = TypeVar("V")


def is_endpoint_identity(identity: int) -> bool:
    """Whether policy is computed for this identity number (pods, health, init)."""
    return MIN_CLUSTER_IDENTITY <= identity <= MAX_CLUSTER_IDENTITY or identity in (
        ReservedIdentity.HEALTH,
        ReservedIdentity.INIT,
    )


@dataclass(frozen=True, slots=True)
class IpcacheRecord:
    """One ipcache entry as received."""

    prefix: str
    #: The host address when the prefix is a single address (/32, /128), else None.
    ip: IPAddress | None
    identity: int
    node: str
    #: "namespace/name" of the pod owning the address, or "".
    pod: str
    named_ports: NamedPortSet

    @property
    def endpoint(self) -> tuple[str, str] | None:
        """(node, pod) when the address belongs to a pod on a node."""
        if self.node and self.pod and is_endpoint_identity(self.identity):
            return (self.node, self.pod)
        return None


@dataclass(frozen=True, slots=True)
class IpcacheDelta:
    """What one entry change did."""

    old: IpcacheRecord | None
    new: IpcacheRecord | None
    #: Identities whose named-port union changed.
    ports_changed: frozenset[int] = frozenset()


class IpcacheTable:
    """Entries by subject, with per-node identity counts and per-identity named ports."""

    def __init__(self) -> None:
        self._entries: dict[str, IpcacheRecord] = {}
        self._local: dict[str, Counter[int]] = {}
        self._nodes_of: dict[int, Counter[str]] = {}
        self._ports: dict[int, Counter[tuple[str, IpProto, int]]] = {}
        self._endpoints: dict[tuple[str, str], dict[str, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def upsert(self, subject: str, record: IpcacheRecord) -> IpcacheDelta:
        old = self._entries.get(subject)
        if old == record:
            return IpcacheDelta(old, record)
        changed: set[int] = set()
        if old is not None:
            changed |= self._unindex(subject, old)
        self._entries[subject] = record
        changed |= self._index(subject, record)
        return IpcacheDelta(old, record, frozenset(changed))

    def delete(self, subject: str) -> IpcacheDelta:
        old = self._entries.pop(subject, None)
        if old is None:
            return IpcacheDelta(None, None)
        return IpcacheDelta(old, None, frozenset(self._unindex(subject, old)))

    # --- read side ---------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted(self._local)

    def local_identities(self, node: str) -> set[int]:
        """Endpoint identities with at least one address on ``node``."""
        return set(self._local.get(node, ()))

    def is_local(self, node: str, identity: int) -> bool:
        return identity in self._local.get(node, ())

    def nodes_of(self, identity: int) -> set[str]:
        return set(self._nodes_of.get(identity, ()))

    def named_ports(self, identity: int) -> Mapping[str, frozenset[tuple[IpProto, int]]]:
        out: dict[str, set[tuple[IpProto, int]]] = {}
        for name, proto, port in self._ports.get(identity, ()):
            out.setdefault(name, set()).add((proto, port))
        return {k: frozenset(v) for k, v in out.items()}

    def endpoint_identity(self, node: str, pod: str) -> int | None:
        """The identity of a pod endpoint on a node, from its most recent address."""
        subjects = self._endpoints.get((node, pod))
        if not subjects:
            return None
        return next(reversed(subjects.values()))

    def find_pod(self, pod: str) -> IpcacheRecord | None:
        """Any entry of the pod "namespace/name" (the most recently added)."""
        found: IpcacheRecord | None = None
        for record in self._entries.values():
            if record.pod == pod:
                found = record
        return found

    def pods_by_identity(self) -> dict[int, list[str]]:
        """Each identity's pods ("namespace/name"), sorted: examples for previews."""
        out: dict[int, set[str]] = {}
        for record in self._entries.values():
            if record.pod:
                out.setdefault(record.identity, set()).add(record.pod)
        return {i: sorted(pods) for i, pods in out.items()}

    # --- indexes -------------------------------------------------------------------------

    def _index(self, subject: str, r: IpcacheRecord) -> set[int]:
        if r.node and is_endpoint_identity(r.identity):
            self._local.setdefault(r.node, Counter())[r.identity] += 1
            self._nodes_of.setdefault(r.identity, Counter())[r.node] += 1
        ep = r.endpoint
        if ep is not None:
            subjects = self._endpoints.setdefault(ep, {})
            subjects.pop(subject, None)
            subjects[subject] = r.identity
        if not r.named_ports:
            return set()
        counts = self._ports.setdefault(r.identity, Counter())
        before = set(counts)
        counts.update(r.named_ports)
        return {r.identity} if set(counts) != before else set()

    def _unindex(self, subject: str, r: IpcacheRecord) -> set[int]:
        if r.node and is_endpoint_identity(r.identity):
            _decrement(self._local, r.node, r.identity)
            _decrement(self._nodes_of, r.identity, r.node)
        ep = r.endpoint
        if ep is not None:
            subjects = self._endpoints.get(ep)
            if subjects is not None:
                subjects.pop(subject, None)
                if not subjects:
                    del self._endpoints[ep]
        if not r.named_ports:
            return set()
        counts = self._ports.get(r.identity)
        if counts is None:
            return set()
        before = set(counts)
        counts.subtract(r.named_ports)
        for k in [k for k, n in counts.items() if n <= 0]:
            del counts[k]
        if not counts:
            del self._ports[r.identity]
        return {r.identity} if set(counts) != before else set()


def _decrement(table: dict[K, Counter[V]], outer: K, inner: V) -> None:
    counts = table.get(outer)
    if counts is None:
        return
    counts[inner] -= 1
    if counts[inner] <= 0:
        del counts[inner]
    if not counts:
        del table[outer]
