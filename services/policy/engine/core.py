"""The policy service's state, with no I/O: engine, registry, ipcache, orders, realized table.

One owner (the controller task) calls these methods one at a time. Changes are
folded into an engine batch and :meth:`PolicyCore.commit` turns the batch into
per-node orders and the state to persist. Until :meth:`PolicyCore.mark_synced`
the world is half-known: everything is taken in but no order is planned; the
first commit after it sends every node its whole state.

Which identities a node hosts (so which diffs it gets) comes from the ipcache,
and from the node itself for endpoints the ipcache does not know: identities
it names in a Resync, and those of endpoints it reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.common.labels import CLUSTER_NAME_DEFAULT
from services.common.log import get_logger
from services.policy.engine.audit import AuditOverlay, full_engine, overlays, with_audit
from services.policy.engine.changes import IdentityChange, ObjectDelta, ObjectKind
from services.policy.engine.entries import MAX_IDENTITY
from services.policy.engine.errors import RequestError
from services.policy.engine.identity import Identity
from services.policy.engine.ipcache import IpcacheRecord, IpcacheTable, is_endpoint_identity
from services.policy.engine.model import (
    MODE_ANNOTATION,
    IpProto,
    NameRules,
    Policy,
    PolicyKind,
    PolicyMode,
    PolicyRef,
    PolicyValidationError,
)
from services.policy.engine.orders import OrderPlanner, PlannedOrder, PolicyEpoch
from services.policy.engine.parse import parse_policy
from services.policy.engine.policyengine import PolicyDiff, PolicyEngine
from services.policy.engine.queries import PolicyQueries
from services.policy.engine.realized import EndpointKey, Lag, RealizedTable, Report
from services.policy.engine.registry import ApiChange, Registry, StoredPolicy
from services.policy.engine.resolve import ResolvedPolicy
from services.policy.engine.selector import cidr_identity_prefixes
from services.policy.engine.sources import Source, engine_key, object_key

log = get_logger("policy")

_API_VERSIONS = {
    PolicyKind.NETWORK_POLICY: "networking.k8s.io/v1",
    PolicyKind.CILIUM_NETWORK_POLICY: "cilium.io/v2",
    PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY: "cilium.io/v2",
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one policy document."""

    source: Source
    key: PolicyRef
    accepted: bool
    error: str = ""
    document: str = ""
    policy: Policy | None = None
    #: The policy differs from the one in force (or is new): applying it makes a new revision.
    changed: bool = False


@dataclass(frozen=True, slots=True)
class Commit:
    """The result of closing a batch: orders to publish, in order, and the epoch to persist first."""

    revision: int
    orders: tuple[PlannedOrder, ...] = ()
    epoch: PolicyEpoch | None = None
    #: Imported policies to persist (or forget), in order, before the orders go out.
    api: tuple[ApiChange, ...] = ()


@dataclass(frozen=True, slots=True)
class ResyncAnswer:
    revision: int
    sequence: int
    policies: tuple[ResolvedPolicy, ...]
    #: The audit overlays of those identities that have one.
    audit: Mapping[int, AuditOverlay] = dataclasses.field(default_factory=dict)


