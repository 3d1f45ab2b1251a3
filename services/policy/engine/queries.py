"""The read side of the policy state: policy views with their realization, trace, the preview of
a change, and status. Answers only; every change goes through :class:`~.core.PolicyCore`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.labels import LabelSet, LabelSource, parse_label
from services.policy.engine.errors import RequestError
from services.policy.engine.ipcache import is_endpoint_identity
from services.policy.engine.model import IPAddress, IpProto, Policy, PolicyRef, PolicyValidationError
from services.policy.engine.names import DnsDecision
from services.policy.engine.parse import parse_policy
from services.policy.engine.preview import DiffProbe, ObservedFlow, Preview, preview
from services.policy.engine.realized import Rollup
from services.policy.engine.registry import PolicyRecord
from services.policy.engine.sources import Source, engine_key
from services.policy.engine.trace import TraceEndpoint, TraceResult, address_endpoint, dns_query, trace

if TYPE_CHECKING:
    from services.policy.engine.core import PolicyCore


@dataclass(frozen=True, slots=True)
class PolicyView:
    """One policy with its realization, for status answers."""

    record: PolicyRecord
    subjects: tuple[int, ...]
    rollup: Rollup
    #: In audit mode (its own annotation or its namespace's).
    audited: bool = False


@dataclass(frozen=True, slots=True)
class TraceAnswer:
    result: TraceResult
    source_identity: int
    destination_identity: int


@dataclass(frozen=True, slots=True)
class DnsAnswer:
    result: DnsDecision
    source_identity: int


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    synced: bool = False
    revision: int = 0
    policies: int = 0
    rejected: int = 0
    identities: int = 0
    ipcache: int = 0
    nodes: int = 0
    endpoints: int = 0
    endpoints_behind: int = 0
    endpoints_failed: int = 0
    nodes_gone: int = 0


class PolicyQueries:
    """Questions asked of one :class:`~.core.PolicyCore` (its ``queries``)."""

    def __init__(self, core: PolicyCore) -> None:
        self._core = core

    def view(self, record: PolicyRecord) -> PolicyView:
        subjects: set[int] = set()
        if record.policy is not None and self._core.audited(record.policy):
            # Its selectors are not the engine's: matched against every identity instead.
            identities = [i for i in self._core.engine.identities().values() if is_endpoint_identity(i.id)]
            for rule in record.policy.rules:
                subjects |= {i.id for i in identities if rule.subject.matches_labels(i.labels)}
        elif record.policy is not None:
            for rule in record.policy.rules:
                subjects |= {i for i in self._core.engine.selection_set(rule.subject) if is_endpoint_identity(i)}
        rollup = self._core.realized.rollup(subjects, record.revision) if record.policy is not None else Rollup()
        audited = record.policy is not None and self._core.audited(record.policy)
        return PolicyView(record, tuple(sorted(subjects)), rollup, audited)

    def get_policy(self, source: Source | None, key: PolicyRef) -> PolicyView:
        sources = (source,) if source is not None else (Source.API, Source.KUBERNETES)
        for s in sources:
            record = self._core.registry.get(s, key)
            if record is not None:
                return self.view(record)
        where = f" from source {source.value}" if source is not None else ""
        raise RequestError(
            f"no policy {key}{where}; list them with `palisade policy get` without a name", not_found=True
        )

    def list_policies(self, namespace: str = "") -> list[PolicyView]:
        return [self.view(r) for r in self._core.registry.search(namespace)]

    def trace(
        self,
        source: tuple[str, tuple[str, ...]],
        destination: tuple[str, tuple[str, ...]],
        port: int,
        protocol: IpProto,
        *,
        fqdn: tuple[str, IPAddress] | None = None,
    ) -> TraceAnswer:
        """Trace a connection between two peers, each (pod "ns/name", labels); with ``fqdn``
        (name, address) the destination is that address, an answer for that name."""
        src = self._trace_peer("source", *source)
        if fqdn is not None:
            dst = address_endpoint(self._core.engine, fqdn[1])
        else:
            dst = self._trace_peer("destination", *destination)
        result = trace(self._core.engine, src=src, dst=dst, port=port, protocol=protocol, fqdn=fqdn[0] if fqdn else "")
        return TraceAnswer(
            result,
            src if isinstance(src, int) else src.identity,
            dst if isinstance(dst, int) else dst.identity,
        )

    def dns_query(self, source: tuple[str, tuple[str, ...]], name: str) -> DnsAnswer:
        """May a peer (pod "ns/name", labels) resolve ``name`` through its node's DNS proxy?"""
        src = self._trace_peer("source", *source)
        return DnsAnswer(dns_query(self._core.engine, src, name), src if isinstance(src, int) else src.identity)

    def _trace_peer(self, which: str, pod: str, labels: tuple[str, ...]) -> TraceEndpoint | int:
        if pod:
            if "/" not in pod:
                raise RequestError(f"{which}.pod {pod!r} must be namespace/name")
            record = self._core.ipcache.find_pod(pod)
            if record is None:
                raise RequestError(
                    f"{which}.pod {pod} is not in the ipcache; check the name, or wait until ipam publishes it",
                    not_found=True,
                )
            if self._core.engine.identity(record.identity) is None:
                raise RequestError(
                    f"{which}.pod {pod} has identity {record.identity}, which is not known yet; retry shortly",
                    not_found=True,
                )
            return record.identity
        if not labels:
            raise RequestError(f"{which} needs a pod (namespace/name) or labels (source:key=value)")
        try:
            label_set = LabelSet(tuple(parse_label(text, default_source=LabelSource.K8S) for text in labels))
        except ValueError as exc:
            raise RequestError(f"{which}.labels: {exc}") from None
        known = self._core.engine.identity_by_labels(label_set)
        if known is not None:
            return known.id
        return TraceEndpoint(label_set)

    def _holder(self, key: PolicyRef) -> Source | None:
        """The source whose copy of ``key`` the engine holds (Kubernetes first), or None."""
        for source in (Source.KUBERNETES, Source.API):
            record = self._core.registry.get(source, key)
            if record is not None and record.policy is not None:
                return source
        return None

    def preview(
        self,
        documents: Sequence[tuple[Mapping[str, Any], str]],
        deletes: Sequence[PolicyRef],
        *,
        probes: Sequence[DiffProbe] = (),
        flows: Iterable[ObservedFlow] = (),
    ) -> Preview:
        """What applying ``documents`` (each with its origin, for errors) and deleting ``deletes``
        would change, computed on a copy of the engine: nothing in force changes. A document
        naming a policy in force replaces it in its source (Kubernetes' copy first); a new one is
        an API policy. Raises RequestError naming every invalid document or unknown deletion."""
        after = copy.deepcopy(self._core.engine)
        changed: list[Policy] = []
        errors: list[str] = []
        after.begin_batch()
        for doc, origin in documents:
            try:
                parsed = parse_policy(doc, cluster=self._core.cluster)
            except PolicyValidationError as exc:
                errors.append(f"{origin}: {exc}" if origin else str(exc))
                continue
            key = engine_key(self._holder(parsed.key) or Source.API, parsed.key)
            old = self._core.engine.declared_policy(key)
            new = dataclasses.replace(parsed, key=key)
            changed += [p for p in (old, new) if p is not None]
            if self._core.audited(new):
                after.delete_policy(key)  # audit never drops: the change enforces nothing of it
            else:
                after.upsert_policy(new)
        for ref in deletes:
            source = self._holder(ref)
            if source is None:
                errors.append(f"--delete {ref}: no such policy is in force; list them with `palisade policy get`")
                continue
            old = self._core.engine.declared_policy(engine_key(source, ref))
            if old is not None:
                changed.append(old)
            after.delete_policy(engine_key(source, ref))
        if errors:
            raise RequestError("nothing previewed; fix these and run the diff again:\n" + "\n".join(errors))
        after.end_batch()
        return preview(
            self._core.engine, after, changed, pods=self._core.ipcache.pods_by_identity(), probes=probes, flows=flows
        )

    def status(self) -> StatusSnapshot:
        counts = self._core.registry.counts()
        behind = self._core.realized.behind(self._core.revision)
        return StatusSnapshot(
            synced=self._core.synced,
            revision=self._core.revision,
            policies=sum(counts.values()),
            rejected=sum(n for (_, rejected), n in counts.items() if rejected),
            identities=len(self._core.engine.identities()),
            ipcache=len(self._core.ipcache),
            nodes=len(self._core.nodes() | set(self._core.planner.nodes())),
            endpoints=len(self._core.realized),
            endpoints_behind=len(behind),
            endpoints_failed=sum(1 for lag in behind if lag.error),
            nodes_gone=len(self._core.realized.gone),
        )
