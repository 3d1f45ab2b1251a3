"""Protobuf in, the datapath's own types out (and back), at the edges. Pure.

Every message that reaches the datapath is translated here where it enters: a
regeneration order from the bus (``orders``), a resync answer and IPAM replies from
gRPC (``orders``, ``ipamclient``), a DatapathService request (``servicer``). Below
those edges the endpoint manager, the realizer and the BPF facade see only
``services.datapath.types``. An order or resync that carries something the datapath
cannot represent raises :class:`OrderError` here, before any of it is applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from palisade.v1 import common_pb2, datapath_pb2, ipam_pb2, policy_pb2
from services.datapath import netns
from services.datapath import types as dt
from services.datapath.endpoint import Endpoint, EndpointRef
from services.datapath.errors import InvalidRequest, OrderError
from services.datapath.state import EndpointRecord
from services.datapath.validate import validate_ref

# --- policy ---------------------------------------------------------------------------------------


def key_from_proto(key: common_pb2.PolicyKey) -> dt.PolicyKey:
    try:
        return dt.PolicyKey(
            direction=dt.Direction.from_wire(key.direction),
            remote_identity=key.remote_identity,
            protocol=dt.L4Proto.from_number(key.protocol),
            port_low=key.port_low,
            port_high=key.port_high,
        )
    except ValueError as exc:
        raise OrderError(f"policy key {_short(key)} is invalid: {exc}; the policy service sent a bad entry") from None


def entry_from_proto(entry: common_pb2.PolicyEntry) -> dt.PolicyEntry:
    key = key_from_proto(entry.key)
    try:
        verdict = dt.Verdict.from_wire(entry.verdict)
    except ValueError as exc:
        raise OrderError(f"policy entry {_short(entry.key)}: {exc}") from None
    return dt.PolicyEntry(key, verdict)


def enforcement_from_proto(enforcement: common_pb2.Enforcement) -> dt.Enforcement:
    return dt.Enforcement(
        ingress=enforcement.ingress,
        egress=enforcement.egress,
        audit_ingress=enforcement.audit_ingress,
        audit_egress=enforcement.audit_egress,
    )


def key_to_proto(key: dt.PolicyKey) -> common_pb2.PolicyKey:
    return common_pb2.PolicyKey(
        direction=key.direction.wire,  # type: ignore[arg-type]
        remote_identity=key.remote_identity,
        protocol=key.protocol.number,  # type: ignore[arg-type]
        port_low=key.port_low,
        port_high=key.port_high,
    )


def entry_to_proto(entry: dt.PolicyEntry) -> common_pb2.PolicyEntry:
    return common_pb2.PolicyEntry(key=key_to_proto(entry.key), verdict=entry.verdict.wire)  # type: ignore[arg-type]


def enforcement_to_proto(enforcement: dt.Enforcement) -> common_pb2.Enforcement:
    return common_pb2.Enforcement(
        ingress=enforcement.ingress,
        egress=enforcement.egress,
        audit_ingress=enforcement.audit_ingress,
        audit_egress=enforcement.audit_egress,
    )


def _short(key: common_pb2.PolicyKey) -> str:
    return f"(dir={key.direction} id={key.remote_identity} proto={key.protocol} ports={key.port_low}-{key.port_high})"


def _removal(entry: common_pb2.PolicyEntry) -> dt.PolicyKey:
    """A removed key; the verdict of an audited policy's entry names its key space."""
    key = key_from_proto(entry.key)
    audit = entry.verdict in (common_pb2.VERDICT_AUDIT, common_pb2.VERDICT_AUDIT_ALLOW)
    return dataclasses.replace(key, audit=True) if audit else key


def fqdn_rule_from_proto(rule: common_pb2.FqdnRule) -> dt.FqdnRule:
    where = f"toFQDNs rule {rule.selector!r}"
    if not rule.selector or rule.selector != rule.selector.lower() or rule.selector.endswith("."):
        raise OrderError(f"{where}: the selector must be a lower-case name without a trailing dot")
    try:
        verdict = dt.Verdict.from_wire(rule.verdict)
        if verdict not in (dt.Verdict.ALLOW, dt.Verdict.AUDIT_ALLOW):
            raise ValueError(f"verdict {verdict} is not allow or audit-allow")
        out = dt.FqdnRule(rule.selector, dt.L4Proto.from_number(rule.protocol), rule.port_low, rule.port_high, verdict)
        out.entry(dt.IDENTITY_ANY)  # validates the ports as a policy key would
    except ValueError as exc:
        raise OrderError(f"{where}: {exc}; the policy service sent a bad rule") from None
    return out


