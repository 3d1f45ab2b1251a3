"""The policy service's edge: protobufs and subjects in, the engine's own types out, and back.

The only module of the service that knows both shapes (as ``services.datapath.wire``
is for the datapath): messages from the bus are decoded here before the engine sees
them, and byte-for-byte what the datapath receives is decided here.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import common_pb2, identity_pb2, k8s_pb2, policy_pb2
from services.common.labels import labels_from_wire
from services.policy.engine.audit import AuditOverlay, combined_names
from services.policy.engine.changes import IdentityChange, ObjectDelta, ObjectKind
from services.policy.engine.ipcache import IpcacheRecord
from services.policy.engine.model import (
    Direction,
    DnsRule,
    EntryKey,
    FqdnRule,
    IpProto,
    NameRules,
    PolicyRef,
    Verdict,
)
from services.policy.engine.orders import OrderDiff, PlannedOrder
from services.policy.engine.preview import DiffProbe, FlowKey, ObservedFlow, Preview
from services.policy.engine.resolve import ResolvedPolicy
from services.policy.engine.sources import Source, split_engine_key

_DIRECTIONS = {Direction.INGRESS: common_pb2.DIRECTION_INGRESS, Direction.EGRESS: common_pb2.DIRECTION_EGRESS}
_VERDICTS = {Verdict.ALLOW: common_pb2.VERDICT_ALLOW, Verdict.DENY: common_pb2.VERDICT_DENY}


def direction_to_proto(direction: Direction) -> common_pb2.Direction.ValueType:
    return _DIRECTIONS[direction]


def verdict_to_proto(verdict: Verdict) -> common_pb2.Verdict.ValueType:
    return _VERDICTS[verdict]


def key_to_proto(key: EntryKey) -> common_pb2.PolicyKey:
    return common_pb2.PolicyKey(
        direction=_DIRECTIONS[key.direction],
        remote_identity=key.identity,
        protocol=int(key.protocol),  # type: ignore[arg-type]  # IP protocol numbers are the enum values
        port_low=key.port_low,
        port_high=key.port_high,
    )


def entries_to_proto(entries: Mapping[EntryKey, Verdict]) -> list[common_pb2.PolicyEntry]:
    """Entries sorted by key, so equal policies serialize identically."""
    return [common_pb2.PolicyEntry(key=key_to_proto(k), verdict=_VERDICTS[v]) for k, v in sorted(entries.items())]


def removals_to_proto(keys: Iterable[EntryKey]) -> list[common_pb2.PolicyEntry]:
    return [common_pb2.PolicyEntry(key=key_to_proto(k)) for k in sorted(keys)]


#: Audited entries on the wire: an audited deny, an audited allow (see ``engine.audit``).
_AUDIT_VERDICTS = {Verdict.DENY: common_pb2.VERDICT_AUDIT, Verdict.ALLOW: common_pb2.VERDICT_AUDIT_ALLOW}


def audit_entries_to_proto(entries: Mapping[EntryKey, Verdict]) -> list[common_pb2.PolicyEntry]:
    """Entries of audited policies (removals too: the verdict names the key space)."""
    return [common_pb2.PolicyEntry(key=key_to_proto(k), verdict=_AUDIT_VERDICTS[v]) for k, v in sorted(entries.items())]


def enforcement(ingress: bool, egress: bool) -> common_pb2.Enforcement:
    return common_pb2.Enforcement(ingress=ingress, egress=egress)


def _name_verdict(audit: bool) -> common_pb2.Verdict.ValueType:
    return common_pb2.VERDICT_AUDIT_ALLOW if audit else common_pb2.VERDICT_ALLOW


def fqdn_rules_to_proto(rules: Iterable[FqdnRule]) -> list[common_pb2.FqdnRule]:
    return [
        common_pb2.FqdnRule(
            selector=r.selector,
            protocol=int(r.protocol),  # type: ignore[arg-type]  # IP protocol numbers are the enum values
            port_low=r.port_low,
            port_high=r.port_high,
            verdict=_name_verdict(r.audit),
        )
        for r in rules
    ]


def dns_rules_to_proto(rules: Iterable[DnsRule]) -> list[common_pb2.DnsRule]:
    return [
        common_pb2.DnsRule(
            remote_identity=r.remote_identity,
            protocol=int(r.protocol),  # type: ignore[arg-type]
            port=r.port,
            selectors=list(r.selectors),
            verdict=_name_verdict(r.audit),
        )
        for r in rules
    ]


def _names_from_proto(fqdn: Iterable[common_pb2.FqdnRule], dns: Iterable[common_pb2.DnsRule]) -> NameRules:
    """The inverse of the encoders above (for tests and tools reading orders)."""
    return NameRules(
        tuple(
            FqdnRule(
                r.selector, IpProto(r.protocol), r.port_low, r.port_high, r.verdict == common_pb2.VERDICT_AUDIT_ALLOW
            )
            for r in fqdn
        ),
        tuple(
            DnsRule(
                r.remote_identity,
                IpProto(r.protocol),
                r.port,
                tuple(r.selectors),
                r.verdict == common_pb2.VERDICT_AUDIT_ALLOW,
            )
            for r in dns
        ),
    )


def names_from_proto(message: common_pb2.IdentityPolicy | common_pb2.IdentityPolicyDiff) -> NameRules:
    """The rules on names an identity's policy or diff carries."""
    return _names_from_proto(message.fqdn_rules, message.dns_rules)


