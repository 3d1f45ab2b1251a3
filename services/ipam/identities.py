"""The identity allocator: label set -> numeric identity, cluster-wide, on etcd.

Several allocators (processes) may share one etcd; etcd transactions are the
only arbiter (see :mod:`services.ipam.keys` for the layout and the guards). The
in-memory maps here are caches that make the common case one round trip; every
decision they feed is re-checked by a transaction's compares, and a failed
transaction returns the facts that made it fail so the next attempt is right.
"""

from __future__ import annotations

import collections
import dataclasses
import random

from services.common.errors import Code
from services.common.labels import LabelSet
from services.common.log import get_logger
from services.ipam import keys, metrics
from services.ipam.errors import IpamError
from services.ipam.gc import GcTracker
from services.ipam.kv import (
    Change,
    Delete,
    Get,
    LeaseNotFound,
    Op,
    Put,
    Store,
    Txn,
    absent,
    mod_is,
    none_under,
    value_is,
)
from services.ipam.leases import NodeLeases
from services.ipam.model import (
    CIDR_RANGE,
    CLUSTER_RANGE,
    Identity,
    IdRange,
    Kind,
    classify,
    kind_of,
    reserved_by_id,
)
from services.ipam.owners import OwnerIndexed
from services.ipam.replica import ReplicaLease

log = get_logger("identities")

#: Transactions one allocation may lose to concurrent allocators before giving up.
MAX_ATTEMPTS = 64
#: Recently collected ids are not handed out again at once, so a consumer never sees an
#: identity's tombstone overtake the announcement of its number's next label set.
QUARANTINE = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class IdentityAllocation:
    """An identity allocated (or found) for one owner on one node: the answer of ``allocate``."""

    identity: Identity
    #: This call created the identity.
    new: bool
    #: The identity the owner held on this node before, when the call moved it.
    previous: int | None = None
    #: Store revision of the allocation (0 for reserved identities).
    revision: int = 0
    #: References on the identity right after the allocation, this one included (0 for reserved ones).
    references: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """One reference: who holds which identity on which node."""

    node: str
    owner: str
    identity: int


@dataclasses.dataclass(frozen=True, slots=True)
class GcPass:
    #: Every identity in etcd after the pass, by id.
    current: dict[int, LabelSet]
    #: Identities this pass deleted.
    collected: list[Identity]
    #: Store revision of the listing ``current`` comes from.
    revision: int
    #: Each identity's id key's revision (when it was written), by id.
    modified: dict[int, int] = dataclasses.field(default_factory=dict)


def _check_holder(node: str, owner: str) -> None:
    if not node or "/" in node:
        raise IpamError(
            f"node {node!r} is not a node name; references are held per node, pass the node's name",
            Code.INVALID_ARGUMENT,
        )
    if not owner:
        raise IpamError("owner is empty; pass who holds the reference, e.g. pod/ns/name", Code.INVALID_ARGUMENT)


def _holder(key: tuple[str, str]) -> tuple[str, str]:
    return key


def _identity_of(held: tuple[int, int]) -> int:
    return held[0]