def dns_rule_from_proto(rule: common_pb2.DnsRule) -> dt.DnsRule:
    where = f"DNS rule (server id={rule.remote_identity} port={rule.port})"
    try:
        protocol = dt.L4Proto.from_number(rule.protocol)
    except ValueError as exc:
        raise OrderError(f"{where}: {exc}") from None
    if protocol not in (dt.L4Proto.UDP, dt.L4Proto.TCP, dt.L4Proto.ANY) or not 0 < rule.port <= dt.MAX_PORT:
        raise OrderError(f"{where}: DNS rules need UDP, TCP or ANY and a port in 1-65535")
    for selector in rule.selectors:
        if not selector or selector != selector.lower() or selector.endswith("."):
            raise OrderError(f"{where}: selector {selector!r} must be a lower-case name without a trailing dot")
    if rule.verdict not in (common_pb2.VERDICT_UNSPECIFIED, common_pb2.VERDICT_ALLOW, common_pb2.VERDICT_AUDIT_ALLOW):
        raise OrderError(f"{where}: verdict {rule.verdict} is neither ALLOW nor AUDIT_ALLOW")
    audit = rule.verdict == common_pb2.VERDICT_AUDIT_ALLOW
    return dt.DnsRule(rule.remote_identity, protocol, rule.port, tuple(rule.selectors), audit)


def names_from_proto(fqdn: Iterable[common_pb2.FqdnRule], dns: Iterable[common_pb2.DnsRule]) -> dt.NameRules:
    return dt.NameRules(
        fqdn=tuple(fqdn_rule_from_proto(r) for r in fqdn), dns=tuple(dns_rule_from_proto(r) for r in dns)
    )


def diff_from_proto(diff: common_pb2.IdentityPolicyDiff) -> dt.IdentityPolicyDiff:
    return dt.IdentityPolicyDiff(
        identity=diff.identity,
        enforcement=enforcement_from_proto(diff.enforcement),
        add=tuple(entry_from_proto(e) for e in diff.add),
        remove=tuple(_removal(e) for e in diff.remove),
        full=diff.full,
        names=names_from_proto(diff.fqdn_rules, diff.dns_rules) if diff.names_changed else None,
    )


def snapshot_from_proto(policy: common_pb2.IdentityPolicy) -> dt.PolicySnapshot:
    return dt.PolicySnapshot(
        identity=policy.identity,
        enforcement=enforcement_from_proto(policy.enforcement),
        entries=tuple(entry_from_proto(e) for e in policy.entries),
        names=names_from_proto(policy.fqdn_rules, policy.dns_rules),
    )


def resync_from_proto(response: policy_pb2.ResyncResponse) -> dt.ResyncState:
    return dt.ResyncState(
        sequence=response.sequence,
        revision=response.revision,
        policies=tuple(snapshot_from_proto(p) for p in response.policies),
    )


def order_from_proto(order: policy_pb2.RegenerationOrder) -> dt.Order:
    return dt.Order(
        sequence=order.sequence,
        revision=order.revision,
        node=order.node,
        diffs=tuple(diff_from_proto(d) for d in order.diffs),
        chunk=order.chunk,
        chunks=order.chunks,
        fetch=order.fetch,
        removed=tuple(order.removed_identities),
        replace=order.replace,
    )


# --- endpoints ------------------------------------------------------------------------------------

_FAMILIES = {ipam_pb2.FAMILY_IPV4: 4, ipam_pb2.FAMILY_IPV6: 6}
_IPAM_FAMILIES = {4: ipam_pb2.FAMILY_IPV4, 6: ipam_pb2.FAMILY_IPV6}

STATES: dict[dt.EndpointState, datapath_pb2.EndpointState.ValueType] = {
    dt.EndpointState.WAITING: datapath_pb2.ENDPOINT_STATE_WAITING,
    dt.EndpointState.READY: datapath_pb2.ENDPOINT_STATE_READY,
    dt.EndpointState.REGENERATING: datapath_pb2.ENDPOINT_STATE_REGENERATING,
    dt.EndpointState.RESTORING: datapath_pb2.ENDPOINT_STATE_RESTORING,
    dt.EndpointState.FAILED: datapath_pb2.ENDPOINT_STATE_FAILED,
}