def diff_to_proto(diff: OrderDiff) -> common_pb2.IdentityPolicyDiff:
    """An incremental diff (remove first, then add), or with ``full`` the whole policy; the entries
    of audited policies follow the enforced ones."""
    out = common_pb2.IdentityPolicyDiff(
        identity=diff.identity,
        enforcement=enforcement(diff.ingress_enforced, diff.egress_enforced),
        add=entries_to_proto(diff.add),
        remove=removals_to_proto(diff.remove),
        full=diff.full,
    )
    out.enforcement.audit_ingress = diff.audit_ingress
    out.enforcement.audit_egress = diff.audit_egress
    out.add.extend(audit_entries_to_proto(diff.audit_add))
    out.remove.extend(audit_entries_to_proto(diff.audit_remove))
    if diff.names is not None or diff.full:
        names = diff.names if diff.names is not None else NameRules()
        out.names_changed = True
        out.fqdn_rules.extend(fqdn_rules_to_proto(names.fqdn))
        out.dns_rules.extend(dns_rules_to_proto(names.dns))
    return out


class DiffProtos:
    """The protobuf of each diff of one publish, converted once.

    Nodes' orders share diff objects, so a diff is found by object. Diffs that differ only
    in their identity (subjects with one rule set share their policy's entries, so a
    cluster-wide change gives thousands of identities the same ``add`` and ``remove``) are
    copied from the first one's protobuf, with their own identity, instead of converting
    the same entries again.
    """

    def __init__(self) -> None:
        #: By ``id`` of the diff; the diff is held, so its id is not reused meanwhile.
        self._by_diff: dict[int, tuple[OrderDiff, common_pb2.IdentityPolicyDiff]] = {}
        #: By :func:`_content_key`; the diff is held, so the ids in the key stay its parts'.
        self._by_content: dict[tuple[object, ...], tuple[OrderDiff, common_pb2.IdentityPolicyDiff]] = {}

    def proto(self, diff: OrderDiff) -> common_pb2.IdentityPolicyDiff:
        held = self._by_diff.get(id(diff))
        if held is not None and held[0] is diff:
            return held[1]
        key = _content_key(diff)
        same = self._by_content.get(key)
        if same is None:
            out = diff_to_proto(diff)
            self._by_content[key] = (diff, out)
        else:
            out = common_pb2.IdentityPolicyDiff()
            out.CopyFrom(same[1])
            out.identity = diff.identity
        self._by_diff[id(diff)] = (diff, out)
        return out


