"""gRPC PolicyService: validates requests, runs them as controller jobs, converts answers.

Errors are raised as :class:`PalisadeError`; the server's error interceptor
(``services.common.grpcserver``) turns them into the status the caller reads.

Every error tells what is wrong and what to do: INVALID_ARGUMENT for bad input,
NOT_FOUND for unknown objects, FAILED_PRECONDITION for requests that cannot be
right (deleting a Kubernetes policy over the API), UNAVAILABLE while the service
has not loaded its initial state.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from palisade.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.common.errors import Code, PalisadeError, clip
from services.common.fqdn import FqdnError
from services.common.fqdn import validate_name as validate_dns_name
from services.common.labels import LabelSource, parse_label
from services.common.manifests import Document, DocumentError, split_documents
from services.common.validation import validate_identity_label, validate_name, validate_namespace
from services.policy import metrics, wire
from services.policy.controller import Controller, JobKind
from services.policy.documents import dump_document, validate_document
from services.policy.engine.core import Outcome, PolicyCore
from services.policy.engine.model import IPAddress, IpProto, PolicyKind, PolicyMode, PolicyRef
from services.policy.engine.queries import DnsAnswer, PolicyView, TraceAnswer
from services.policy.engine.realized import Lag, Report
from services.policy.engine.sources import Source, object_key, parse_kind, split_engine_key
from services.policy.engine.trace import TraceSide
from services.policy.wire import (
    direction_to_proto,
    policy_to_proto,
    ref_to_proto,
    source_from_proto,
    source_to_proto,
    verdict_to_proto,
)

NOT_SYNCED = (
    "the policy service is still loading its initial state (waiting for the watcher's synced marker "
    "and the identity and ipcache streams); retry when its health is SERVING"
)
#: A change whose caller has less time left than this is not applied: the answer would come too late.
_MIN_TIME_LEFT = 1.0
_PROTOCOLS = {int(p): p for p in (IpProto.TCP, IpProto.UDP, IpProto.SCTP, IpProto.ICMP, IpProto.ICMPV6)}


def _state(view: PolicyView) -> policy_pb2.PolicyState.ValueType:
    if view.record.rejected:
        return policy_pb2.POLICY_STATE_REJECTED
    if view.rollup.failed:
        return policy_pb2.POLICY_STATE_FAILED
    if view.rollup.realized:
        return policy_pb2.POLICY_STATE_REALIZED
    return policy_pb2.POLICY_STATE_REALIZING


def read_documents(text: str, origin: str) -> list[Document]:
    """The documents of an import, each with names and labels Kubernetes would accept."""
    docs = split_documents(text, origin)
    if not docs:
        raise DocumentError(f"{origin or 'documents'}: no documents; pass the YAML or JSON of one or more policies")
    for doc in docs:
        validate_document(doc.body, doc.source)
    return docs


def validate_peer(peer: policy_pb2.TracePeer, which: str) -> None:
    """A trace peer's pod ("namespace/name") or labels ("source:key=value"), as Kubernetes would accept them."""
    if peer.pod:
        namespace, slash, name = peer.pod.partition("/")
        if not slash:
            raise PalisadeError(clip(f"{which}.pod {peer.pod!r} must be namespace/name"), Code.INVALID_ARGUMENT)
        validate_namespace(namespace, f"{which}.pod namespace")
        validate_name(name, f"{which}.pod name")
        return
    for i, text in enumerate(peer.labels):
        try:
            label = parse_label(text, default_source=LabelSource.K8S)
        except ValueError as exc:
            raise PalisadeError(clip(f"{which}.labels[{i}]: {exc}"), Code.INVALID_ARGUMENT) from None
        validate_identity_label(label.source, label.key, label.value, f"{which}.labels[{i}]")


@functools.lru_cache(maxsize=1 << 16)
def _pod_valid(pod: str) -> bool:
    """Whether ``pod`` is a valid "namespace/name". Every change brings a report of every endpoint
    it affects, naming the same pods each time: at 50,000 endpoints checking each name again cost
    a quarter of a second per change, so each name is checked once (an invalid one every time, for
    its error)."""
    try:
        validate_peer(policy_pb2.TracePeer(pod=pod), "pod")
    except PalisadeError:
        return False
    return True