class IdentityAllocator:
    """Allocates identities and holds per-node references under the node's lease."""

    def __init__(
        self,
        store: Store,
        leases: NodeLeases,
        *,
        cluster_range: IdRange = CLUSTER_RANGE,
        cidr_range: IdRange = CIDR_RANGE,
        rng: random.Random | None = None,
        replica: ReplicaLease | None = None,
    ) -> None:
        self._store = store
        self._leases = leases
        #: When set, identities created here are recorded as this replica's to announce.
        self._replica = replica
        self._ranges = {Kind.CLUSTER: cluster_range, Kind.CIDR: cidr_range}
        self._rng = rng or random.Random()
        self._by_id: dict[int, LabelSet] = {}
        self._by_labels: dict[LabelSet, int] = {}
        self._owners: OwnerIndexed[tuple[str, str], tuple[int, int]] = OwnerIndexed(_holder, tally=_identity_of)
        #: References this process took, so it can take them again if a lease is lost.
        self._held: dict[tuple[str, str], LabelSet] = {}
        self._quarantine: collections.deque[int] = collections.deque(maxlen=QUARANTINE)

    # -- cache -------------------------------------------------------------

    def _remember(self, ident: int, labels: LabelSet) -> None:
        old = self._by_id.get(ident)
        if old is not None and old != labels and self._by_labels.get(old) == ident:
            del self._by_labels[old]
        self._by_id[ident] = labels
        self._by_labels[labels] = ident

    def _forget(self, ident: int) -> None:
        labels = self._by_id.pop(ident, None)
        if labels is not None and self._by_labels.get(labels) == ident:
            del self._by_labels[labels]

    def observe(self, change: Change) -> tuple[Identity, bool] | None:
        """Apply a change to an identity key, made by any allocator (this one included), as the watch saw it.

        Returns (identity, deleted) when an identity appeared, changed or went, so it can be announced.
        """
        key = change.kv.key
        try:
            if key.startswith(keys.IDENTITY_IDS.encode()):
                ident = keys.parse_identity_id(key)
                if change.deleted:
                    labels = self._by_id.get(ident)
                    self._forget(ident)
                    return (Identity(ident, labels), True) if labels is not None else None
                labels = LabelSet.parse(change.kv.value.decode())
                self._remember(ident, labels)
                return Identity(ident, labels), False
            if key.startswith(keys.IDENTITY_OWNERS.encode()):
                holder = keys.parse_identity_owner(key)
                known = self._owners.get(holder)
                if known is not None and known[1] > change.revision:
                    return None  # this process wrote it again since
                if change.deleted:
                    self._owners.pop(holder, None)
                else:
                    self._owners[holder] = (int(change.kv.value), change.revision)
        except ValueError as exc:
            log.warning("malformed identity key ignored", key=key.decode(errors="replace"), error=str(exc))
        return None

    def labels_of(self, ident: int) -> LabelSet | None:
        """The labels of an identity as the cache knows them (allocated, loaded or watched here)."""
        return self._by_id.get(ident)

    def cached(self) -> list[Identity]:
        return [Identity(i, labels) for i, labels in sorted(self._by_id.items())]

    def count(self) -> int:
        return len(self._by_id)

    def count_by_kind(self) -> dict[Kind, int]:
        """Identities in the cache by kind; safe from another thread (the cache is read with one copy)."""
        out = dict.fromkeys(self._ranges, 0)
        for ident in self._by_id.copy():
            for kind, rng in self._ranges.items():
                if ident in rng:
                    out[kind] += 1
        return out

    async def load(self) -> dict[int, LabelSet]:
        """Read every identity from etcd into the cache; returns them by id."""
        current, _ = await self._list_ids()
        self._by_id.clear()
        self._by_labels.clear()
        for ident, (labels, _mod) in current.items():
            self._remember(ident, labels)
        owners, _ = await self._store.get_prefix(keys.IDENTITY_OWNERS.encode())
        self._owners = OwnerIndexed(
            _holder,
            ((keys.parse_identity_owner(kv.key), (int(kv.value), kv.mod_revision)) for kv in owners),
            tally=_identity_of,
        )
        return {i: labels for i, (labels, _) in current.items()}

    async def _list_ids(self) -> tuple[dict[int, tuple[LabelSet, int]], int]:
        kvs, revision = await self._store.get_prefix(keys.IDENTITY_IDS.encode())
        out = {}
        for kv in kvs:
            try:
                out[keys.parse_identity_id(kv.key)] = (LabelSet.parse(kv.value.decode()), kv.mod_revision)
            except ValueError as exc:
                log.warning("skipping malformed identity key", key=kv.key.decode(errors="replace"), error=str(exc))
        return out, revision

    # -- allocation --------------------------------------------------------

    def _candidate(self, kind: Kind) -> int | None:
        """A number that is free as far as the cache knows; random so racing allocators rarely collide."""
        rng = self._ranges[kind]
        for _ in range(32):
            candidate = self._rng.randint(rng.low, rng.high)
            if candidate not in self._by_id and candidate not in self._quarantine:
                return candidate
        start = self._rng.randint(0, rng.size - 1)
        fallback = None
        for i in range(rng.size):
            candidate = rng.low + (start + i) % rng.size
            if candidate not in self._by_id:
                if candidate not in self._quarantine:
                    return candidate
                fallback = candidate if fallback is None else fallback
        return fallback  # a full range reuses a quarantined number rather than failing

    async def _fresh_candidate(self, kind: Kind) -> int:
        candidate = self._candidate(kind)
        if candidate is None:
            await self.load()  # the cache may hold identities collected since
            candidate = self._candidate(kind)
        if candidate is None:
            rng = self._ranges[kind]
            raise IpamError(
                f"all {rng.size} {kind} identities ({rng.low}-{rng.high}) are in use; release unused label sets "
                "and wait for the collector's grace period, or reduce label churn",
                Code.RESOURCE_EXHAUSTED,
            )
        return candidate

    async def allocate(self, labels: LabelSet, node: str, owner: str) -> IdentityAllocation:
        """Find or create the identity of ``labels`` and let ``owner`` on ``node`` hold it.

        An owner holds at most one identity per node: holding a new one drops the old
        reference in the same transaction. Reserved label sets answer their fixed
        identity and take no reference.
        """
        kind, labels, reserved = classify(labels)
        if reserved is not None:
            return IdentityAllocation(reserved, new=False)
        _check_holder(node, owner)
        canonical = str(labels)
        label_key = keys.identity_labels(canonical)
        owner_key = keys.identity_owner(node, owner)
        lease = await self._leases.lease_for(node)
        owner_id, owner_mod = self._owners.get((node, owner), (None, 0))
        known = self._by_labels.get(labels)
        replica_lease = 0
        for _ in range(MAX_ATTEMPTS):
            creating = known is None
            ident = await self._fresh_candidate(kind) if known is None else known
            id_key = keys.identity_id(ident)
            ops: list[Op] = []
            if creating and self._replica is not None:
                # Before the id key: a watcher meets the creator first, so it knows whose the announcement is.
                replica_lease = await self._replica.lease()
                ops.append(Put(keys.identity_creator(ident), self._replica.name.encode(), replica_lease))
            ops.append(Put(id_key, canonical.encode()))
            if creating:
                compares = [absent(label_key), absent(id_key), mod_is(owner_key, owner_mod)]
                ops.append(Put(label_key, str(ident).encode()))
            else:
                # Rewriting the id key (same value) marks it used for the collector.
                compares = [value_is(label_key, str(ident).encode()), mod_is(owner_key, owner_mod)]
            ops += [
                Put(keys.identity_ref(ident, node, owner), b"", lease),
                Put(owner_key, str(ident).encode(), lease),
            ]
            if owner_id is not None and owner_id != ident:
                ops.append(Delete(keys.identity_ref(owner_id, node, owner)))
            # Counted after the writes, in the same transaction: the answer needs no second round trip.
            ops.append(Get(keys.identity_refs_of(ident), prefix=True, count_only=True))
            try:
                res = await self._store.txn(compares, ops, [Get(label_key), Get(owner_key), Get(id_key)])
            except LeaseNotFound:
                # The node's lease (or this replica's) expired under us: the node's references are
                # gone, start over on new ones.
                self._leases.invalidate(node, lease)
                if self._replica is not None and replica_lease:
                    self._replica.invalidate(replica_lease)
                self._owners.pop((node, owner), None)
                owner_id, owner_mod = None, 0
                lease = await self._leases.lease_for(node)
                continue
            if res.succeeded:
                self._remember(ident, labels)
                self._owners[(node, owner)] = (ident, res.revision)
                self._held[(node, owner)] = labels
                previous = owner_id if owner_id is not None and owner_id != ident else None
                if creating:
                    log.info("identity allocated", id=ident, labels=canonical, node=node, owner=owner)
                metrics.IDENTITY_ALLOCATIONS.labels(kind.value, "created" if creating else "existing").inc()
                return IdentityAllocation(
                    Identity(ident, labels),
                    new=creating,
                    previous=previous,
                    revision=res.revision,
                    references=res.counts[0],
                )
            found_labels, found_owner, found_id = res.first(0), res.first(1), res.first(2)
            if found_owner is not None:
                owner_id, owner_mod = int(found_owner.value), found_owner.mod_revision
                self._owners[(node, owner)] = (owner_id, owner_mod)
            else:
                owner_id, owner_mod = None, 0
                self._owners.pop((node, owner), None)
            if found_labels is not None:
                known = int(found_labels.value)
                self._remember(known, labels)
            else:
                if known is not None:
                    self._forget(known)  # collected since we cached it
                known = None
            if found_id is not None and creating:
                self._remember(ident, LabelSet.parse(found_id.value.decode()))
        raise IpamError(
            f"gave up allocating an identity for {canonical} after {MAX_ATTEMPTS} conflicting transactions; retry",
            Code.ABORTED,
        )

    async def release(self, ident: int, node: str, owner: str) -> bool:
        """Drop ``owner``'s reference on ``node``; returns whether it was the last one."""
        _check_holder(node, owner)
        owner_key = keys.identity_owner(node, owner)
        res = await self._store.txn(
            [value_is(owner_key, str(ident).encode())],
            [
                Delete(keys.identity_ref(ident, node, owner)),
                Delete(owner_key),
                # Counted after the deletes, in the same transaction: no second round trip.
                Get(keys.identity_refs_of(ident), prefix=True, count_only=True),
            ],
            [Get(owner_key), Get(keys.identity_id(ident))],
        )
        if not res.succeeded:
            holding, exists = res.first(0), res.first(1)
            if exists is None:
                raise IpamError(
                    f"identity {ident} does not exist; ListIdentities shows the allocated ones", Code.NOT_FOUND
                )
            held = f"it holds identity {int(holding.value)}" if holding is not None else "it holds none"
            raise IpamError(
                f"{owner} on node {node} holds no reference on identity {ident} ({held}); nothing to release",
                Code.NOT_FOUND,
            )
        self._owners.pop((node, owner), None)
        self._held.pop((node, owner), None)
        metrics.IDENTITY_RELEASES.labels(kind_of(ident).value).inc()
        return res.counts[0] == 0

    async def release_owner(self, node: str, owner: str) -> int | None:
        """Drop whatever ``owner`` holds on ``node``; returns the identity it held."""
        for _ in range(MAX_ATTEMPTS):
            kv = await self._store.get(keys.identity_owner(node, owner))
            if kv is None:
                self._owners.pop((node, owner), None)
                self._held.pop((node, owner), None)
                return None
            try:
                await self.release(int(kv.value), node, owner)
                return int(kv.value)
            except IpamError:
                continue  # changed under us; look again
        return None

    async def retake(self, node: str) -> list[tuple[str, int | None, IdentityAllocation]]:
        """After a node's lease was lost: take every reference this process held on it again.

        Returns (owner, old id if known, allocation) for the owners whose identity changed or
        was created again, which happens only if it was collected in the meantime (the caller
        announces the identities the allocations created).
        """
        moved = []
        # References of the node this process did not take went with the lease; forget them.
        for key in [k for k in self._owners if k[0] == node and k not in self._held]:
            del self._owners[key]
        for (n, owner), labels in list(self._held.items()):
            if n != node:
                continue
            old = self._owners.pop((n, owner), (None, 0))[0]
            result = await self.allocate(labels, n, owner)
            if result.new or (old is not None and old != result.identity.id):
                moved.append((owner, old, result))
        return moved

    async def drop_node(self, node: str) -> None:
        """The node is gone: revoke its lease, which drops every reference it held."""
        await self._leases.revoke(node)
        for key in [k for k in self._held if k[0] == node]:
            del self._held[key]
        for key in [k for k in self._owners if k[0] == node]:
            del self._owners[key]

    # -- queries -----------------------------------------------------------

    async def get(self, ident: int) -> Identity | None:
        reserved = reserved_by_id(ident)
        if reserved is not None:
            return reserved
        kv = await self._store.get(keys.identity_id(ident))
        if kv is None:
            self._forget(ident)
            return None
        labels = LabelSet.parse(kv.value.decode())
        self._remember(ident, labels)
        return Identity(ident, labels)

    async def list_all(self) -> list[Identity]:
        current, _ = await self._list_ids()
        return [Identity(i, labels) for i, (labels, _) in sorted(current.items())]

    async def references(self, ident: int) -> int:
        return await self._store.count(keys.identity_refs_of(ident))

    def known_references(self, ident: int) -> int:
        """The references on ``ident`` as this process knows them (its own and the watched), without a read."""
        return self._owners.count(ident)

    async def reference_counts(self) -> dict[int, int]:
        kvs, _ = await self._store.get_prefix(keys.IDENTITY_REFS.encode(), keys_only=True)
        out: dict[int, int] = {}
        for kv in kvs:
            ident = keys.parse_identity_ref(kv.key)[0]
            out[ident] = out.get(ident, 0) + 1
        return out

    def held(self, node: str, owner: str) -> int | None:
        """The identity ``owner`` holds on ``node`` as this process knows it (loaded, taken or released here)."""
        found = self._owners.get((node, owner))
        return found[0] if found is not None else None

    def owner_keys(self) -> set[tuple[str, str]]:
        """Every (node, owner) holding a reference, as this process knows it."""
        return set(self._owners)

    def owner_nodes(self, owner: str) -> set[str]:
        """The nodes where ``owner`` holds a reference, as this process knows it (no scan)."""
        return self._owners.nodes_of(owner)

    async def holders(self, owner_prefix: str = "") -> list[Holder]:
        """Every owner key (across all processes), optionally only owners starting with ``owner_prefix``."""
        kvs, _ = await self._store.get_prefix(keys.IDENTITY_OWNERS.encode())
        out = []
        for kv in kvs:
            node, owner = keys.parse_identity_owner(kv.key)
            if owner.startswith(owner_prefix):
                out.append(Holder(node, owner, int(kv.value)))
        return out

    # -- garbage collection ------------------------------------------------

    async def collect(self, tracker: GcTracker, now: float) -> GcPass:
        """One collector pass: delete identities unreferenced for the grace period."""
        current, revision = await self._list_ids()
        refs, _ = await self._store.get_prefix(keys.IDENTITY_REFS.encode(), keys_only=True)
        referenced = {keys.parse_identity_ref(kv.key)[0] for kv in refs}
        due = tracker.observe({i: mod for i, (_, mod) in current.items()}, referenced, now)
        collected = []
        for ident, mod in due:
            labels = current[ident][0]
            label_key = keys.identity_labels(str(labels))
            id_key = keys.identity_id(ident)
            res = await self._store.txn(
                [mod_is(id_key, mod), none_under(keys.identity_refs_of(ident))],
                [
                    Delete(id_key),
                    Delete(keys.identity_creator(ident)),
                    Txn((value_is(label_key, str(ident).encode()),), (Delete(label_key),)),
                ],
            )
            tracker.forget(ident)
            if res.succeeded:
                del current[ident]
                self._forget(ident)
                self._quarantine.append(ident)
                collected.append(Identity(ident, labels))
                log.info("identity collected", id=ident, labels=str(labels), grace=tracker.grace)
        for ident, (labels, _) in current.items():
            self._remember(ident, labels)
        for ident in set(self._by_id) - set(current):
            self._forget(ident)
        return GcPass(
            {i: labels for i, (labels, _) in current.items()},
            collected,
            revision,
            {i: mod for i, (_, mod) in current.items()},
        )