def _content_key(diff: OrderDiff) -> tuple[object, ...]:
    """What a diff's protobuf is made of besides its identity; mappings by object (empty ones
    are all alike), as only subjects sharing a policy share them."""

    def part(value: object) -> object:
        return id(value) if value else 0

    return (
        part(diff.add),
        part(diff.remove),
        part(diff.audit_add),
        part(diff.audit_remove),
        None if diff.names is None else part(diff.names),
        diff.ingress_enforced,
        diff.egress_enforced,
        diff.full,
        diff.audit_ingress,
        diff.audit_egress,
    )


def policy_to_proto(policy: ResolvedPolicy, audit: AuditOverlay | None = None) -> common_pb2.IdentityPolicy:
    out = common_pb2.IdentityPolicy(
        identity=policy.identity,
        enforcement=enforcement(policy.ingress_enforced, policy.egress_enforced),
        entries=entries_to_proto(policy.entries),
    )
    if audit is not None:
        out.enforcement.audit_ingress = audit.ingress
        out.enforcement.audit_egress = audit.egress
        out.entries.extend(audit_entries_to_proto(audit.entries))
    names = combined_names(policy.names, audit)
    out.fqdn_rules.extend(fqdn_rules_to_proto(names.fqdn))
    out.dns_rules.extend(dns_rules_to_proto(names.dns))
    return out


def ref_to_proto(key: PolicyRef) -> common_pb2.ObjectRef:
    return common_pb2.ObjectRef(kind=key.kind.value, namespace=key.namespace, name=key.name)


def source_to_proto(source: Source) -> policy_pb2.PolicySource.ValueType:
    if source is Source.KUBERNETES:
        return policy_pb2.POLICY_SOURCE_KUBERNETES
    return policy_pb2.POLICY_SOURCE_API


def source_from_proto(value: int, *, default: Source) -> Source:
    if value == policy_pb2.POLICY_SOURCE_KUBERNETES:
        return Source.KUBERNETES
    if value == policy_pb2.POLICY_SOURCE_API:
        return Source.API
    return default


# --- decoding what arrives on the bus -------------------------------------------------------

_OBJECT_KINDS = {
    k8s_pb2.K8S_KIND_NETWORK_POLICY: ObjectKind.NETWORK_POLICY,
    k8s_pb2.K8S_KIND_CILIUM_NETWORK_POLICY: ObjectKind.CILIUM_NETWORK_POLICY,
    k8s_pb2.K8S_KIND_CILIUM_CLUSTERWIDE_NETWORK_POLICY: ObjectKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY,
    k8s_pb2.K8S_KIND_SERVICE: ObjectKind.SERVICE,
    k8s_pb2.K8S_KIND_ENDPOINT_SLICE: ObjectKind.ENDPOINT_SLICE,
    k8s_pb2.K8S_KIND_NODE: ObjectKind.NODE,
    k8s_pb2.K8S_KIND_NAMESPACE: ObjectKind.NAMESPACE,
}


def delta_from_proto(delta: k8s_pb2.K8sDelta) -> ObjectDelta:
    """A watcher's delta with its body decoded; a body that is not JSON keeps its text and the reason."""
    kind = _OBJECT_KINDS.get(delta.kind, ObjectKind.OTHER)
    deleted = delta.op == k8s_pb2.DELTA_OP_DELETE
    text, body, error = "", None, ""
    if not deleted and kind is not ObjectKind.NODE and kind is not ObjectKind.OTHER:
        text = delta.object_json.decode("utf-8", errors="replace")
        try:
            # Services and slices are parsed from their bytes, policies from their text (what a rejection shows).
            body = json.loads(text if kind.policy_kind is not None else delta.object_json)
        except (ValueError, RecursionError) as exc:
            error = str(exc)
    return ObjectDelta(
        kind=kind,
        namespace=delta.namespace,
        name=delta.name,
        deleted=deleted,
        text=text,
        body=body,
        error=error,
        source=delta.source,
        origin=delta.origin,
        conflict=delta.conflict,
    )