class CallerGone(PalisadeError):
    """The caller's deadline passed (or it cancelled) before its change was applied; nothing changed."""

    code = Code.DEADLINE_EXCEEDED


def still_wanted(context: grpc.aio.ServicerContext) -> Callable[[], None]:
    """A check, run by the state owner right before applying a change, that the caller still waits.

    A change applied after the caller gave up would be a success reported as a failure.
    """

    def check() -> None:
        remaining = context.time_remaining()
        if context.cancelled() or (remaining is not None and remaining < _MIN_TIME_LEFT):
            raise CallerGone("the call's deadline passed before the change was applied; nothing was changed")

    return check


def status_to_proto(view: PolicyView) -> policy_pb2.PolicyStatus:
    r = view.record
    error = r.error
    if r.rejected and r.policy is not None:
        error += f" (the version accepted at revision {r.revision} stays enforced)"
    elif view.rollup.failed:
        error = _failures_text(view.rollup.failures)
    if r.conflict:
        error = f"{error}; {r.conflict}" if error else r.conflict
    status = policy_pb2.PolicyStatus(
        ref=ref_to_proto(r.key),
        source=source_to_proto(r.source),
        state=_state(view),
        error=clip(error),
        revision=r.revision,
        subjects=view.subjects,
        document=r.document,
        origin=r.origin,
        nodes_total=len(view.rollup.nodes),
        nodes_realized=view.rollup.nodes_realized,
    )
    if r.policy is not None:
        status.unsupported.extend(r.policy.unsupported)
        status.warnings.extend(r.policy.warnings)
        status.rules = len(r.policy.rules)
        status.mode = PolicyMode.AUDIT.value if view.audited else PolicyMode.ENFORCE.value
    for n in view.rollup.nodes:
        status.nodes.append(
            policy_pb2.NodeRealization(
                node=n.node,
                realized_revision=n.realized_revision,
                endpoints=n.endpoints,
                endpoints_realized=n.endpoints_realized,
                endpoints_failed=n.endpoints_failed,
            )
        )
    return status


def _failures_text(failures: Sequence[Lag], limit: int = 5) -> str:
    shown = "; ".join(lag.describe() for lag in failures[:limit])
    more = f"; and {len(failures) - limit} more" if len(failures) > limit else ""
    return clip(f"realization failed: {shown}{more}")


def _outcome_status(outcome: Outcome, doc: Mapping[str, Any]) -> policy_pb2.PolicyStatus:
    """Status of a document that was rejected, or validated by a dry run."""
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    ref = ref_to_proto(outcome.key)
    if not outcome.accepted:
        # Show the kind as written, even when it is not a policy kind.
        ref = common_pb2.ObjectRef(
            kind=str(doc.get("kind") or ""),
            namespace=outcome.key.namespace,
            name=str(meta.get("name") or ""),
        )
    status = policy_pb2.PolicyStatus(
        ref=ref,
        source=source_to_proto(outcome.source),
        state=policy_pb2.POLICY_STATE_UNSPECIFIED if outcome.accepted else policy_pb2.POLICY_STATE_REJECTED,
        error=clip(outcome.error),
        document=outcome.document,
    )
    if outcome.policy is not None:
        status.unsupported.extend(outcome.policy.unsupported)
        status.warnings.extend(outcome.policy.warnings)
        status.rules = len(outcome.policy.rules)
    return status


def _side_matches(side: TraceSide) -> list[policy_pb2.TraceMatch]:
    out = []
    for ref in side.matched:
        _, key = split_engine_key(ref.policy)
        out.append(
            policy_pb2.TraceMatch(
                policy=ref_to_proto(key),
                rule_path=ref.peer_rule or ref.rule,
                direction=direction_to_proto(side.direction),
                verdict=verdict_to_proto(ref.verdict),
            )
        )
    return out