class PolicyCore:
    def __init__(
        self, *, persisted: PolicyEpoch, cluster: str = CLUSTER_NAME_DEFAULT, bump_interval: float = 0.0
    ) -> None:
        self.cluster = cluster
        #: Least seconds between two bare revision bumps to one node (see :class:`OrderPlanner`).
        self.bump_interval = bump_interval
        self.engine = PolicyEngine(cluster=cluster)
        self.engine.seed_revision(persisted.revision)
        self.planner = OrderPlanner(persisted.sequences, bump_interval=bump_interval)
        self.ipcache = IpcacheTable()
        self.realized = RealizedTable()
        self.registry = Registry()
        self.synced = False
        self._replace_pending = False
        self._batch_open = False
        self._dirty: set[tuple[str, int]] = set()
        #: Identities nodes asked for by name in a Resync (hosted there, ipcache or not).
        self._requested: dict[str, set[int]] = {}
        #: The same, by identity: the nodes that named it. Every datapath names the identities of
        #: the endpoints it creates, so without it finding an identity's nodes walked every node,
        #: for every identity a change touched.
        self._requesters: dict[int, set[str]] = {}
        self._caused_at: float | None = None
        self._persisted = persisted
        self._api_changes: list[ApiChange] = []
        self._warm = False
        #: Each identity's audit overlay (policies in audit mode), as last sent to the nodes.
        self.audit: dict[int, AuditOverlay] = {}
        #: Namespaces annotated policy.palisade.io/mode: audit: every policy in them is audited.
        self.audit_namespaces: set[str] = set()
        #: When each node's datapath was last heard from (reports and heartbeats).
        self._seen: dict[str, float] = {}
        #: Nodes whose Node object was deleted.
        self._deleted_nodes: set[str] = set()
        #: Views, trace, preview and status: the read side (engine/queries.py).
        self.queries = PolicyQueries(self)

    # --- batching -------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        return self.engine.revision

    @property
    def batch_open(self) -> bool:
        return self._batch_open

    # --- presence: which identities each node hosts -----------------------------------------

    def hosts(self, node: str, identity: int) -> bool:
        return (
            self.ipcache.is_local(node, identity)
            or identity in self._requested.get(node, ())
            or self.realized.declares(node, identity)
        )

    def hosted(self, node: str) -> set[int]:
        return (
            self.ipcache.local_identities(node)
            | self._requested.get(node, set())
            | self.realized.declared_identities(node)
        )

    def hosting(self, identity: int) -> set[str]:
        return (
            self.ipcache.nodes_of(identity)
            | self._requesters.get(identity, set())
            | self.realized.declaring_nodes(identity)
        )

    def nodes(self) -> set[str]:
        """Nodes hosting at least one identity."""
        return set(self.ipcache.nodes()) | set(self._requested) | self.realized.declaring()

    def _audit_edit(self) -> None:
        """An audited policy changed, which the enforcing engine does not see: still a new revision,
        so that an import answers one its caller can wait for, and the nodes' orders carry it."""
        self.engine.repository.bump()

    def _change(self, now: float) -> None:
        if not self._batch_open:
            self.engine.begin_batch()
            self._batch_open = True
        if self._caused_at is None or now < self._caused_at:
            self._caused_at = now

    @property
    def warm(self) -> bool:
        return self._warm

    def mark_warm(self) -> None:
        """Inputs replayed on a replica that does not lead: from now on each commit resolves its batch.

        The replayed inputs were one batch (cheapest for a bulk load); afterwards a follower keeps
        its engine current batch by batch, so that taking over costs one commit, not a replay.
        """
        self._warm = True

    def lead(self, persisted: PolicyEpoch, imported: Iterable[tuple[StoredPolicy, str]], now: float) -> None:
        """Take over as leader: continue the stored counters, adopt the stored imported policies.

        The revision continues above both this engine's and the stored one, and takes one more
        step, so the takeover's revision is new to every datapath; the next commit sends every
        node its whole state with the node's next sequence (a fresh planner from the stored ones).
        """
        self.engine.seed_revision(persisted.revision)
        self.planner = OrderPlanner(persisted.sequences, bump_interval=self.bump_interval)
        self._persisted = persisted
        self._dirty.clear()
        stored = {policy.key: (policy, document) for policy, document in imported}
        for record in [r for r in self.registry if r.source is Source.API and r.key not in stored]:
            self.delete(Source.API, record.key, now)
        for policy, document in stored.values():
            self.restore_imported(policy, document, now)
        self._api_changes.clear()  # they are what the store holds
        self._change(now)
        self.engine.repository.bump()
        self.mark_synced(now)

    def follow(self) -> None:
        """Step down to follower: drop what only a leader keeps (the realized table, the nodes' resync
        requests, planned but unsent work); inputs stay, so the engine stays warm. A later
        :meth:`lead` starts over from the store, as a replica that never led would."""
        self.synced = False
        self._replace_pending = False
        self.realized = RealizedTable()
        self._requested.clear()
        self._requesters.clear()
        self._seen.clear()
        self._dirty.clear()
        self._api_changes.clear()

    def mark_synced(self, now: float) -> None:
        """Upstreams delivered their state: the next commit sends every node its whole state."""
        if self.synced:
            return
        self._change(now)
        self.synced = True
        self._replace_pending = True

    def _take_api_changes(self) -> tuple[ApiChange, ...]:
        changes, self._api_changes = tuple(self._api_changes), []
        return changes

    def commit(self, now: float) -> Commit:
        """Close the open batch: per-node orders and the state to persist before publishing them.

        With no batch open, a leader still sends the bumps it held back whose interval has passed.
        """
        if self.synced and not self._batch_open and self.planner.owes():
            owed = self.planner.plan_owed(revision=self.revision, now=now)
            return self._committed(self.revision, owed)
        if not self.synced or not self._batch_open:
            if self._warm and self._batch_open:
                # A follower: resolve, plan nothing (the leader's replace covers every node).
                self.engine.end_batch()
                self._batch_open = False
                self._caused_at = None
                self._dirty.clear()
                self.registry.settle(self.engine.revision)
            return Commit(self.revision, api=self._take_api_changes())
        result = self.engine.end_batch()
        self._batch_open = False
        revision = self.engine.revision
        self.registry.settle(revision)
        caused_at = self._caused_at if self._caused_at is not None else now
        self._caused_at = None
        previous = self.audit
        self.audit = self._overlays()
        diffs = dict(result.diffs)
        for identity in previous.keys() | self.audit.keys():
            if identity not in diffs and previous.get(identity) != self.audit.get(identity):
                # Only the overlay changed: an order with no enforced change carries it.
                policy = self.engine.policy_for(identity)
                enforced = (policy.ingress_enforced, policy.egress_enforced) if policy is not None else (False, False)
                diffs[identity] = PolicyDiff(identity, *enforced)
        if self._replace_pending:
            self._replace_pending = False
            orders = self.planner.plan_replace(
                revision=revision,
                nodes=self.nodes(),
                local=self.hosted,
                policy_of=self.engine.policy_for,
                caused_at=caused_at,
            )
        else:
            orders = self.planner.plan(
                revision=revision,
                diffs=diffs,
                dirty=self._dirty,
                nodes=self.nodes(),
                local_nodes=self.hosting,
                is_local=self.hosts,
                policy_of=self.engine.policy_for,
                caused_at=caused_at,
                now=now,
            )
        self._dirty.clear()
        if previous or self.audit:
            orders = with_audit(orders, previous, self.audit, self._enforced_names)
        self.realized.record_changes(revision, ((o.node, i) for o in orders for i in o.changed_identities()), caused_at)
        return self._committed(revision, orders)

    def _committed(self, revision: int, orders: list[PlannedOrder]) -> Commit:
        epoch = PolicyEpoch(revision, self.planner.sequences())
        api = self._take_api_changes()
        if epoch == self._persisted:
            return Commit(revision, tuple(orders), api=api)
        self._persisted = epoch
        return Commit(revision, tuple(orders), epoch, api)

    # --- policies -------------------------------------------------------------------------

    def apply_service_delta(self, delta: ObjectDelta, now: float) -> None:
        """A Service or EndpointSlice: the policies whose ``toServices`` name it follow."""
        obj: dict[str, Any] | None = None
        if not delta.deleted:
            if delta.error:
                log.warning(
                    "service object ignored: not JSON", name=f"{delta.namespace}/{delta.name}", error=delta.error
                )
                return
            obj = delta.body if isinstance(delta.body, dict) else None
            if obj is None:
                return
        service = delta.kind is ObjectKind.SERVICE
        if self.engine.names_services() and (
            service or self.engine.services.slice_matters(delta.namespace, delta.name, obj)
        ):
            self._change(now)  # a policy's expansion may change: its diffs go with the next commit
        if service:
            self.engine.set_service(delta.namespace, delta.name, obj)
        else:
            self.engine.set_endpoint_slice(delta.namespace, delta.name, obj)

    def apply_policy_delta(self, delta: ObjectDelta, now: float) -> Outcome | None:
        """A NetworkPolicy/CNP/CCNP from the watcher; None for kinds that are not policies."""
        if delta.kind in (ObjectKind.SERVICE, ObjectKind.ENDPOINT_SLICE):
            self.apply_service_delta(delta, now)
            return None
        if delta.kind is ObjectKind.NAMESPACE:
            self.apply_namespace_delta(delta, now)
            return None
        kind = delta.kind.policy_kind
        if kind is None:
            return None
        key = object_key(kind, delta.namespace, delta.name)
        provenance = " ".join(part for part in (delta.source or "kubernetes", delta.origin) if part)
        if delta.deleted:
            self.delete(Source.KUBERNETES, key, now)
            return Outcome(Source.KUBERNETES, key, True)
        text = delta.text
        if delta.error:
            error = f"{kind.value} {key.namespace}/{key.name}: {delta.error}"
            return self._reject(Source.KUBERNETES, key, error, text, provenance, delta.conflict)
        doc = delta.body
        if not isinstance(doc, dict):
            error = f"{kind.value} {key.name}: object_json is not a JSON object"
            return self._reject(Source.KUBERNETES, key, error, text, provenance, delta.conflict)
        # Watchers may strip type metadata; the subject already says what the object is.
        doc.setdefault("kind", kind.value)
        doc.setdefault("apiVersion", _API_VERSIONS[kind])
        return self.upsert(Source.KUBERNETES, doc, text, now, key=key, provenance=provenance, conflict=delta.conflict)

    def audited(self, policy: Policy) -> bool:
        """Whether ``policy`` is in audit mode: its own annotation, or its namespace's."""
        return policy.mode is PolicyMode.AUDIT or (
            policy.key.kind is not PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY
            and policy.key.namespace in self.audit_namespaces
        )

    def apply_namespace_delta(self, delta: ObjectDelta, now: float) -> None:
        """A Namespace: its ``policy.palisade.io/mode`` annotation puts all its policies in audit
        (or back to their own mode); the policies move out of (or into) the enforcing engine."""
        audit = False
        if not delta.deleted and isinstance(delta.body, dict):
            meta = delta.body.get("metadata")
            annotations = meta.get("annotations") if isinstance(meta, dict) else None
            value = annotations.get(MODE_ANNOTATION) if isinstance(annotations, dict) else None
            if value is not None and str(value).strip().lower() not in {m.value for m in PolicyMode}:
                log.warning(
                    "namespace mode annotation not understood: its policies keep their own mode",
                    namespace=delta.name,
                    value=str(value),
                    fix=f"set {MODE_ANNOTATION} to enforce or audit",
                )
            audit = str(value).strip().lower() == PolicyMode.AUDIT.value if value is not None else False
        if audit == (delta.name in self.audit_namespaces):
            return
        if audit:
            self.audit_namespaces.add(delta.name)
        else:
            self.audit_namespaces.discard(delta.name)
        log.info("namespace mode changed", namespace=delta.name, mode="audit" if audit else "own")
        for record in self.registry.search(delta.name):
            policy = record.policy
            if policy is None or policy.key.namespace != delta.name:
                continue
            key = engine_key(record.source, record.key)
            held = self.engine.declared_policy(key) is not None
            wanted = not self.audited(policy)
            if held == wanted:
                continue
            self._change(now)
            if wanted:
                self.engine.upsert_policy(dataclasses.replace(policy, key=key))
            else:
                self.engine.delete_policy(key)
            self.registry.accepted(
                record.source, record.key, policy, record.document, changed=True, origin=record.origin,
                conflict=record.conflict,
            )  # fmt: skip

    def upsert(
        self,
        source: Source,
        doc: Mapping[str, Any],
        document: str,
        now: float,
        *,
        key: PolicyRef | None = None,
        origin: str = "",
        provenance: str = "",
        conflict: str = "",
        dry_run: bool = False,
        restoring: bool = False,
        parsed: Policy | None = None,
    ) -> Outcome:
        """Parse and enforce one document; a rejected one changes nothing but its error.

        ``origin`` prefixes errors (the file and document index); ``provenance`` is where the
        object came from, shown in its status; ``conflict`` says which other definitions of the
        object its source ignores (shown as its error). An accepted API document is persisted with the
        next commit, unless it is being ``restoring`` from the store. ``parsed`` is the policy a
        ``dry_run`` of the same document returned (it is not parsed twice).
        """
        try:
            if parsed is None:
                parsed = parse_policy(doc, cluster=self.cluster)
        except PolicyValidationError as exc:
            error = f"{origin}: {exc}" if origin else str(exc)
            rk = key or _key_of(doc)
            if dry_run:
                return Outcome(source, rk, False, error, document)
            if source is Source.API and not restoring:
                # The caller sees the error in its answer; an import that fails changes nothing.
                log.warning("policy rejected", source=source.value, policy=str(rk), error=error)
                return Outcome(source, rk, False, error, document)
            return self._reject(source, rk, error, document, provenance, conflict)
        key = key or parsed.key
        policy = dataclasses.replace(parsed, key=engine_key(source, key))
        audited = self.audited(policy)
        if audited:
            # In audit: kept and shown, never in the enforcing engine (an enforced version leaves it).
            held = self.engine.declared_policy(policy.key) is not None
            record = self.registry.get(source, key)
            changed = held or record is None or record.policy != policy
        else:
            held = changed = self.engine.declared_policy(policy.key) != policy
        if dry_run:
            return Outcome(source, key, True, "", document, parsed, changed)
        if changed:
            self._change(now)
            if audited:
                if held:
                    self.engine.delete_policy(policy.key)
                else:
                    self._audit_edit()
            else:
                self.engine.upsert_policy(policy)
        old = self.registry.get(source, key)
        if (
            source is Source.API
            and not restoring
            and (changed or old is None or (old.document, old.origin) != (document, provenance))
        ):
            self._api_changes.append((key, StoredPolicy(key, dict(doc), provenance)))
        self.registry.accepted(source, key, policy, document, changed=changed, origin=provenance, conflict=conflict)
        if changed:
            log.info("policy accepted", source=source.value, policy=str(key), unsupported=len(policy.unsupported))
        else:
            log.debug("policy unchanged", source=source.value, policy=str(key))
        return Outcome(source, key, True, "", document, policy, changed)

    def restore_imported(self, stored: StoredPolicy, document: str, now: float) -> Outcome:
        """An API policy loaded from the store at startup (a rejected one stays visible with its error)."""
        return self.upsert(
            Source.API, stored.object, document, now, key=stored.key, provenance=stored.origin, restoring=True
        )

    def _reject(
        self, source: Source, key: PolicyRef, error: str, document: str, provenance: str = "", conflict: str = ""
    ) -> Outcome:
        self.registry.rejected(source, key, error, document, origin=provenance, conflict=conflict)
        log.warning("policy rejected", source=source.value, policy=str(key), error=error)
        return Outcome(source, key, False, error, document)

    def delete(self, source: Source, key: PolicyRef, now: float) -> bool:
        """Remove a policy; False when this source has no such object."""
        record = self.registry.remove(source, key)
        if record is None:
            return False
        if source is Source.API:
            self._api_changes.append((key, None))
        if record.policy is not None:
            self._change(now)
            if self.engine.declared_policy(engine_key(source, key)) is None:
                self._audit_edit()  # an audited policy: never in the enforcing engine
            self.engine.delete_policy(engine_key(source, key))
        log.info("policy deleted", source=source.value, policy=str(key))
        return True

    # --- identities and ipcache -------------------------------------------------------------

    def apply_identity(self, update: IdentityChange, now: float) -> None:
        number = update.number
        if update.deleted:
            for node in sorted(self._requesters.pop(number, ())):
                requested = self._requested.get(node)
                if requested is not None and number in requested:
                    requested.discard(number)
                    # The node stops holding it at the next commit, even if the identity is
                    # allocated again before then (its diff may then be empty).
                    self._dirty.add((node, number))
                    self._change(now)
            if self.engine.identity(number) is not None:
                self._change(now)
                self.engine.remove_identity(number)
            return
        if not 0 < number <= MAX_IDENTITY:
            log.warning(
                "identity ignored: outside the identities the engine holds; allocate identities in ipam's ranges",
                identity=number,
                limit=MAX_IDENTITY,
            )
            return
        identity = Identity(number, update.labels)
        if self.engine.identity(number) == identity:
            return
        self._change(now)
        self.engine.upsert_identity(identity)

    def apply_ipcache(self, key: str, record: IpcacheRecord | None, now: float) -> None:
        """The ipcache entry under ``key`` (one per prefix) is now ``record``; None: deleted."""
        delta = self.ipcache.delete(key) if record is None else self.ipcache.upsert(key, record)
        old, new = delta.old, delta.new
        if old == new:
            return
        self._change(now)
        if old is not None and old.ip is not None and (new is None or new.ip != old.ip):
            self.engine.delete_ipcache(old.ip)
        if new is not None and new.ip is not None:
            self.engine.upsert_ipcache(new.ip, new.identity)
        for identity in delta.ports_changed:
            self.engine.set_named_ports(identity, _port_tuples(self.ipcache.named_ports(identity)))
        for r in (old, new):
            if r is None or not r.node or not is_endpoint_identity(r.identity):
                continue
            self._dirty.add((r.node, r.identity))
            ep = r.endpoint
            if ep is not None:
                declared = self.realized.identity_of(*ep)
                current = self.ipcache.endpoint_identity(*ep)
                if current is None:
                    self.realized.remove_endpoint(*ep)
                else:
                    self.realized.upsert_endpoint(ep[0], ep[1], current, self.engine.committed_revision)
                if declared is not None and declared != current:
                    # The datapath's word for this endpoint gave way to the ipcache's.
                    self._dirty.add((ep[0], declared))
            if not self.hosts(r.node, r.identity):
                self.realized.drop_changes(r.node, r.identity)

    # --- nodes joining and leaving -------------------------------------------------------

    def node_seen(self, node: str, now: float) -> None:
        """The node's datapath spoke (a report or a heartbeat): it counts again if it had gone."""
        self._seen[node] = now
        if node not in self._deleted_nodes and self.realized.set_gone(node, False):
            log.info("node back", node=node)

    def apply_node_delta(self, name: str, *, deleted: bool) -> None:
        """A Node object: deleting it takes the node out of every count until it is back."""
        if deleted:
            self._deleted_nodes.add(name)
            if self.realized.set_gone(name, True):
                log.info("node gone: its Node object was deleted", node=name)
        else:
            self._deleted_nodes.discard(name)

    def expire_nodes(self, now: float, grace: float) -> None:
        """Nodes whose datapath has been silent for over ``grace`` seconds stop counting."""
        for node in self.realized.nodes():
            last = self._seen.setdefault(node, now)  # first seen now: the grace starts here
            if now - last > grace and self.realized.set_gone(node, True):
                log.warning("node gone: its datapath is silent", node=node, silent_s=round(now - last, 1))

    # --- realized revisions -----------------------------------------------------------------

    def report(self, reports: Iterable[Report], now: float) -> list[tuple[int, float]]:
        """Apply realized reports; returns (revision, caused_at) of revisions now fully realized."""
        batch = list(reports)
        current = self.revision
        for i, r in enumerate(batch):
            if not r.deleted and r.revision > current:
                raise RequestError(
                    f"reports[{i}]: revision {r.revision} is above the current revision {current}; "
                    "report only revisions received in orders"
                )
        done: list[tuple[int, float]] = []
        for node in {r.node for r in batch}:
            self.node_seen(node, now)
        # Once per batch: a cluster-wide change brings a report of every endpoint of the cluster.
        realized = self.realized
        committed = self.engine.committed_revision
        for r in batch:
            if r.deleted:
                gone = realized.forget(r)
                if gone is not None and not self.hosts(gone.node, gone.identity):
                    self._change(now)
                    self._dirty.add((gone.node, gone.identity))
                continue
            if r.error:
                log.warning(
                    "realization failed",
                    node=r.node,
                    pod=r.pod,
                    endpoint=r.endpoint_id,
                    identity=r.identity,
                    revision=r.revision,
                    error=r.error,
                )
            known = self.hosts(r.node, r.identity)
            key = realized.key_of(r)
            before = realized.identity_of(*key)
            finished = realized.report(r, committed, key)
            if finished:
                done.extend(finished)
            if before is not None and before != r.identity and not self.hosts(r.node, before):
                self._change(now)
                self._dirty.add((r.node, before))
            if not known and is_endpoint_identity(r.identity):
                # A node hosts an identity nobody told us about (we restarted, or its pod is not in
                # the ipcache): send it the policy under a new revision, so the revision it just
                # reported, realized without that policy, does not count as realizing it.
                self._change(now)
                self.engine.repository.bump()
                self._dirty.add((r.node, r.identity))
        return done

    def wait_state(self, revision: int) -> list[Lag]:
        """Endpoints that ``revision`` affects and that have not realized it (empty: realized)."""
        return self.realized.behind(revision)

    def wait_settled(self, revision: int, left: list[EndpointKey] | None = None) -> tuple[bool, list[EndpointKey]]:
        """Whether a wait for ``revision`` is over, cheaply (see :meth:`RealizedTable.settled`)."""
        return self.realized.settled(revision, left)

    # --- read side ----------------------------------------------------------------------------

    def resync(self, node: str, identities: Iterable[int] = ()) -> ResyncAnswer:
        """The whole policy of a node's identities, consistent with its last order sequence.

        Naming identities also records that the node hosts them: from now on its orders
        carry their diffs, whether the ipcache knows their endpoints or not.
        """
        wanted = {i for i in identities if is_endpoint_identity(i)}
        if wanted:
            self._requested.setdefault(node, set()).update(wanted)
            for identity in wanted:
                self._requesters.setdefault(identity, set()).add(node)
            for identity in wanted:
                if self.engine.policy_for(identity) is not None:
                    self.planner.adopt(node, identity)
        held = self.planner.delivered(node)
        chosen = sorted(held & wanted if wanted else held)
        policies = []
        for identity in chosen:
            policy = self.engine.policy_for(identity)
            if policy is not None:
                policies.append(policy)
        return ResyncAnswer(
            self.revision,
            self.planner.sequence(node),
            tuple(policies),
            {p.identity: self.audit[p.identity] for p in policies if p.identity in self.audit},
        )

    def _enforced_names(self, identity: int) -> NameRules:
        policy = self.engine.policy_for(identity)
        return policy.names if policy is not None else NameRules()

    def policy_of(self, identity: int) -> ResolvedPolicy | None:
        return self.engine.policy_for(identity)

    def audited_policies(self) -> list[Policy]:
        """Every policy in audit mode, keyed as the engine would key it (in the registry's order).

        Asked on every commit: the scan is unordered and only the few audited records are sorted."""
        found = [r for r in self.registry.unordered() if r.policy is not None and self.audited(r.policy)]
        found.sort(key=lambda r: (r.key, r.source))
        return [dataclasses.replace(r.policy, key=engine_key(r.source, r.key)) for r in found if r.policy is not None]

    def cidr_prefixes(self) -> frozenset[str]:
        """Every prefix the accepted policies name in CIDR rules and excepts (audited ones too, whose
        would-be verdicts need the same identities), world (``/0``) excepted: each needs a CIDR identity."""
        out = set(self.engine.cidr_identity_prefixes())
        for policy in self.audited_policies():
            out |= cidr_identity_prefixes(policy.referenced_selectors())
        return frozenset(out)

    def _overlays(self) -> dict[int, AuditOverlay]:
        audited = self.audited_policies()
        if not audited:
            return {}
        return overlays(self.engine, full_engine(self.engine, audited))


def _key_of(doc: Mapping[str, Any]) -> PolicyRef:
    """Best-effort key of a document that failed to parse, for its status."""
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    kind_text = str(doc.get("kind") or "")
    try:
        kind = PolicyKind(kind_text)
    except ValueError:
        kind = PolicyKind.NETWORK_POLICY
    return object_key(kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _port_tuples(ports: Mapping[str, frozenset[tuple[IpProto, int]]]) -> dict[str, list[tuple[IpProto, int]]]:
    return {name: sorted(values) for name, values in ports.items()}