def subject_number(subject: str) -> int | None:
    """The number that ends an identity subject (``palisade.identity.<n>``), None if it does not."""
    last = subject.rpartition(".")[2]
    return int(last) if last.isdigit() else None


def identity_from_proto(subject: str, update: identity_pb2.IdentityUpdate) -> IdentityChange | None:
    """An identity update; None when neither the message nor its subject names the identity."""
    number = update.identity.id or subject_number(subject)
    if number is None:
        return None
    return IdentityChange(number, labels_from_wire(update.identity.labels), update.deleted)


class IpcacheError(ValueError):
    """An ipcache entry that cannot be used; says which and why."""


def record_from_proto(entry: identity_pb2.IpcacheEntry) -> IpcacheRecord:
    try:
        net = ipaddress.ip_network(entry.prefix, strict=False)
    except ValueError:
        raise IpcacheError(f"ipcache prefix {entry.prefix!r} is not an address or CIDR; fix the publisher") from None
    ip = net.network_address if net.prefixlen == net.max_prefixlen else None
    pod = f"{entry.namespace}/{entry.pod}" if entry.pod else ""
    ports: set[tuple[str, IpProto, int]] = set()
    for name, np in entry.named_ports.items():
        try:
            proto = IpProto(np.protocol) if np.protocol else IpProto.TCP
        except ValueError:
            continue
        if 0 < np.port <= 65535:
            ports.add((name, proto, np.port))
    return IpcacheRecord(
        prefix=str(net), ip=ip, identity=entry.identity, node=entry.node, pod=pod, named_ports=frozenset(ports)
    )


# --- encoding orders -------------------------------------------------------------------------------

# Bytes a repeated message field adds around each element: tag plus length varint.
_FIELD_OVERHEAD = 6


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def encode(
    order: PlannedOrder,
    *,
    max_bytes: int,
    max_chunks: int,
    converted: DiffProtos | None = None,
) -> list[policy_pb2.RegenerationOrder]:
    """The message(s) to publish for one order.

    Whole if it fits in ``max_bytes``; else split into at most ``max_chunks`` chunks
    (one identity's diff is never split); else one ``fetch=true`` order telling
    the datapath to call Resync. ``converted`` keeps the protobuf of every diff across
    the orders of one commit (they share diff objects), so each is converted once (see
    :class:`DiffProtos`).
    """
    memo = DiffProtos() if converted is None else converted
    diffs = [memo.proto(diff) for diff in order.diffs]

    def header() -> policy_pb2.RegenerationOrder:
        msg = policy_pb2.RegenerationOrder(
            node=order.node, sequence=order.sequence, revision=order.revision, replace=order.replace
        )
        if order.caused_at:
            msg.caused_at.CopyFrom(_timestamp(order.caused_at))
        return msg

    whole = header()
    whole.removed_identities.extend(order.removed)
    whole.diffs.extend(diffs)
    if whole.ByteSize() <= max_bytes:
        return [whole]
    base = header().ByteSize() + 8  # + chunk/chunks fields
    chunks: list[list[common_pb2.IdentityPolicyDiff]] = [[]]
    size = base + len(order.removed) * 6
    for diff_pb in diffs:
        cost = diff_pb.ByteSize() + _FIELD_OVERHEAD
        if base + cost > max_bytes:
            return [_fetch(header())]
        if size + cost > max_bytes and chunks[-1]:
            chunks.append([])
            size = base
        chunks[-1].append(diff_pb)
        size += cost
    if len(chunks) > max_chunks:
        return [_fetch(header())]
    out = []
    for i, part in enumerate(chunks):
        msg = header()
        if i == 0:
            msg.removed_identities.extend(order.removed)
        msg.diffs.extend(part)
        msg.chunk = i
        msg.chunks = len(chunks)
        out.append(msg)
    return out