def trace_to_proto(answer: TraceAnswer) -> policy_pb2.TraceResponse:
    r = answer.result
    allow, deny = common_pb2.VERDICT_ALLOW, common_pb2.VERDICT_DENY
    return policy_pb2.TraceResponse(
        verdict=allow if r.allowed else deny,
        egress_verdict=allow if r.egress.allowed else deny,
        ingress_verdict=allow if r.ingress.allowed else deny,
        egress_enforced=r.egress.enforced,
        ingress_enforced=r.ingress.enforced,
        matches=[*_side_matches(r.egress), *_side_matches(r.ingress)],
        explanation=r.render(),
        source_identity=answer.source_identity,
        destination_identity=answer.destination_identity,
    )


def dns_to_proto(answer: DnsAnswer) -> policy_pb2.TraceResponse:
    """A DNS query check: ALLOW when the query is answered (or not filtered at all), DENY when refused."""
    r = answer.result
    verdict = common_pb2.VERDICT_ALLOW if r.allowed or not r.filtered else common_pb2.VERDICT_DENY
    matches = []
    for m in r.matched:
        _, key = split_engine_key(m.rule.policy)
        matches.append(
            policy_pb2.TraceMatch(
                policy=ref_to_proto(key),
                rule_path=m.rule.peer_rule or m.rule.rule,
                direction=common_pb2.DIRECTION_EGRESS,
                verdict=common_pb2.VERDICT_ALLOW,
            )
        )
    return policy_pb2.TraceResponse(
        verdict=verdict,
        egress_verdict=verdict,
        ingress_verdict=common_pb2.VERDICT_ALLOW,
        egress_enforced=r.filtered,
        matches=matches,
        explanation=r.render(),
        source_identity=answer.source_identity,
    )


def _dns_name(text: str, field: str) -> str:
    try:
        return validate_dns_name(text)
    except FqdnError as exc:
        raise PalisadeError(f"{field}: {exc}", Code.INVALID_ARGUMENT) from None


def _fqdn_destination(request: policy_pb2.TraceRequest) -> tuple[str, IPAddress]:
    """A destination by name: the name and the address it resolved to, and nothing else."""
    if not (request.fqdn and request.address):
        raise PalisadeError(
            "fqdn and address go together: the name, and the address an answer for it gave", Code.INVALID_ARGUMENT
        )
    if request.destination.pod or request.destination.labels:
        raise PalisadeError("give a destination or a name with its address (fqdn), not both", Code.INVALID_ARGUMENT)
    try:
        ip = ipaddress.ip_address(request.address)
    except ValueError:
        raise PalisadeError(f"address {request.address!r} is not an IP address", Code.INVALID_ARGUMENT) from None
    return _dns_name(request.fqdn, "fqdn"), ip


