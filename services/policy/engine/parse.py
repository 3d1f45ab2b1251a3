"""Parse NetworkPolicy and Cilium(Clusterwide)NetworkPolicy documents into :mod:`model` rules.

Pure: documents (dicts, as loaded from YAML/JSON) in, :class:`Policy` out, or a
:class:`PolicyValidationError` naming the object and the field path.

Parsing is strict: every document is first checked against the field model
(:mod:`fields`), so an unknown field at any depth (``spec.ingress[0].fromEndpoint``),
a value of the wrong type or outside its enumeration is an error, with the field
probably meant when one is close. A dropped typo would widen the policy. This
module is the one place documents become policies: ``palisade analyze``, the
watcher's objects and ``ImportPolicies`` all come through :func:`parse_policy`.

What is not enforced is reported on ``Policy.unsupported`` as ``path: feature``
and its L3/L4 effect is always the conservative one:

* L7 ``rules``, ``serverNames``, ``terminatingTLS``/``originatingTLS``,
  ``listener`` under ``toPorts``: the L3/L4 part (peers, ports) is enforced as
  written, as Cilium does when no proxy is in the path; the L7 filter is not.
* ``authentication``: the rule is enforced without mutual authentication.
* ``toGroups``/``fromGroups``, ``toNodes``/
  ``fromNodes``, ``cidrGroupRef``/``cidrGroupSelector``: these peers select no
  identity (nothing is allowed, or denied, through them); they still count as
  peers, so a rule made only of them is never widened to "all peers".
* ``nodeSelector`` (host policy): the whole rule is skipped; only pods are
  subjects here.
* extended protocols (``VRRP``, ``IGMP``): that port entry is skipped; if a
  ``toPorts`` element keeps no port, it allows nothing.

``fromRequires``/``toRequires``, ``icmps`` and ``toServices`` (``k8sService``,
``k8sServiceSelector``: the Services' backends, see ``servicepeers``) are implemented.
``toFQDNs`` (``matchName``/``matchPattern``, validated as Cilium does, see
:mod:`services.common.fqdn`) and DNS rules (``toPorts[].rules.dns``) are implemented too:
they become the peer rule's ``fqdns`` and ``dns``, which the resolver turns into each
identity's rules on names (enforced by the node's DNS proxy). A ``toFQDNs`` peer adds no
identity to the rule's peers (the node learns the addresses), so, like the peers above,
it is never widened to "all peers"; a DNS rule's L4 part (the DNS traffic) is an ordinary
allow.

The module is about 600 lines because it follows the three schemas field by field, so
a reader can hold one document beside it; the model and the selector grammar live in
their own modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.labels import (
    CLUSTER_NAME_DEFAULT,
    LABEL_NAMESPACE_LABELS_PREFIX,
    LABEL_POD_NAMESPACE,
    LabelSource,
    ReservedIdentity,
    reserved_labels,
)
from services.policy.engine.fields import ICMP4_TYPES, ICMP6_TYPES, check_document
from services.policy.engine.identity import entity_selectors
from services.policy.engine.model import (
    ALL_PORTS,
    MODE_ANNOTATION,
    Direction,
    DnsPorts,
    IPNetwork,
    IpProto,
    PeerRule,
    Policy,
    PolicyKind,
    PolicyMode,
    PolicyRef,
    PolicyValidationError,
    PortSpec,
    Rule,
    ServiceRef,
    Verdict,
)
from services.policy.engine.parsecontext import ParseContext as _Ctx
from services.policy.engine.parsecontext import as_list as _as_list
from services.policy.engine.parsecontext import as_map as _as_map
from services.policy.engine.parsenames import check_dns_port, dns_items, fqdn_selectors
from services.policy.engine.selector import (
    CIDRSelector,
    EndpointSelector,
    Selector,
    namespace_exists_requirement,
    namespace_requirement,
    namespace_selector,
    parse_cidr,
    parse_label_selector,
)

__all__ = ["POLICY_KINDS", "is_policy_document", "parse_policy"]

POLICY_KINDS = frozenset(k.value for k in PolicyKind)
_KNP_API_GROUPS = ("networking.k8s.io/", "extensions/")
_CILIUM_API_GROUPS = ("cilium.io/",)
_PROTOCOLS = {"TCP": IpProto.TCP, "UDP": IpProto.UDP, "SCTP": IpProto.SCTP, "ANY": IpProto.ANY}
_EXTENDED_PROTOCOLS = {"VRRP", "IGMP"}
_L7_FIELDS = ("rules", "serverNames", "terminatingTLS", "originatingTLS", "listener")
#: Peer fields of an egress rule that toFQDNs cannot share a rule with (Cilium's rule validation).
_L3_FIELDS = ("toEndpoints", "toCIDR", "toCIDRSet", "toEntities", "toServices", "toNodes", "toGroups")


def is_policy_document(doc: Any) -> bool:
    return isinstance(doc, Mapping) and doc.get("kind") in POLICY_KINDS


def parse_policy(doc: Mapping[str, Any], *, cluster: str = CLUSTER_NAME_DEFAULT) -> Policy:
    """Parse one policy document. Raises :class:`PolicyValidationError`."""
    kind_text = str(doc.get("kind", ""))
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    name = str(meta.get("name") or "")
    try:
        kind = PolicyKind(kind_text)
    except ValueError:
        raise PolicyValidationError(f"{kind_text or '?'} {name or '?'}", "kind", "not a policy kind") from None
    namespace = "" if kind is PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY else str(meta.get("namespace") or "default")
    key = PolicyRef(kind, namespace, name)
    ctx = _Ctx(key, cluster)
    if not name:
        raise ctx.error("metadata.name", "required")
    checked = check_document(doc, kind, ctx.obj)
    doc = checked.value
    ctx.warnings.extend(checked.warnings)
    _check_api_version(ctx, doc)
    rules: tuple[Rule, ...]
    if kind is PolicyKind.NETWORK_POLICY:
        rules = (_parse_knp(ctx, _as_map(ctx, doc.get("spec"), "spec")),)
    else:
        rules = _parse_cilium(ctx, doc)
    labels = meta.get("labels") or {}
    return Policy(
        key=key,
        rules=rules,
        unsupported=tuple(ctx.unsupported),
        warnings=tuple(ctx.warnings),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {},
        mode=_mode(ctx, meta.get("annotations")),
    )


def _mode(ctx: _Ctx, annotations: Any) -> PolicyMode:
    """The policy's mode from its ``policy.palisade.io/mode`` annotation (enforce when absent)."""
    value = annotations.get(MODE_ANNOTATION) if isinstance(annotations, Mapping) else None
    if value is None:
        return PolicyMode.ENFORCE
    try:
        return PolicyMode(str(value).strip().lower())
    except ValueError:
        raise ctx.error(
            f"metadata.annotations[{MODE_ANNOTATION}]", f"{value!r} is not a mode; use enforce or audit"
        ) from None