def label_from_proto(label: common_pb2.Label) -> dt.Label:
    return dt.Label(label.source, label.key, label.value)


def label_to_proto(label: dt.Label) -> common_pb2.Label:
    return common_pb2.Label(source=label.source, key=label.key, value=label.value)


def family_from_proto(family: int) -> int:
    """4 or 6 for an ``ipam.Family`` value; :class:`InvalidRequest` for anything else."""
    try:
        return _FAMILIES[family]  # type: ignore[index]
    except KeyError:
        raise InvalidRequest(f"family {family} is not IPv4 ({ipam_pb2.FAMILY_IPV4}) or IPv6 ({ipam_pb2.FAMILY_IPV6})")


def family_to_proto(family: int) -> ipam_pb2.Family.ValueType:
    return _IPAM_FAMILIES[family]


def request_from_proto(request: datapath_pb2.CreateEndpointRequest) -> dt.EndpointRequest:
    """The request as the manager takes it; only what cannot be represented is rejected here."""
    for port in request.ports:
        if not 0 < port.port <= 65535:
            raise InvalidRequest(f"ports: container port {port.name or port.port} is outside 1-65535")
    return dt.EndpointRequest(
        namespace=request.namespace,
        pod=request.pod,
        netns=request.netns,
        labels=tuple(label_from_proto(x) for x in request.labels),
        ports=tuple(dt.PortRecord(name=p.name, port=p.port, protocol=int(p.protocol)) for p in request.ports),
        families=tuple(family_from_proto(f) for f in request.families),
        ips=tuple(request.ips),
        outside_pool=request.outside_pool,
        container_id=request.container_id,
        ifname=request.ifname,
        adopt_host_ifname=request.adopt_host_ifname,
        init_identity=request.init_identity,
    )


def ref_from_proto(request: datapath_pb2.GetEndpointRequest | datapath_pb2.DeleteEndpointRequest) -> EndpointRef:
    container_id = request.container_id if isinstance(request, datapath_pb2.DeleteEndpointRequest) else ""
    ref = EndpointRef(request.id, request.namespace, request.pod, container_id)
    if not ref.id and not (ref.namespace and ref.pod) and not ref.container_id:
        raise InvalidRequest("name the endpoint: give its id, both namespace and pod, or its container_id")
    validate_ref(ref)
    return ref


def endpoint_to_proto(ep: Endpoint, node: str) -> datapath_pb2.Endpoint:
    r = ep.record
    return datapath_pb2.Endpoint(
        id=r.id,
        namespace=r.namespace,
        pod=r.pod,
        node=node,
        netns=r.netns,
        host_ifname=r.host_ifname,
        host_ifindex=r.host_ifindex,
        ips=list(r.ips),
        identity=r.identity,
        labels=[label_to_proto(x) for x in r.labels],
        state=STATES[ep.state],
        realized_revision=ep.realized_revision,
        error=ep.error,
        enforcement=enforcement_to_proto(ep.enforcement),
        container_id=r.container_id,
        ifname=r.ifname,
        mac=r.mac,
        gateways=_gateways(r),
    )


def _gateways(record: EndpointRecord) -> list[str]:
    """The pod's default gateways: the link-local ones the datapath configures, or the other plugin's."""
    if not record.link_owned:
        return list(dict.fromkeys(a.gateway for a in record.addresses if a.gateway))
    families = {a.family for a in record.addresses}
    return [gw for family, gw in ((4, netns.GATEWAY_V4), (6, netns.GATEWAY_V6)) if family in families]


def address_from_proto(alloc: ipam_pb2.IPAllocation) -> dt.Address:
    family = 6 if alloc.family == ipam_pb2.FAMILY_IPV6 or ":" in alloc.ip else 4
    return dt.Address(ip=alloc.ip, cidr=alloc.cidr, gateway=alloc.gateway, family=family)


def allocation_from_proto(alloc: ipam_pb2.IPAllocation) -> dt.IpAllocation:
    return dt.IpAllocation(owner=alloc.owner, address=address_from_proto(alloc))