def lag_to_proto(lag: Lag) -> policy_pb2.EndpointLag:
    return policy_pb2.EndpointLag(
        node=lag.node,
        endpoint_id=lag.endpoint_id,
        identity=lag.identity,
        realized_revision=lag.realized,
        pod=lag.pod,
        error=clip(lag.error),
        failed_revision=lag.failed,
    )


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    def __init__(self, controller: Controller, *, wait_timeout: float, max_wait_timeout: float) -> None:
        self._controller = controller
        self._wait_timeout = wait_timeout
        self._max_wait_timeout = max_wait_timeout

    # --- helpers ---------------------------------------------------------------------------

    def _require_synced(self) -> None:
        if not self._controller.core.synced:
            raise PalisadeError(NOT_SYNCED, Code.UNAVAILABLE)

    def _ref(self, ref: common_pb2.ObjectRef, *, field: str = "ref") -> PolicyRef:
        if not ref.kind:
            raise PalisadeError(
                f"{field}.kind is required: NetworkPolicy, CiliumNetworkPolicy or CiliumClusterwideNetworkPolicy",
                Code.INVALID_ARGUMENT,
            )
        kind = parse_kind(ref.kind)
        if kind is None:
            raise PalisadeError(
                f"{field}.kind {ref.kind!r} is not a policy kind; use NetworkPolicy, CiliumNetworkPolicy or "
                "CiliumClusterwideNetworkPolicy",
                Code.INVALID_ARGUMENT,
            )
        if not ref.name:
            raise PalisadeError(f"{field}.name is required", Code.INVALID_ARGUMENT)
        if kind is PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY and ref.namespace:
            raise PalisadeError(
                f"{field}.namespace must be empty: CiliumClusterwideNetworkPolicy is cluster-scoped",
                Code.INVALID_ARGUMENT,
            )
        validate_name(ref.name, f"{field}.name")
        if ref.namespace:
            validate_namespace(ref.namespace, f"{field}.namespace")
        return object_key(kind, ref.namespace, ref.name)

    async def _revision(self) -> int:
        return await self._controller.call(lambda core, now: core.revision)

    # --- policies --------------------------------------------------------------------------

    async def ImportPolicies(
        self, request: policy_pb2.ImportPoliciesRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ImportPoliciesResponse:
        if not request.documents.strip():
            raise PalisadeError(
                "documents is empty; pass the YAML or JSON of one or more policies",
                Code.INVALID_ARGUMENT,
            )
        # Large files take seconds to read: off the event loop, which keeps serving meanwhile.
        docs = await asyncio.to_thread(read_documents, request.documents, request.origin)
        if not request.dry_run:
            self._require_synced()
        texts = await asyncio.to_thread(lambda: [dump_document(doc.body) for doc in docs])
        provenance = f"api {request.origin}" if request.origin else "api"
        check = still_wanted(context)

        def apply(core: PolicyCore, now: float) -> list[Outcome]:
            # All or nothing: every document is checked first, and one invalid document
            # fails the import (INVALID_ARGUMENT below) with nothing changed.
            if not request.dry_run:
                check()
            checked = [
                core.upsert(Source.API, doc.body, text, now, origin=doc.source, provenance=provenance, dry_run=True)
                for doc, text in zip(docs, texts, strict=True)
            ]
            if request.dry_run or not all(o.accepted for o in checked):
                return checked
            return [
                core.upsert(Source.API, doc.body, text, now, origin=doc.source, provenance=provenance, parsed=o.policy)
                for doc, text, o in zip(docs, texts, checked, strict=True)
            ]

        if request.dry_run:
            outcomes = await self._controller.call(apply, JobKind.READ)
        else:
            outcomes = await self._controller.call(apply, JobKind.CHANGE, durable=True)
        invalid = [o for o in outcomes if not o.accepted]
        if invalid:
            metrics.REJECTED.labels(Source.API.value).inc(len(invalid))
            nothing = "nothing was imported" if not request.dry_run else "dry run: nothing would be imported"
            raise PalisadeError(
                f"{len(invalid)} of {len(outcomes)} documents invalid, {nothing}; fix them and import again:\n"
                + "\n".join(o.error for o in invalid),
                Code.INVALID_ARGUMENT,
            )

        def answer(core: PolicyCore, now: float) -> policy_pb2.ImportPoliciesResponse:
            revision = core.revision
            if request.dry_run and any(outcome.changed for outcome in outcomes):
                revision += 1  # what applying it would make: one commit, one step
            response = policy_pb2.ImportPoliciesResponse(revision=revision)
            for outcome, doc in zip(outcomes, docs, strict=True):
                if outcome.accepted and not request.dry_run:
                    record = core.registry.get(Source.API, outcome.key)
                    if record is not None:
                        response.policies.append(status_to_proto(core.queries.view(record)))
                        continue
                response.policies.append(_outcome_status(outcome, doc.body))
            for status in response.policies:
                # The caller has the documents: echoing them back could make the answer huge.
                status.document = ""
            return response

        return await self._controller.call(answer)

    async def DeletePolicy(
        self, request: policy_pb2.DeletePolicyRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.DeletePolicyResponse:
        key = self._ref(request.ref)
        source = source_from_proto(request.source, default=Source.API)
        if source is Source.KUBERNETES:
            raise PalisadeError(
                f"{key} comes from Kubernetes; delete it there (kubectl delete) or from the manifest folder",
                Code.FAILED_PRECONDITION,
            )
        self._require_synced()
        check = still_wanted(context)

        def apply(core: PolicyCore, now: float) -> bool:
            check()
            return core.delete(source, key, now)

        existed = await self._controller.call(apply, JobKind.CHANGE, durable=True)
        if not existed:
            raise PalisadeError(
                f"no policy {key} imported over the API; list them with `palisade policy get`",
                Code.NOT_FOUND,
            )
        return policy_pb2.DeletePolicyResponse(revision=await self._revision())

    async def GetPolicy(
        self, request: policy_pb2.GetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.PolicyStatus:
        key = self._ref(request.ref)
        source = (
            source_from_proto(request.source, default=Source.API)
            if request.source != policy_pb2.POLICY_SOURCE_UNSPECIFIED
            else None
        )
        view = await self._controller.call(lambda core, now: core.queries.get_policy(source, key))
        return status_to_proto(view)

    async def ListPolicies(
        self, request: policy_pb2.ListPoliciesRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ListPoliciesResponse:
        def answer(core: PolicyCore, now: float) -> policy_pb2.ListPoliciesResponse:
            return policy_pb2.ListPoliciesResponse(
                revision=core.revision,
                policies=[status_to_proto(v) for v in core.queries.list_policies(request.namespace)],
            )

        return await self._controller.call(answer)

    # --- trace and resync ------------------------------------------------------------------

    async def Trace(
        self, request: policy_pb2.TraceRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.TraceResponse:
        src = (request.source.pod, tuple(request.source.labels))
        if request.dns_query:
            validate_peer(request.source, "source")
            query = _dns_name(request.dns_query, "dns_query")
            found = await self._controller.call(lambda core, now: core.queries.dns_query(src, query))
            return dns_to_proto(found)
        protocol = _PROTOCOLS.get(request.protocol or IpProto.TCP)
        if protocol is None:
            raise PalisadeError("protocol must be TCP, UDP, SCTP, ICMP or ICMPv6", Code.INVALID_ARGUMENT)
        if protocol in (IpProto.TCP, IpProto.UDP, IpProto.SCTP) and not 1 <= request.port <= 65535:
            raise PalisadeError(f"port {request.port} must be 1-65535 for {protocol.name}", Code.INVALID_ARGUMENT)
        fqdn: tuple[str, IPAddress] | None = None
        if request.fqdn or request.address:
            fqdn = _fqdn_destination(request)
            validate_peer(request.source, "source")
        else:
            for which, peer in (("source", request.source), ("destination", request.destination)):
                validate_peer(peer, which)
        dst = (request.destination.pod, tuple(request.destination.labels))
        answer = await self._controller.call(
            lambda core, now: core.queries.trace(src, dst, request.port, protocol, fqdn=fqdn)
        )
        return trace_to_proto(answer)

    async def Diff(self, request: policy_pb2.DiffRequest, context: grpc.aio.ServicerContext) -> policy_pb2.DiffResponse:
        self._require_synced()
        if not request.documents.strip() and not request.deletes:
            raise PalisadeError(
                "nothing to preview: pass the YAML of new or edited policies, or policies to delete",
                Code.INVALID_ARGUMENT,
            )
        docs = (
            await asyncio.to_thread(read_documents, request.documents, request.origin)
            if request.documents.strip()
            else []
        )
        deletes = [self._ref(ref, field=f"deletes[{i}]") for i, ref in enumerate(request.deletes)]
        try:
            probes = [wire.probe_from_proto(p, f"probes[{i}]") for i, p in enumerate(request.probes)]
            flows = [wire.observed_from_proto(f, f"flows[{i}]") for i, f in enumerate(request.flows)]
        except ValueError as exc:
            raise PalisadeError(str(exc), Code.INVALID_ARGUMENT) from None
        documents = [(doc.body, doc.source) for doc in docs]

        def answer(core: PolicyCore, now: float) -> policy_pb2.DiffResponse:
            result = core.queries.preview(documents, deletes, probes=probes, flows=flows)
            return wire.preview_to_proto(result, core.revision, core.ipcache.pods_by_identity())

        return await self._controller.call(answer, JobKind.READ)

    async def Resync(
        self, request: policy_pb2.ResyncRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ResyncResponse:
        if not request.node:
            raise PalisadeError("node is required: the node to resync", Code.INVALID_ARGUMENT)
        validate_name(request.node, "node")
        self._require_synced()
        # Durable: the sequence returned is persisted and its order published before we answer.
        answer = await self._controller.call(
            lambda core, now: core.resync(request.node, request.identities), JobKind.READ, durable=True
        )
        return policy_pb2.ResyncResponse(
            revision=answer.revision,
            sequence=answer.sequence,
            policies=[policy_to_proto(p, answer.audit.get(p.identity)) for p in answer.policies],
        )

    # --- realized revisions ----------------------------------------------------------------

    async def WaitForRevision(
        self, request: policy_pb2.WaitForRevisionRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.WaitForRevisionResponse:
        if request.revision == 0:
            raise PalisadeError(
                "revision is required: the revision printed by `palisade policy import`, or the current one "
                "from `palisade status`",
                Code.INVALID_ARGUMENT,
            )
        if request.timeout_seconds < 0:
            raise PalisadeError(
                "timeout_seconds must be positive (0 uses the server default)",
                Code.INVALID_ARGUMENT,
            )
        self._require_synced()
        current = await self._revision()
        if request.revision > current:
            raise PalisadeError(
                f"revision {request.revision} has not been handed out yet (current is {current}); "
                "wait for a revision returned by an import or delete",
                Code.INVALID_ARGUMENT,
            )
        timeout = min(request.timeout_seconds or self._wait_timeout, self._max_wait_timeout)
        behind = await self._controller.wait_for_revision(request.revision, timeout)
        return policy_pb2.WaitForRevisionResponse(
            realized=not behind,
            behind=[lag_to_proto(lag) for lag in behind],
            current_revision=await self._revision(),
            failed=any(lag.error for lag in behind),
        )

    async def ReportRealized(
        self, request: policy_pb2.ReportRealizedRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ReportRealizedResponse:
        reports = []
        nodes_checked: set[str] = set()
        for i, r in enumerate(request.reports):
            # Each field read once: a cluster-wide change brings a report of every endpoint.
            node, pod, revision, identity, endpoint_id, deleted = (
                r.node, r.pod, r.revision, r.identity, r.endpoint_id, r.deleted
            )  # fmt: skip
            problem = ""
            if not node:
                problem = "node is required"
            elif not revision and not deleted:
                problem = "revision is required"
            elif not identity:
                problem = "identity is required"
            elif not endpoint_id and not pod:
                problem = "endpoint_id or pod is required"
            elif pod and "/" not in pod:
                problem = f"pod {pod!r} must be namespace/name"
            if problem:
                raise PalisadeError(f"reports[{i}]: {problem}", Code.INVALID_ARGUMENT)
            if node not in nodes_checked:
                validate_name(node, f"reports[{i}].node")
                nodes_checked.add(node)
            if pod and not _pod_valid(pod):
                validate_peer(policy_pb2.TracePeer(pod=pod), f"reports[{i}]")  # raises, naming the report
            error = r.error
            reports.append(Report(node, endpoint_id, identity, revision, pod, deleted, clip(error) if error else ""))

        if request.node:
            validate_name(request.node, "node")

        def apply(core: PolicyCore, now: float) -> None:
            if request.node:
                core.node_seen(request.node, now)
            for _revision, caused_at in core.report(reports, now):
                metrics.IMPLEMENTATION_DELAY.observe(max(0.0, now - caused_at))
            metrics.REALIZED_REPORTS.inc(len(reports))

        await self._controller.call(apply, JobKind.REALIZED)
        return policy_pb2.ReportRealizedResponse()