def _check_api_version(ctx: _Ctx, doc: Mapping[str, Any]) -> None:
    """Accept any version of the right API group (legacy ones too); warn when missing."""
    groups = _KNP_API_GROUPS if ctx.key.kind is PolicyKind.NETWORK_POLICY else _CILIUM_API_GROUPS
    api = doc.get("apiVersion", doc.get("apiversion"))
    if api is None:
        ctx.warnings.append("apiVersion: missing")
        return
    if not str(api).startswith(groups):
        raise ctx.error("apiVersion", f"unsupported apiVersion {api!r} for {ctx.key.kind.value}")
    if "apiVersion" in doc and str(api) not in ("networking.k8s.io/v1", "cilium.io/v2"):
        ctx.warnings.append(f"apiVersion: legacy {api}")


# --- Kubernetes NetworkPolicy ------------------------------------------------------


def _parse_knp(ctx: _Ctx, spec: Mapping[str, Any]) -> Rule:
    ns = ctx.key.namespace
    subject = parse_label_selector(
        spec.get("podSelector") or {},
        obj=ctx.obj,
        path="spec.podSelector",
        default_source=LabelSource.K8S,
    ).with_requirements(namespace_requirement(ns))
    ingress = _as_list(ctx, spec.get("ingress"), "spec.ingress")
    egress = _as_list(ctx, spec.get("egress"), "spec.egress")
    types_raw = spec.get("policyTypes")
    if types_raw is None:
        types = {"Ingress"} | ({"Egress"} if egress else set())
    else:
        types = set()
        for i, t in enumerate(_as_list(ctx, types_raw, "spec.policyTypes")):
            if t not in ("Ingress", "Egress"):
                raise ctx.error(f"spec.policyTypes[{i}]", f"unknown policy type {t!r}")
            types.add(str(t))
    peer_rules: list[PeerRule] = []
    for direction, items, field, peer_field in (
        (Direction.INGRESS, ingress, "ingress", "from"),
        (Direction.EGRESS, egress, "egress", "to"),
    ):
        if direction.value.capitalize() not in types:
            if items:
                ctx.warnings.append(
                    f"spec.{field}: ignored, policyTypes does not include {direction.value.capitalize()}"
                )
            continue
        for i, item in enumerate(items):
            path = f"spec.{field}[{i}]"
            item = _as_map(ctx, item, path)
            peers = _knp_peers(ctx, _as_list(ctx, item.get(peer_field), f"{path}.{peer_field}"), f"{path}.{peer_field}")
            ports = _knp_ports(ctx, _as_list(ctx, item.get("ports"), f"{path}.ports"), f"{path}.ports")
            peer_rules.append(PeerRule(direction, Verdict.ALLOW, peers, ports, origin=path))
    return Rule(
        subject=subject,
        enforce_ingress="Ingress" in types,
        enforce_egress="Egress" in types,
        peer_rules=tuple(peer_rules),
        origin="spec",
    )