def _fetch(msg: policy_pb2.RegenerationOrder) -> policy_pb2.RegenerationOrder:
    msg.fetch = True
    return msg


def _allowed_to_proto(allowed: bool) -> common_pb2.Verdict.ValueType:
    return common_pb2.VERDICT_ALLOW if allowed else common_pb2.VERDICT_DENY


def probe_to_proto(probe: DiffProbe) -> policy_pb2.DiffProbe:
    return policy_pb2.DiffProbe(port=probe.port, protocol=int(probe.protocol))  # type: ignore[arg-type]


def probe_from_proto(probe: policy_pb2.DiffProbe, field: str) -> DiffProbe:
    """Raises ValueError naming ``field`` for an unknown protocol or a port out of range."""
    try:
        protocol = IpProto(probe.protocol or IpProto.TCP)
    except ValueError:
        raise ValueError(f"{field}.protocol {probe.protocol} is not TCP, UDP, SCTP, ICMP or ICMPv6") from None
    if protocol is IpProto.ANY or not 0 <= probe.port <= 65535:
        raise ValueError(f"{field}: port {probe.port}/{protocol.name} must be 0-65535 of one protocol")
    return DiffProbe(protocol, probe.port)


def observed_from_proto(flow: policy_pb2.ObservedFlow, field: str) -> ObservedFlow:
    """The flow judged on the side that saw it: egress judges the source, ingress the destination."""
    if flow.direction == common_pb2.DIRECTION_EGRESS:
        direction, subject, remote = Direction.EGRESS, flow.source_identity, flow.destination_identity
    elif flow.direction == common_pb2.DIRECTION_INGRESS:
        direction, subject, remote = Direction.INGRESS, flow.destination_identity, flow.source_identity
    else:
        raise ValueError(f"{field}.direction must be ingress or egress")
    key = FlowKey(subject, remote, direction, int(flow.protocol), flow.port)
    return ObservedFlow(key, flow.count, flow.source_pod, flow.destination_pod, flow.node)


def observed_to_proto(flow: ObservedFlow) -> policy_pb2.ObservedFlow:
    k = flow.key
    egress = k.direction is Direction.EGRESS
    return policy_pb2.ObservedFlow(
        source_identity=k.subject if egress else k.remote,
        destination_identity=k.remote if egress else k.subject,
        direction=_DIRECTIONS[k.direction],
        protocol=k.protocol,  # type: ignore[arg-type]
        port=k.port,
        count=flow.count,
        source_pod=flow.source_pod,
        destination_pod=flow.destination_pod,
        node=flow.node,
    )


def preview_to_proto(result: Preview, revision: int, pods: Mapping[int, list[str]]) -> policy_pb2.DiffResponse:
    """The preview on the wire, each identity with up to three example pods."""
    out = policy_pb2.DiffResponse(
        revision=revision,
        flows_judged=result.flows_judged,
        newly_dropped=result.newly_dropped,
        probes=[probe_to_proto(p) for p in result.probes],
        notes=list(result.notes),
    )
    for c in result.pairs:
        out.pairs.append(
            policy_pb2.PairChange(
                source_identity=c.source,
                destination_identity=c.destination,
                probe=probe_to_proto(c.probe),
                before=_allowed_to_proto(c.allowed_before),
                after=_allowed_to_proto(c.allowed_after),
                policies=[ref_to_proto(split_engine_key(r)[1]) for r in c.policies],
                source_pods=pods.get(c.source, [])[:3],
                destination_pods=pods.get(c.destination, [])[:3],
            )
        )
    for f in result.flows:
        out.flows.append(
            policy_pb2.FlowChange(
                flow=observed_to_proto(f.flow),
                before=_allowed_to_proto(f.allowed_before),
                after=_allowed_to_proto(f.allowed_after),
                policies=[ref_to_proto(split_engine_key(r)[1]) for r in f.policies],
            )
        )
    return out
