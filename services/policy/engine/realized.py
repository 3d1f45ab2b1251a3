"""Realized revisions: which endpoint enforces which revision, who is behind, status roll-up.

Pure bookkeeping. Endpoints come from the ipcache (pods on nodes) and from the
datapaths' reports. A revision *affects* an endpoint when some order up to that
revision changed the policy of the endpoint's identity on its node after the
endpoint appeared and after the revision it last realized. Revision bumps (orders
with no diff for an identity) affect nobody, like Cilium's endpointsToBumpRevision:
an endpoint need not report them, and one that never reported is behind only the
changes made since it appeared, not every revision (with bumps held back, an
endpoint with nothing to realize may report nothing for a long time). A new
endpoint's first policy is such a change: the full policy an order brings when its
identity comes to the node, or, when the node already held it (fetched by the
datapath for the endpoint, or another endpoint of that identity), the commit that
made the endpoint known if the node's history of that identity holds no change yet.

A datapath may report that an endpoint could not realize a revision (its maps
could not be written): the endpoint keeps its last realized revision and is
*failed* for every revision that brings it nothing newer than the one that
failed, until it reports success, like Antrea's Failed realization status.

Endpoints a datapath reports that the ipcache does not know (pods created on a
node directly) *declare* their identity present on that node, so orders carry
its diffs there; the datapath reports such an endpoint ``deleted`` when it goes.

Policy implementation delay: for every revision whose orders changed some
endpoint's policy, the time from the change's arrival until the last of those
endpoints reported it (Cilium's policy implementation delay).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

EndpointKey = tuple[str, str]

#: Revisions tracked for implementation delay at once; older ones are given up.
MAX_PENDING_REVISIONS = 4096
#: Change revisions kept per (node, identity) before pruning below the lowest realized one.
_PRUNE_AT = 64


@dataclass(slots=True)
class Endpoint:
    """One endpoint as far as realization goes."""

    node: str
    #: "namespace/name" of the pod, or "#<endpoint id>" when a datapath reported no pod.
    key: str
    identity: int
    #: Revision current when the endpoint became known; from the first commit after, that commit's:
    #: the changes of its identity's policy above it are the ones it must realize.
    since: int
    endpoint_id: int = 0
    #: Highest revision reported for ``identity``; 0 when none yet.
    realized: int = 0
    #: Known from the ipcache (authoritative for identity and lifetime).
    in_ipcache: bool = False
    #: Revision the datapath last failed to realize (0: no failure since the last success).
    failed: int = 0
    #: Why, as the datapath reported it.
    error: str = ""
    #: Revision of its first policy, which it must realize (0: none); see :meth:`RealizedTable.record_changes`.
    first: int = 0

    @property
    def pod(self) -> str:
        return "" if self.key.startswith("#") else self.key


@dataclass(frozen=True, slots=True)
class Lag:
    """An endpoint behind a wanted revision."""

    node: str
    endpoint_id: int
    identity: int
    realized: int
    pod: str
    #: Why the endpoint could not realize the wanted revision (empty: still realizing).
    error: str = ""
    #: The revision whose realization failed.
    failed: int = 0

    def describe(self) -> str:
        where = f"{self.node}/{self.pod or f'endpoint {self.endpoint_id}'}"
        if self.error:
            return f"{where} failed to realize revision {self.failed}: {self.error}"
        return f"{where} at revision {self.realized}"


@dataclass(frozen=True, slots=True)
class NodeRollup:
    node: str
    endpoints: int
    endpoints_realized: int
    #: Lowest revision realized by the node's affected endpoints.
    realized_revision: int
    endpoints_failed: int = 0


@dataclass(frozen=True, slots=True)
class Rollup:
    """Realization of one policy revision over the endpoints of its subject identities."""

    nodes: tuple[NodeRollup, ...] = ()
    #: Endpoints that failed to realize the revision, sorted.
    failures: tuple[Lag, ...] = ()

    @property
    def realized(self) -> bool:
        return all(n.endpoints_realized == n.endpoints for n in self.nodes)

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    @property
    def nodes_realized(self) -> int:
        return sum(1 for n in self.nodes if n.endpoints_realized == n.endpoints)


@dataclass(frozen=True, slots=True)
class Report:
    """One realized report from a datapath."""

    node: str
    endpoint_id: int
    identity: int
    revision: int
    pod: str = ""
    deleted: bool = False
    #: Non-empty: the endpoint could not realize ``revision``, and why.
    error: str = ""


@dataclass(slots=True)
class _Pending:
    caused_at: float
    waiting: set[EndpointKey] = field(default_factory=set)


class RealizedTable:
    def __init__(self) -> None:
        self._endpoints: dict[EndpointKey, Endpoint] = {}
        self._by_identity: dict[int, set[EndpointKey]] = {}
        #: The endpoints of each identity on each node: what a change of (node, identity) waits for,
        #: found without walking the identity's endpoints on every other node (an identity spread
        #: over N nodes made a cluster-wide change cost N x N).
        self._by_pair: dict[tuple[str, int], set[EndpointKey]] = {}
        self._by_node_id: dict[tuple[str, int], EndpointKey] = {}
        self._declared: dict[str, Counter[int]] = {}
        self._changes: dict[tuple[str, int], list[int]] = {}
        self._pending: dict[int, _Pending] = {}
        #: Nodes that left (Node deleted, or datapath silent past the grace): not counted.
        self._gone: set[str] = set()
        #: Every endpoint whose last report was a failure (and maybe some since recovered or gone:
        #: pruned as :meth:`settled` meets them), so a wait finds failures without a scan.
        self._failing: set[EndpointKey] = set()
        #: Endpoints that appeared (or changed identity) since the last :meth:`record_changes`.
        self._appearing: set[EndpointKey] = set()

    def __len__(self) -> int:
        return len(self._endpoints)

    # --- nodes ----------------------------------------------------------------------------

    def nodes(self) -> set[str]:
        """Nodes with endpoints."""
        return {node for node, _ in self._endpoints}

    def set_gone(self, node: str, gone: bool) -> bool:
        """Count ``node``'s endpoints (``gone`` False) or not; True when that changed."""
        if gone == (node in self._gone):
            return False
        if gone:
            self._gone.add(node)
        else:
            self._gone.discard(node)
        return True

    @property
    def gone(self) -> frozenset[str]:
        return frozenset(self._gone)

    # --- endpoints ----------------------------------------------------------------------

    def upsert_endpoint(self, node: str, pod: str, identity: int, revision: int) -> None:
        """An endpoint seen in the ipcache (new, or its identity changed)."""
        ep = self._endpoints.get((node, pod))
        if ep is None:
            self._add(Endpoint(node, pod, identity, since=revision, in_ipcache=True))
            self._appearing.add((node, pod))
            return
        self._unindex(ep)
        ep.in_ipcache = True
        if ep.identity != identity:
            ep.identity = identity
            ep.realized = 0
            ep.since = revision
            ep.first = 0
            ep.failed, ep.error = 0, ""
            self._appearing.add((node, pod))
        self._index(ep)

    def remove_endpoint(self, node: str, key: str) -> Endpoint | None:
        ep = self._endpoints.pop((node, key), None)
        if ep is None:
            return None
        self._unindex(ep)
        for pending in self._pending.values():
            pending.waiting.discard((node, key))
        for revision in [r for r, p in self._pending.items() if not p.waiting]:
            del self._pending[revision]
        return ep

    def forget(self, report: Report) -> Endpoint | None:
        """A datapath deleted an endpoint; returns what it was, if known."""
        key = self.key_of(report)
        return self.remove_endpoint(*key)

    def identity_of(self, node: str, key: str) -> int | None:
        ep = self._endpoints.get((node, key))
        return ep.identity if ep is not None else None

    def declares(self, node: str, identity: int) -> bool:
        """Whether an endpoint the ipcache does not know puts ``identity`` on ``node``."""
        return identity in self._declared.get(node, ())

    def declared_identities(self, node: str) -> set[int]:
        return set(self._declared.get(node, ()))

    def declaring_nodes(self, identity: int) -> set[str]:
        return {node for node, ids in self._declared.items() if identity in ids}

    def declaring(self) -> set[str]:
        return set(self._declared)

    def endpoints_of(self, node: str, identity: int) -> list[EndpointKey]:
        """The endpoints of ``identity`` on ``node``, sorted."""
        return sorted(self._by_pair.get((node, identity), ()))

    def drop_changes(self, node: str, identity: int) -> None:
        """The identity left the node: its change history there is no longer needed."""
        self._changes.pop((node, identity), None)

    def _add(self, ep: Endpoint) -> None:
        self._endpoints[(ep.node, ep.key)] = ep
        self._index(ep)

    def _index(self, ep: Endpoint) -> None:
        key = (ep.node, ep.key)
        self._by_identity.setdefault(ep.identity, set()).add(key)
        self._by_pair.setdefault((ep.node, ep.identity), set()).add(key)
        if ep.endpoint_id:
            self._by_node_id[(ep.node, ep.endpoint_id)] = key
        if not ep.in_ipcache:
            self._declared.setdefault(ep.node, Counter())[ep.identity] += 1

    def _unindex(self, ep: Endpoint) -> None:
        key = (ep.node, ep.key)
        bucket = self._by_identity.get(ep.identity)
        if bucket is not None:
            bucket.discard(key)
            if not bucket:
                del self._by_identity[ep.identity]
        pair = self._by_pair.get((ep.node, ep.identity))
        if pair is not None:
            pair.discard(key)
            if not pair:
                del self._by_pair[(ep.node, ep.identity)]
        if ep.endpoint_id and self._by_node_id.get((ep.node, ep.endpoint_id)) == key:
            del self._by_node_id[(ep.node, ep.endpoint_id)]
        if not ep.in_ipcache:
            counts = self._declared.get(ep.node)
            if counts is not None:
                counts[ep.identity] -= 1
                if counts[ep.identity] <= 0:
                    del counts[ep.identity]
                if not counts:
                    del self._declared[ep.node]

    # --- changes and reports ------------------------------------------------------------

    def record_changes(self, revision: int, pairs: Iterable[tuple[str, int]], caused_at: float) -> None:
        """Orders at ``revision`` changed the policy of these (node, identity) pairs.

        The endpoints that appeared since the last call count their changes from here on. This
        commit brings the first policy of those whose identity it changed on their node (an
        identity new to the node comes with its whole policy), and of those whose node has no
        change of their identity recorded (the datapath fetched the policy for the endpoint): a
        change each must realize. Others found their identity's policy on their node already;
        only its later changes wait for them.
        """
        waiting: set[EndpointKey] = set()
        pairs = set(pairs)
        appearing, self._appearing = self._appearing, set()
        for key in appearing:
            ep = self._endpoints.get(key)
            if ep is None:
                continue
            pair = (ep.node, ep.identity)
            ep.since = max(ep.since, revision)
            if ep.realized < revision and (pair in pairs or not self._changes.get(pair)):
                ep.first = revision
                waiting.add(key)
        for pair in pairs:
            revs = self._changes.setdefault(pair, [])
            if not revs or revs[-1] < revision:
                revs.append(revision)
            if len(revs) > _PRUNE_AT:
                self._prune(pair, revs)
            for key in self._by_pair.get(pair, ()):
                if self._endpoints[key].realized < revision:
                    waiting.add(key)
        if waiting:
            self._pending[revision] = _Pending(caused_at, waiting)
            while len(self._pending) > MAX_PENDING_REVISIONS:
                del self._pending[next(iter(self._pending))]

    def _prune(self, pair: tuple[str, int], revs: list[int]) -> None:
        realized = [self._endpoints[k].realized for k in self._by_pair.get(pair, ())]
        floor = min(realized, default=0)
        keep = bisect.bisect_right(revs, floor)
        # Keep the newest change at or below the floor: a late endpoint still needs it.
        del revs[: max(0, keep - 1)]

    def report(self, report: Report, current_revision: int, key: EndpointKey | None = None) -> list[tuple[int, float]]:
        """Apply one report; returns (revision, caused_at) of revisions now fully realized.

        ``key`` is :meth:`key_of` the report, when the caller has it already."""
        key = self._resolve(report, current_revision, key)
        ep = self._endpoints[key]
        if ep.identity != report.identity:
            return []  # realized an identity the endpoint no longer has
        if report.revision <= ep.realized:
            return []
        if report.error:
            if report.revision >= ep.failed:
                ep.failed = report.revision
                ep.error = report.error
                self._failing.add(key)
            return []
        if report.revision >= ep.failed:
            ep.failed = 0
            ep.error = ""
        ep.realized = report.revision
        done: list[tuple[int, float]] = []
        # Pending revisions are in ascending order (recorded as they come): only those up to
        # the one realized wait for this endpoint.
        for revision, pending in self._pending.items():
            if revision > ep.realized:
                break
            pending.waiting.discard(key)
            if not pending.waiting:
                done.append((revision, pending.caused_at))
        for revision, _ in done:
            del self._pending[revision]
        return done

    def key_of(self, report: Report) -> EndpointKey:
        if report.pod:
            return (report.node, report.pod)
        found = self._by_node_id.get((report.node, report.endpoint_id))
        return found if found is not None else (report.node, f"#{report.endpoint_id}")

    def _resolve(self, report: Report, current_revision: int, key: EndpointKey | None = None) -> EndpointKey:
        """Find (or create) the endpoint a report is about (``key``: :meth:`key_of` it, if known)."""
        if key is None:
            key = self.key_of(report)
        ep = self._endpoints.get(key)
        if ep is None:
            # Not (or not yet) in the ipcache: the datapath's word is all there is.
            self._add(
                Endpoint(report.node, key[1], report.identity, since=current_revision, endpoint_id=report.endpoint_id)
            )
            self._appearing.add(key)
            return key
        changed_id = bool(report.endpoint_id) and ep.endpoint_id != report.endpoint_id
        relabeled = not ep.in_ipcache and ep.identity != report.identity
        if changed_id or relabeled:
            self._unindex(ep)
            if changed_id:
                ep.endpoint_id = report.endpoint_id
            if relabeled:
                ep.identity = report.identity
                ep.realized = 0
                ep.since = current_revision
                ep.first = 0
                ep.failed, ep.error = 0, ""
                self._appearing.add(key)
            self._index(ep)
        return key

    # --- queries ------------------------------------------------------------------------

    def is_behind(self, ep: Endpoint, revision: int) -> bool:
        """Whether ``revision`` affects ``ep`` and ``ep`` has not realized it: a change of its
        identity's policy on its node, made after it appeared and after what it realized, is at
        or below ``revision``. An endpoint that never reported is no exception: it waits for
        the changes made since it appeared (its first policy among them), not for every revision."""
        if ep.realized >= revision:
            return False
        if ep.realized < ep.first <= revision:
            return True
        if ep.since >= revision:
            return False
        revs = self._changes.get((ep.node, ep.identity))
        if not revs:
            return False
        i = bisect.bisect_right(revs, max(ep.realized, ep.since))
        return i < len(revs) and revs[i] <= revision

    def has_failed(self, ep: Endpoint, revision: int) -> bool:
        """Whether ``ep`` is behind ``revision`` because its datapath failed to realize it.

        A failure at revision F covers every revision up to the next change of the
        endpoint's policy after F: those bring it nothing its datapath has not failed on.
        """
        if not ep.failed or not self.is_behind(ep, revision):
            return False
        if ep.failed >= revision:
            return True
        revs = self._changes.get((ep.node, ep.identity), [])
        i = bisect.bisect_right(revs, ep.failed)
        return not (i < len(revs) and revs[i] <= revision)

    def _lag(self, ep: Endpoint, revision: int) -> Lag:
        if self.has_failed(ep, revision):
            return Lag(ep.node, ep.endpoint_id, ep.identity, ep.realized, ep.pod, ep.error, ep.failed)
        return Lag(ep.node, ep.endpoint_id, ep.identity, ep.realized, ep.pod)

    def behind(self, revision: int) -> list[Lag]:
        """Endpoints that ``revision`` affects and that have not reported it, sorted."""
        gone, is_behind = self._gone, self.is_behind
        out = [
            self._lag(ep, revision)
            for ep in self._endpoints.values()
            if ep.realized < revision and ep.node not in gone and is_behind(ep, revision)
        ]
        out.sort(key=lambda lag: (lag.node, lag.pod, lag.endpoint_id))
        return out

    def settled(self, revision: int, left: list[EndpointKey] | None = None) -> tuple[bool, list[EndpointKey]]:
        """Whether a wait for ``revision`` is over: nobody is behind it, or somebody failed to realize it.

        The same answer as looking at :meth:`behind`, without building it each time: a wait
        checks after every batch of reports, and a scan of every endpoint per check is what made
        a cluster-wide change slow to confirm at thousands of nodes. ``left`` (what the previous
        call returned) holds the endpoints found behind; each check drops those that have
        realized since, from its end, and stops at the first still behind, so a whole wait
        looks at each endpoint a few times in all. Settled is only ever answered after a full
        scan finds nobody behind (a node back from gone may have brought some).
        """
        for key in list(self._failing):
            ep = self._endpoints.get(key)
            if ep is None or not ep.failed:
                self._failing.discard(key)
            elif ep.node not in self._gone and self.has_failed(ep, revision):
                return True, []
        fresh = left is None
        if left is None:
            left = self._behind_keys(revision)
        while True:
            while left:
                ep = self._endpoints.get(left[-1])
                if ep is not None and self._counts_behind(ep, revision):
                    return False, left
                left.pop()
            if fresh:
                return True, []
            left, fresh = self._behind_keys(revision), True

    def _behind_keys(self, revision: int) -> list[EndpointKey]:
        # The first test inline: once a change is realized, every endpoint of the cluster passes it.
        gone, is_behind = self._gone, self.is_behind
        return [
            key
            for key, ep in self._endpoints.items()
            if ep.realized < revision and ep.node not in gone and is_behind(ep, revision)
        ]

    def _counts_behind(self, ep: Endpoint, revision: int) -> bool:
        return ep.node not in self._gone and self.is_behind(ep, revision)

    def rollup(self, subjects: Iterable[int], revision: int) -> Rollup:
        """Per node, how many endpoints of these identities realized ``revision``."""
        per_node: dict[str, list[Endpoint]] = {}
        for identity in subjects:
            for key in self._by_identity.get(identity, ()):
                ep = self._endpoints[key]
                if ep.node not in self._gone:
                    per_node.setdefault(ep.node, []).append(ep)
        nodes = []
        failures = []
        is_behind = self.is_behind
        for node in sorted(per_node):
            eps = per_node[node]
            # One pass per node: a policy selecting every pod rolls up every endpoint of the cluster.
            realized = 0
            failed = []
            for ep in eps:
                if ep.realized >= revision or not is_behind(ep, revision):
                    realized += 1
                elif ep.failed and self.has_failed(ep, revision):
                    failed.append(self._lag(ep, revision))
            failures.extend(failed)
            nodes.append(NodeRollup(node, len(eps), realized, min(ep.realized for ep in eps), len(failed)))
        failures.sort(key=lambda lag: (lag.node, lag.pod, lag.endpoint_id))
        return Rollup(tuple(nodes), tuple(failures))