def _knp_peers(ctx: _Ctx, items: list[Any], path: str) -> tuple[Selector, ...] | None:
    """Peers of a KNP rule; ``None`` (all) when the list is empty or absent."""
    if not items:
        return None
    out: list[Selector] = []
    for j, peer in enumerate(items):
        ppath = f"{path}[{j}]"
        peer = _as_map(ctx, peer, ppath)
        has_sel = "podSelector" in peer or "namespaceSelector" in peer
        if "ipBlock" in peer:
            if has_sel:
                raise ctx.error(ppath, "ipBlock cannot be combined with podSelector or namespaceSelector")
            block = _as_map(ctx, peer["ipBlock"], f"{ppath}.ipBlock")
            out.append(_ip_block(ctx, block, f"{ppath}.ipBlock", require_mask=True))
            continue
        if not has_sel:
            ctx.warnings.append(f"{ppath}: empty peer, taken as every peer")
            return None
        if "namespaceSelector" in peer and peer["namespaceSelector"] is not None:
            sel = namespace_selector(peer["namespaceSelector"], obj=ctx.obj, path=f"{ppath}.namespaceSelector")
        else:
            sel = EndpointSelector((namespace_requirement(ctx.key.namespace),))
        if peer.get("podSelector") is not None:
            pod = parse_label_selector(
                peer["podSelector"],
                obj=ctx.obj,
                path=f"{ppath}.podSelector",
                default_source=LabelSource.K8S,
            )
            sel = sel.with_requirements(*pod.requirements)
        out.append(sel)
    return tuple(out)


