"""Policy realization: desired policy per identity into each endpoint's map (Cilium's ``pkg/endpoint/bpf.go``).

The :class:`Realizer` keeps desired and realized state apart. The desired policy of
every local identity comes from orders and resyncs (:meth:`Realizer.apply_order`,
:meth:`Realizer.apply_resync`); what each endpoint's map holds is
:attr:`Endpoint.realized`, written only here: it is the one owner of realized state
(the BPF facade below keeps none). A change is handed down as the entry delta from
the realized to the desired state, which the facade encodes and writes as it is; an
order's delta is the one :meth:`IdentityPolicy.apply` computed, so a one-entry change
costs one entry however large the map. A full sync (new endpoint, identity switch,
resync, unknown map) and the periodic :meth:`Realizer.repair` compare against the
kernel's map itself.

It runs only inside the endpoint manager's task (the manager owns the endpoint
table and calls in), so nothing here locks; BPF calls block, so they go through
``asyncio.to_thread``. It never sees protobuf: orders and resyncs arrive translated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Mapping
from typing import Protocol

from services.common.log import get_logger
from services.datapath import types as dt
from services.datapath.datapath import DatapathAPI
from services.datapath.endpoint import Endpoint, RealizedPolicy, host_prefix
from services.datapath.maps.policymap import Group, group_of

log = get_logger("realizer")


class RealizationSink(Protocol):
    """Where realized revisions go (the reporter to PolicyService)."""

    def add(self, items: Iterable[dt.Realized], arrived: float | None = None) -> None: ...

    def deleted(self, endpoint_id: int, identity: int, pod: str) -> None: ...


_versions = itertools.count(1)


def aliased(remote: int) -> bool:
    """Entries a learned address inherits from its former identity: world's and CIDRs'."""
    return remote == dt.IDENTITY_WORLD or dt.is_cidr_identity(remote)


@dataclasses.dataclass(frozen=True)
class IdentityPolicy:
    """The desired policy of one identity, and the order sequence it corresponds to.

    Immutable: :meth:`apply` returns a new version and says what changed from this one,
    so endpoints that hold this version are brought to the next by that delta alone.
    """

    identity: int
    enforcement: dt.Enforcement
    entries: Mapping[dt.PolicyKey, dt.PolicyEntry]
    sequence: int
    revision: int
    #: The entries by map group (direction, remote identity, protocol, verdict): the ones whose
    #: port blocks can coincide, which a delta must name (``keep``) to keep shared blocks right.
    groups: Mapping[Group, frozenset[dt.PolicyEntry]] = dataclasses.field(default_factory=dict)
    #: Unique per policy object; endpoints remember the version their map holds.
    version: int = dataclasses.field(default_factory=lambda: next(_versions))
    #: The version this one was derived from (0: none) and the entries that differ from it.
    base: int = 0
    added: tuple[dt.PolicyEntry, ...] = ()
    removed: tuple[dt.PolicyEntry, ...] = ()
    #: The identity's toFQDNs and DNS rules (the node's DNS proxy applies them).
    names: dt.NameRules = dt.NO_NAMES

    @functools.cached_property
    def aliased(self) -> tuple[dt.PolicyEntry, ...]:
        """Entries a learned address inherits from its former identity (world's and CIDRs'): what the
        DNS proxy needs of every endpoint of the identity, found once per version (it is immutable)."""
        return tuple(e for e in self.entries.values() if aliased(e.key.remote_identity))

    @classmethod
    def build(
        cls,
        identity: int,
        enforcement: dt.Enforcement,
        entries: Iterable[dt.PolicyEntry],
        sequence: int,
        revision: int,
        names: dt.NameRules = dt.NO_NAMES,
    ) -> IdentityPolicy:
        by_key = {e.key: e for e in entries}
        groups: dict[Group, set[dt.PolicyEntry]] = {}
        for entry in by_key.values():
            groups.setdefault(group_of(entry), set()).add(entry)
        frozen = {g: frozenset(members) for g, members in groups.items()}
        return cls(identity, enforcement, by_key, sequence, revision, frozen, names=names)

    @classmethod
    def empty(cls, identity: int, sequence: int = 0, revision: int = 0) -> IdentityPolicy:
        return cls.build(identity, dt.Enforcement(), (), sequence, revision)

    @classmethod
    def of(cls, snapshot: dt.PolicySnapshot, sequence: int, revision: int) -> IdentityPolicy:
        return cls.build(snapshot.identity, snapshot.enforcement, snapshot.entries, sequence, revision, snapshot.names)

    def apply(self, diff: dt.IdentityPolicyDiff, sequence: int, revision: int) -> IdentityPolicy:
        """This policy after ``diff`` (full replaces; otherwise removes, then adds), with the net change. Pure."""
        names = self.names if diff.names is None else diff.names
        if diff.full:
            new = IdentityPolicy.build(diff.identity, diff.enforcement, diff.add, sequence, revision, names)
            added = tuple(e for k, e in new.entries.items() if self.entries.get(k) != e)
            removed = tuple(e for k, e in self.entries.items() if new.entries.get(k) != e)
            return dataclasses.replace(new, base=self.version, added=added, removed=removed)
        entries = dict(self.entries)
        for key in diff.remove:
            entries.pop(key, None)
        for entry in diff.add:
            entries[entry.key] = entry
        touched = {*diff.remove, *(e.key for e in diff.add)}
        added_list: list[dt.PolicyEntry] = []
        removed_list: list[dt.PolicyEntry] = []
        for key in touched:
            before, after = self.entries.get(key), entries.get(key)
            if before == after:
                continue
            if before is not None:
                removed_list.append(before)
            if after is not None:
                added_list.append(after)
        groups = dict(self.groups)
        for group in {group_of(e) for e in (*added_list, *removed_list)}:
            members = (groups.get(group, frozenset()) - set(removed_list)) | {
                e for e in added_list if group_of(e) == group
            }
            if members:
                groups[group] = members
            else:
                groups.pop(group, None)
        return IdentityPolicy(
            diff.identity,
            diff.enforcement,
            entries,
            sequence,
            revision,
            groups,
            base=self.version,
            added=tuple(sorted(added_list)),
            removed=tuple(sorted(removed_list)),
            names=names,
        )

    def neighbours(self, changed: Iterable[dt.PolicyEntry], exclude: Iterable[dt.PolicyEntry]) -> list[dt.PolicyEntry]:
        """Entries of this policy in the map groups of ``changed``, except ``exclude``: the ``keep`` of a delta."""
        skip = set(exclude)
        groups = {group_of(e) for e in changed}
        return [e for g in groups for e in self.groups.get(g, ()) if e not in skip]

    def delta_from(
        self, realized: RealizedPolicy
    ) -> tuple[tuple[dt.PolicyEntry, ...], tuple[dt.PolicyEntry, ...], list[dt.PolicyEntry]]:
        """What to add, remove and keep to bring a map holding ``realized`` to this policy. Pure.

        When the map holds the version this one was derived from, that is the change
        :meth:`apply` computed (no comparison of whole maps); otherwise both are compared.
        """
        if realized.version and realized.version == self.base:
            add, remove = self.added, self.removed
        elif realized.version == self.version:
            add, remove = (), ()
        else:
            held = realized.entries
            add = tuple(e for k, e in self.entries.items() if held.get(k) != e)
            remove = tuple(e for k, e in held.items() if self.entries.get(k) != e)
        return add, remove, self.neighbours((*add, *remove), add)


class Realizer:
    """Owns the desired policy of every local identity and writes it into the endpoints' maps."""

    def __init__(self, *, datapath: DatapathAPI, endpoints: Mapping[int, Endpoint], reporter: RealizationSink) -> None:
        self._dp = datapath
        #: The manager's endpoint table (read here; the manager adds and removes endpoints).
        self._endpoints = endpoints
        self._reporter = reporter
        self.policies: dict[int, IdentityPolicy] = {}
        #: Identities whose policy is kept only because local endpoints still use them, although
        #: PolicyService no longer sends them here (removed, or missing from a resync): not
        #: trusted for new endpoints, and dropped once no endpoint uses them.
        self._orphaned: set[int] = set()
        #: Node-level position: sequence and revision of the last order or resync applied.
        self.sequence = 0
        self.revision = 0
        #: Set by the first resync; until then endpoints without a known policy wait.
        self.synced = False

    # --- desired state -------------------------------------------------------------------------

    def knows(self, identity: int) -> bool:
        """Whether the identity's policy is here and trusted (orders keep it current)."""
        return identity in self.policies and identity not in self._orphaned

    def learn(self, policy: IdentityPolicy) -> None:
        """Take an identity's policy fetched for a new endpoint, unless orders brought a newer one."""
        current = self.policies.get(policy.identity)
        if current is None or current.sequence < policy.sequence or policy.identity in self._orphaned:
            self.policies[policy.identity] = policy
            self._orphaned.discard(policy.identity)

    def _used_identities(self) -> set[int]:
        return {ep.identity for ep in self._endpoints.values()}

    def drop_orphans(self) -> None:
        """Forget kept policies no local endpoint uses any more."""
        for identity in self._orphaned - self._used_identities():
            self._orphaned.discard(identity)
            self.policies.pop(identity, None)
            log.debug("orphaned identity policy dropped", identity=identity)

    async def apply_order(self, batch: dt.OrderBatch) -> None:
        """Apply one order: update the desired policies, then write every affected endpoint's map."""
        if batch.replace:
            await self.apply_resync(batch.as_resync())
            return
        updated: dict[int, IdentityPolicy] = {}
        for diff in batch.diffs:
            current = self.policies.get(diff.identity) or IdentityPolicy.empty(diff.identity)
            if current.sequence >= batch.sequence:
                continue  # this identity was fetched after the order was made
            updated[diff.identity] = current.apply(diff, batch.sequence, batch.revision)
        used = self._used_identities()
        for identity in batch.removed:
            if identity in updated or identity not in self.policies:
                continue
            if self.policies[identity].sequence >= batch.sequence:
                continue  # fetched (so named to PolicyService) after the order was made
            if identity in used:
                # Not hosted here as far as PolicyService knows (the ipcache moved on first), yet an
                # endpoint still has it: keep enforcing what it had rather than open it up; the
                # endpoint's next report tells PolicyService, or the endpoint moves on.
                self._orphaned.add(identity)
                log.info("removed identity kept for its local endpoints", identity=identity)
            else:
                del self.policies[identity]
                self._orphaned.discard(identity)
        self.policies.update(updated)
        self._orphaned -= set(updated)
        self.sequence, self.revision = batch.sequence, batch.revision
        for ep in list(self._endpoints.values()):
            if ep.identity in updated:
                await self.realize(ep, full=False)
            elif ep.state is dt.EndpointState.READY:
                ep.realized_revision = max(ep.realized_revision, batch.revision)
        self.report(self._endpoints.values(), arrived=batch.arrived)

    async def apply_resync(self, state: dt.ResyncState) -> None:
        """Replace every desired policy with the node's whole state, then sync every endpoint's map fully."""
        fresh = {p.identity: IdentityPolicy.of(p, state.sequence, state.revision) for p in state.policies}
        orphaned = set()
        for ep in self._endpoints.values():
            if ep.identity not in fresh and ep.identity in self.policies:
                # PolicyService does not list it yet (its ipcache entry is on the way): keep what we have.
                log.info("identity missing from resync, keeping its policy", identity=ep.identity, endpoint=ep.id)
                fresh[ep.identity] = self.policies[ep.identity]
                orphaned.add(ep.identity)
        self.policies = fresh
        self._orphaned = orphaned
        self.sequence, self.revision = state.sequence, state.revision
        self.synced = True
        for ep in list(self._endpoints.values()):
            await self.realize(ep, full=True)
        self.report(self._endpoints.values())

    # --- realized state ------------------------------------------------------------------------

    async def realize(self, ep: Endpoint, *, full: bool) -> dt.PolicyChange | None:
        """Bring the endpoint's map to its identity's desired policy; returns what the write changed.

        ``full`` (or a map whose content is unknown) syncs against the kernel's map;
        otherwise only the delta from :attr:`Endpoint.realized` is written. None when the
        endpoint waits for the first resync or the write failed (the endpoint is FAILED).
        """
        desired = self.policies.get(ep.identity)
        if desired is None:
            if not self.synced:
                return None  # stays WAITING / RESTORING until the first resync
            desired = IdentityPolicy.empty(ep.identity)
        ep.state = dt.EndpointState.REGENERATING
        try:
            if full or ep.realized is None:
                change = await asyncio.to_thread(
                    self._dp.sync_policy, ep.id, desired.enforcement, list(desired.entries.values())
                )
            else:
                add, remove, keep = desired.delta_from(ep.realized)
                change = dt.PolicyChange(0, 0, enforcement_changed=False)
                if add or remove or ep.realized.enforcement != desired.enforcement:
                    change = await asyncio.to_thread(
                        self._dp.apply_policy, ep.id, desired.enforcement, add, remove, keep
                    )
        except Exception as exc:
            ep.state = dt.EndpointState.FAILED
            ep.error = f"writing the policy map failed: {exc}; the periodic repair retries"
            ep.failed_revision = max(desired.revision, self.revision)
            ep.realized = None
            log.error("policy map write failed", endpoint=ep.id, identity=ep.identity, error=str(exc))
            return None
        ep.realized = RealizedPolicy(desired.enforcement, desired.entries, desired.version)
        ep.realized_revision = max(desired.revision, self.revision)
        ep.state = dt.EndpointState.READY
        ep.error = ""
        ep.failed_revision = 0
        return change

    def report(self, endpoints: Iterable[Endpoint], arrived: float | None = None) -> None:
        """Report the realized revision of ready endpoints and the failure of those whose map write failed."""
        items = []
        for ep in endpoints:
            if ep.state is dt.EndpointState.READY and ep.realized_revision:
                items.append(dt.Realized(ep.id, ep.identity, ep.realized_revision, ep.record.key))
            elif ep.state is dt.EndpointState.FAILED and ep.failed_revision:
                items.append(dt.Realized(ep.id, ep.identity, ep.failed_revision, ep.record.key, ep.error))
        self._reporter.add(items, arrived)

    async def repair(self) -> int:
        """Sync every endpoint's map against the kernel, rewriting what drifted; returns how many drifted.

        Failed endpoints are retried here too.
        """
        repaired = 0
        for ep in list(self._endpoints.values()):
            failed = ep.state is dt.EndpointState.FAILED
            change = await self.realize(ep, full=True)
            if change is not None and (change.changed or failed):
                log.warning(
                    "policy map drifted, repaired",
                    endpoint=ep.id,
                    written=change.added,
                    removed=change.removed,
                    enforcement=change.enforcement_changed,
                )
                repaired += 1
        if repaired:
            self.report(self._endpoints.values())
        return repaired

    # --- identity changes ----------------------------------------------------------------------

    async def switch_identity(self, ep: Endpoint) -> None:
        """Move an endpoint whose record now names a new identity to it, without a window that drops allowed traffic.

        The new identity's entries are written into the endpoint's map first, then the
        endpoint's identity is switched, then the ipcache entries of its addresses.
        """
        await self.realize(ep, full=True)  # 1. the new identity's entries
        await asyncio.to_thread(self._dp.set_identity, ep.id, ep.identity)  # 2. the switch
        for ip in ep.record.ips:  # 3. what peers see
            await asyncio.to_thread(self._dp.ipcache_upsert, host_prefix(ip), ep.identity)
        self.drop_orphans()
        self.report([ep])