def _ip_block(
    ctx: _Ctx,
    block: Mapping[str, Any],
    path: str,
    *,
    cidr_key: str = "cidr",
    except_key: str = "except",
    require_mask: bool = False,
) -> CIDRSelector:
    """A CIDR with exceptions; ``require_mask``: a bare address is refused, as Kubernetes' ipBlock does."""
    if cidr_key not in block:
        raise ctx.error(f"{path}.{cidr_key}", "required")

    def masked(value: Any, where: str) -> Any:
        if require_mask and isinstance(value, str) and "/" not in value:
            raise ctx.error(where, f"{value!r} has no prefix length; write a CIDR such as 10.0.0.0/24 or 10.0.0.5/32")
        return value

    cidr = parse_cidr(masked(block[cidr_key], f"{path}.{cidr_key}"), obj=ctx.obj, path=f"{path}.{cidr_key}")
    excepts: list[IPNetwork] = []
    for k, e in enumerate(_as_list(ctx, block.get(except_key), f"{path}.{except_key}")):
        epath = f"{path}.{except_key}[{k}]"
        net = parse_cidr(masked(e, epath), obj=ctx.obj, path=epath)
        if net.version != cidr.version or not net.subnet_of(cidr):  # type: ignore[arg-type]
            raise ctx.error(epath, f"{net} not inside cidr {cidr}")
        excepts.append(net)
    return CIDRSelector(cidr, tuple(sorted(set(excepts), key=str)))


def _port_number(ctx: _Ctx, value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ctx.error(path, f"invalid port {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ctx.error(path, f"invalid port {value!r}") from None
    if not 0 <= n <= 65535:
        raise ctx.error(path, f"port {n} out of range 0-65535")
    return n


def _knp_ports(ctx: _Ctx, items: list[Any], path: str) -> tuple[PortSpec, ...]:
    if not items:
        return (ALL_PORTS,)
    out: list[PortSpec] = []
    for j, item in enumerate(items):
        ppath = f"{path}[{j}]"
        item = _as_map(ctx, item, ppath)
        proto_text = str(item.get("protocol") or "TCP")
        if proto_text not in ("TCP", "UDP", "SCTP"):
            raise ctx.error(f"{ppath}.protocol", f"unsupported protocol {proto_text!r}")
        proto = _PROTOCOLS[proto_text]
        port = item.get("port")
        end = item.get("endPort")
        if port is None:
            if end is not None:
                raise ctx.error(f"{ppath}.endPort", "endPort needs a numeric port")
            out.append(PortSpec(proto))
            continue
        if isinstance(port, str) and not port.isdigit():
            if end is not None:
                raise ctx.error(f"{ppath}.endPort", "endPort cannot be used with a named port")
            out.append(PortSpec(proto, name=port))
            continue
        low = _port_number(ctx, port, f"{ppath}.port")
        if low == 0:
            raise ctx.error(f"{ppath}.port", "port must be 1-65535")
        high = low
        if end is not None:
            high = _port_number(ctx, end, f"{ppath}.endPort")
            if high < low:
                raise ctx.error(f"{ppath}.endPort", f"endPort {high} is smaller than port {low}")
        out.append(PortSpec(proto, low, high))
    return tuple(out)


# --- Cilium(Clusterwide)NetworkPolicy ----------------------------------------------


def _parse_cilium(ctx: _Ctx, doc: Mapping[str, Any]) -> tuple[Rule, ...]:
    specs: list[tuple[str, Mapping[str, Any]]] = []
    if doc.get("spec") is not None:
        specs.append(("spec", _as_map(ctx, doc["spec"], "spec")))
    for i, s in enumerate(_as_list(ctx, doc.get("specs"), "specs")):
        specs.append((f"specs[{i}]", _as_map(ctx, s, f"specs[{i}]")))
    if not specs:
        raise ctx.error("spec", "one of spec or specs is required")
    rules: list[Rule] = []
    for path, spec in specs:
        rule = _cilium_rule(ctx, spec, path)
        if rule is not None:
            rules.append(rule)
    return tuple(rules)


def _cilium_rule(ctx: _Ctx, spec: Mapping[str, Any], path: str) -> Rule | None:
    has_ep = spec.get("endpointSelector") is not None
    has_node = spec.get("nodeSelector") is not None
    if has_ep == has_node:
        raise ctx.error(path, "exactly one of endpointSelector or nodeSelector is required")
    if has_node:
        parse_label_selector(spec["nodeSelector"], obj=ctx.obj, path=f"{path}.nodeSelector")
        ctx.unsupported_feature(f"{path}.nodeSelector", "host policy (nodeSelector); rule not enforced")
        # Still validate the sections so bad input is reported.
        _cilium_sections(ctx, spec, path, subject=EndpointSelector())
        return None
    subject = parse_label_selector(spec["endpointSelector"], obj=ctx.obj, path=f"{path}.endpointSelector")
    if ctx.key.namespace:
        kept = tuple(
            r for r in subject.requirements if not (r.key == LABEL_POD_NAMESPACE and r.source in ("k8s", "any"))
        )
        if len(kept) != len(subject.requirements):
            ctx.warnings.append(f"{path}.endpointSelector: namespace match replaced by the policy namespace")
        subject = EndpointSelector(kept).with_requirements(namespace_requirement(ctx.key.namespace))
    peer_rules = _cilium_sections(ctx, spec, path, subject=subject)
    if spec.get("log"):
        ctx.unsupported_feature(f"{path}.log", "policy logging; not applied")
    dd = _as_map(ctx, spec.get("enableDefaultDeny"), f"{path}.enableDefaultDeny")
    ingress_present = bool(spec.get("ingress")) or bool(spec.get("ingressDeny"))
    egress_present = bool(spec.get("egress")) or bool(spec.get("egressDeny"))
    return Rule(
        subject=subject,
        enforce_ingress=ingress_present and bool(dd.get("ingress", True)),
        enforce_egress=egress_present and bool(dd.get("egress", True)),
        peer_rules=tuple(peer_rules),
        origin=path,
        description=str(spec.get("description") or ""),
    )


def _cilium_sections(ctx: _Ctx, spec: Mapping[str, Any], path: str, *, subject: EndpointSelector) -> list[PeerRule]:
    out: list[PeerRule] = []
    matches_init = subject.matches_labels(reserved_labels(ReservedIdentity.INIT)) and not subject.is_wildcard
    for field, direction, verdict in (
        ("ingress", Direction.INGRESS, Verdict.ALLOW),
        ("ingressDeny", Direction.INGRESS, Verdict.DENY),
        ("egress", Direction.EGRESS, Verdict.ALLOW),
        ("egressDeny", Direction.EGRESS, Verdict.DENY),
    ):
        for i, item in enumerate(_as_list(ctx, spec.get(field), f"{path}.{field}")):
            ipath = f"{path}.{field}[{i}]"
            pr = _cilium_peer_rule(ctx, _as_map(ctx, item, ipath), ipath, direction, verdict, matches_init=matches_init)
            if pr is not None:
                out.append(pr)
    return out


def _cilium_endpoint_selector(ctx: _Ctx, data: Any, path: str, *, matches_init: bool) -> EndpointSelector:
    """A from/toEndpoints selector, namespace-scoped the way Cilium scopes it."""
    es = parse_label_selector(data, obj=ctx.obj, path=path)
    if es.has_source(LabelSource.RESERVED):
        return es
    if es.has_key(LABEL_POD_NAMESPACE):
        return es
    if not ctx.key.namespace:
        if matches_init:
            return es
        return es.with_requirements(namespace_exists_requirement())
    if es.has_key_prefix(LABEL_NAMESPACE_LABELS_PREFIX):
        return es
    return es.with_requirements(namespace_requirement(ctx.key.namespace))


def _cilium_peer_rule(
    ctx: _Ctx, item: Mapping[str, Any], path: str, direction: Direction, verdict: Verdict, *, matches_init: bool
) -> PeerRule | None:
    p = "from" if direction is Direction.INGRESS else "to"
    peers: list[Selector] = []
    all_peers = False
    peer_fields_present = False

    eps = _as_list(ctx, item.get(f"{p}Endpoints"), f"{path}.{p}Endpoints")
    for j, e in enumerate(eps):
        peer_fields_present = True
        peers.append(_cilium_endpoint_selector(ctx, e, f"{path}.{p}Endpoints[{j}]", matches_init=matches_init))

    for j, c in enumerate(_as_list(ctx, item.get(f"{p}CIDR"), f"{path}.{p}CIDR")):
        peer_fields_present = True
        peers.append(CIDRSelector(parse_cidr(c, obj=ctx.obj, path=f"{path}.{p}CIDR[{j}]")))

    for j, c in enumerate(_as_list(ctx, item.get(f"{p}CIDRSet"), f"{path}.{p}CIDRSet")):
        peer_fields_present = True
        cpath = f"{path}.{p}CIDRSet[{j}]"
        cm = _as_map(ctx, c, cpath)
        if "cidr" in cm:
            peers.append(_ip_block(ctx, cm, cpath))
        elif "cidrGroupRef" in cm or "cidrGroupSelector" in cm:
            which = "cidrGroupRef" if "cidrGroupRef" in cm else "cidrGroupSelector"
            ctx.unsupported_feature(f"{cpath}.{which}", f"{which} (CiliumCIDRGroup); selects no peer")
        else:
            raise ctx.error(cpath, "one of cidr, cidrGroupRef or cidrGroupSelector is required")

    for j, ent in enumerate(_as_list(ctx, item.get(f"{p}Entities"), f"{path}.{p}Entities")):
        peer_fields_present = True
        try:
            sels = entity_selectors(str(ent), cluster=ctx.cluster)
        except KeyError:
            raise ctx.error(f"{path}.{p}Entities[{j}]", f"unknown entity {ent!r}") from None
        if sels is None:
            all_peers = True
        else:
            peers.extend(sels)

    services: list[ServiceRef] = []
    if direction is Direction.EGRESS:
        for j, svc in enumerate(_as_list(ctx, item.get("toServices"), f"{path}.toServices")):
            peer_fields_present = True
            ref = _service_ref(ctx, _as_map(ctx, svc, f"{path}.toServices[{j}]"), f"{path}.toServices[{j}]")
            if ref is not None:
                services.append(ref)

    fqdns: tuple[str, ...] = ()
    if direction is Direction.EGRESS and item.get("toFQDNs"):
        peer_fields_present = True
        fqdns = fqdn_selectors(ctx, _as_list(ctx, item.get("toFQDNs"), f"{path}.toFQDNs"), f"{path}.toFQDNs")
        others = [f for f in _L3_FIELDS if item.get(f)]
        if others:
            raise ctx.error(
                f"{path}.toFQDNs",
                f"cannot be combined with {', '.join(others)} in one rule (as in Cilium); write two egress rules",
            )

    for f in (f"{p}Nodes", f"{p}Groups"):
        if item.get(f):
            peer_fields_present = True
            ctx.unsupported_feature(f"{path}.{f}", f"{f}; selects no peer")

    requirements: list[Selector] = []
    for j, r in enumerate(_as_list(ctx, item.get(f"{p}Requires"), f"{path}.{p}Requires")):
        requirements.append(parse_label_selector(r, obj=ctx.obj, path=f"{path}.{p}Requires[{j}]"))
    if requirements:
        ctx.warnings.append(f"{path}.{p}Requires: deprecated in Cilium, applied to endpoint peers")

    for f in ("authentication", "auth"):
        if item.get(f):
            ctx.unsupported_feature(f"{path}.{f}", "authentication; enforced without it")

    ports, dns = _cilium_ports(ctx, item, path, direction)
    if ports is None:
        return None  # every port spec was unsupported: allows/denies nothing
    if fqdns and any(spec.name for spec in ports):
        named = next(str(spec) for spec in ports if spec.name)
        raise ctx.error(f"{path}.toPorts", f"named port {named} cannot be used with toFQDNs; give the port number")
    if fqdns and dns:
        ctx.unsupported_feature(
            f"{path}.toPorts",
            "DNS rules in a toFQDNs rule (they would filter queries sent to the names' own addresses); not enforced",
        )
        dns = ()
    has_ports = ("toPorts" in item and item.get("toPorts")) or item.get("icmps")
    peer_tuple: tuple[Selector, ...] | None
    if all_peers:
        peer_tuple = None
    elif peer_fields_present:
        peer_tuple = tuple(peers)
    elif has_ports:
        peer_tuple = None  # L4-only rule: every remote identity on these ports
    elif requirements:
        peer_tuple = ()
    else:
        peer_tuple = ()  # Cilium: an empty rule selects no peer
    return PeerRule(
        direction,
        verdict,
        peer_tuple,
        ports,
        tuple(requirements),
        origin=path,
        services=tuple(services),
        fqdns=fqdns,
        dns=dns,
    )


def _service_ref(ctx: _Ctx, item: Mapping[str, Any], path: str) -> ServiceRef | None:
    """A ``toServices`` item; an empty one names no Service (and selects nothing)."""
    if "k8sService" in item and "k8sServiceSelector" in item:
        raise ctx.error(path, "give k8sService or k8sServiceSelector, not both")
    if "k8sService" in item:
        spath = f"{path}.k8sService"
        named = _as_map(ctx, item["k8sService"], spath)
        name = named.get("serviceName")
        if not isinstance(name, str) or not name:
            raise ctx.error(f"{spath}.serviceName", "required: the name of the Service")
        return ServiceRef(_service_namespace(ctx, named.get("namespace"), spath), name=name)
    if "k8sServiceSelector" in item:
        spath = f"{path}.k8sServiceSelector"
        chosen = _as_map(ctx, item["k8sServiceSelector"], spath)
        if "selector" not in chosen:
            raise ctx.error(f"{spath}.selector", "required: a label selector over Services")
        selector = parse_label_selector(chosen.get("selector"), obj=ctx.obj, path=f"{spath}.selector")
        return ServiceRef(_service_namespace(ctx, chosen.get("namespace"), spath), selector=selector)
    return None


def _service_namespace(ctx: _Ctx, raw: Any, path: str) -> str | None:
    """The namespace a ``toServices`` item looks in: as written, else the policy's (clusterwide: every one)."""
    if raw is None or raw == "":
        return ctx.key.namespace or None
    if not isinstance(raw, str):
        raise ctx.error(f"{path}.namespace", "must be a string")
    return raw


def _cilium_ports(
    ctx: _Ctx, item: Mapping[str, Any], path: str, direction: Direction
) -> tuple[tuple[PortSpec, ...] | None, tuple[DnsPorts, ...]]:
    """Port specs of a Cilium rule element (``None`` when all were unsupported), and its DNS rules."""
    specs: list[PortSpec] = []
    dns: list[DnsPorts] = []
    dropped = False
    to_ports = _as_list(ctx, item.get("toPorts"), f"{path}.toPorts")
    for j, tp in enumerate(to_ports):
        tpath = f"{path}.toPorts[{j}]"
        tp = _as_map(ctx, tp, tpath)
        dns_selectors = dns_items(ctx, tp, tpath, direction)
        for f in _L7_FIELDS:
            if tp.get(f):
                what = f
                if f == "rules" and isinstance(tp[f], Mapping):
                    kinds = sorted(str(k) for k, v in tp[f].items() if k != "dns" and v)
                    if not kinds:
                        continue  # DNS rules only: enforced (the node's DNS proxy)
                    what = "rules." + ",".join(kinds)
                ctx.unsupported_feature(f"{tpath}.{f}", f"L7 {what}; L3/L4 part enforced")
        ports = _as_list(ctx, tp.get("ports"), f"{tpath}.ports")
        if not ports:
            if dns_selectors is not None:
                raise ctx.error(f"{tpath}.ports", "DNS rules need the DNS server port, as {port: '53'}")
            specs.append(ALL_PORTS)
            continue
        element: list[PortSpec] = []
        for k, pp in enumerate(ports):
            ppath = f"{tpath}.ports[{k}]"
            spec = _cilium_port(ctx, _as_map(ctx, pp, ppath), ppath)
            if spec is None:
                dropped = True
            else:
                if dns_selectors is not None:
                    check_dns_port(ctx, spec, ppath)
                element.extend(spec)
        specs.extend(element)
        if dns_selectors is not None and element:
            dns.append(DnsPorts(tuple(dict.fromkeys(element)), dns_selectors))
    for j, ic in enumerate(_as_list(ctx, item.get("icmps"), f"{path}.icmps")):
        ipath = f"{path}.icmps[{j}]"
        for k, fld in enumerate(_as_list(ctx, _as_map(ctx, ic, ipath).get("fields"), f"{ipath}.fields")):
            specs.append(_icmp_field(ctx, _as_map(ctx, fld, f"{ipath}.fields[{k}]"), f"{ipath}.fields[{k}]"))
    if not specs:
        return (None if dropped else (ALL_PORTS,)), tuple(dns)
    return tuple(dict.fromkeys(specs)), tuple(dns)


def _cilium_port(ctx: _Ctx, pp: Mapping[str, Any], path: str) -> list[PortSpec] | None:
    proto_text = str(pp.get("protocol") or "ANY")
    if proto_text in _EXTENDED_PROTOCOLS:
        ctx.unsupported_feature(f"{path}.protocol", f"extended protocol {proto_text}; port not enforced")
        return None
    if proto_text not in _PROTOCOLS:
        raise ctx.error(f"{path}.protocol", f"unsupported protocol {proto_text!r}")
    proto = _PROTOCOLS[proto_text]
    port_raw = pp.get("port")
    end_raw = pp.get("endPort")
    port_text = "" if port_raw is None else str(port_raw).strip()
    if port_text and not port_text.isdigit():
        if end_raw not in (None, 0):
            raise ctx.error(f"{path}.endPort", "endPort cannot be used with a named port")
        return [PortSpec(proto, name=port_text)]
    low = _port_number(ctx, port_text or "0", f"{path}.port")
    high = low
    if end_raw not in (None, 0):
        high = _port_number(ctx, end_raw, f"{path}.endPort")
        if high < low:
            raise ctx.error(f"{path}.endPort", f"endPort {high} is smaller than port {low}")
        if low == 0:
            raise ctx.error(f"{path}.endPort", "endPort needs a port")
    if proto is IpProto.ANY:
        # Cilium expands ANY to the port-carrying protocols (not ICMP).
        return [PortSpec(p, low, high) for p in (IpProto.TCP, IpProto.UDP, IpProto.SCTP)]
    return [PortSpec(proto, low, high)]


def _icmp_field(ctx: _Ctx, fld: Mapping[str, Any], path: str) -> PortSpec:
    family = str(fld.get("family") or "IPv4")
    if family not in ("IPv4", "IPv6"):
        raise ctx.error(f"{path}.family", f"unknown family {family!r}")
    table = ICMP4_TYPES if family == "IPv4" else ICMP6_TYPES
    proto = IpProto.ICMP if family == "IPv4" else IpProto.ICMPV6
    raw = fld.get("type")
    if raw is None:
        raise ctx.error(f"{path}.type", "required")
    if isinstance(raw, int) or (isinstance(raw, str) and raw.isdigit()):
        n = int(raw)
        if not 0 <= n <= 255:
            raise ctx.error(f"{path}.type", f"ICMP type {n} out of range 0-255")
    elif str(raw) in table:
        n = table[str(raw)]
    else:
        raise ctx.error(f"{path}.type", f"unknown {family} ICMP type {raw!r}")
    return PortSpec(proto, n, n)
