"""Offline analysis: manifests in, connectivity matrix out (pure, no file I/O).

Builds a :class:`PolicyEngine` from Namespace, Pod and policy documents, gives
each pod its identity (a local allocator), IPs (``status.podIP``/``podIPs``,
else a deterministic address from 10.244.0.0/16 in sorted pod order) and named
ports, and answers, for each probe, whether a new connection from every pod to
every pod is allowed: the source's egress AND the destination's ingress.

A pod talking to itself is always allowed: Kubernetes states that a pod
cannot block access to itself (its upstream conformance tests expect loopback
to work under any policy), and such traffic never leaves the pod's network
namespace, so it never reaches the enforcement point. Pass
``self_traffic_allowed=False`` to evaluate it through policy instead.

Names: with a DNS table (``--dns NAME=IP[,IP...]``: what the names resolve to), each probe also
says whether every pod may reach each name (``ProbeResult.names``), judged as the node judges
them (see ``names``): a connection to each of the name's addresses is allowed by the address's
own identity (its pod's, else a CIDR identity of the address, which ``world`` and CIDR rules
select), or else by a ``toFQDNs`` rule selecting the name on that port, provided the pod's DNS
rules let it resolve the name. A name is reachable when all its addresses are (a client may pick
any); an address that is a pod's is also judged by that pod's ingress.

A pod with ``spec.hostNetwork: true`` is not an endpoint: it has its node's address, no
veth and no identity of its own. Others see it as its node, ``host`` (1) from its own
node and ``remote-node`` (6) from any other (a pod without ``nodeName`` is taken to be on
another node); no policy judges its own traffic, and traffic from it to a pod of its own
node is host traffic, allowed whatever the policy (Kubernetes semantics; Cilium's
``allow-localhost``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.fqdn import FqdnError, validate_name
from services.common.labels import ReservedIdentity, pod_identity_labels
from services.common.manifests import Document
from services.policy.engine.identity import LocalAllocator
from services.policy.engine.model import (
    Direction,
    IPAddress,
    IpProto,
    Policy,
    PolicyRef,
    PolicyValidationError,
    Rule,
)
from services.policy.engine.names import name_egress
from services.policy.engine.parse import POLICY_KINDS, parse_policy
from services.policy.engine.policyengine import PolicyEngine
from services.policy.engine.resolve import ResolvedPolicy, lookup

POD_CIDR = ipaddress.ip_network("10.244.0.0/16")
_PROBE_PROTOCOLS = {p.name: p for p in (IpProto.TCP, IpProto.UDP, IpProto.SCTP)}


class AnalyzeError(ValueError):
    """Bad input: names the source (file) and the field."""

    def __init__(self, source: str, message: str) -> None:
        self.source = source
        super().__init__(f"{source}: {message}" if source else message)


@dataclass(frozen=True, slots=True)
class Probe:
    port: int
    protocol: IpProto

    @classmethod
    def parse(cls, text: str) -> Probe:
        """``80/TCP``, ``53/udp``; protocol defaults to TCP."""
        port_text, _, proto_text = text.strip().partition("/")
        proto_name = (proto_text or "TCP").upper()
        if proto_name not in _PROBE_PROTOCOLS:
            raise AnalyzeError("--probe", f"{text!r}: protocol must be TCP, UDP or SCTP")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise AnalyzeError("--probe", f"{text!r}: port must be 1-65535")
        return cls(int(port_text), _PROBE_PROTOCOLS[proto_name])


@dataclass(frozen=True, slots=True)
class PodModel:
    key: str
    identity: int
    ips: tuple[IPAddress, ...]
    node: str
    named_ports: Mapping[str, frozenset[tuple[IpProto, int]]]
    #: On its node's network: seen as the node (``host``/``remote-node``), judged by no policy.
    host_network: bool = False

    def seen_from(self, other: PodModel) -> int:
        """The identity ``other`` sees this pod's packets carry."""
        if not self.host_network:
            return self.identity
        same_node = bool(self.node) and self.node == other.node
        return int(ReservedIdentity.HOST if same_node else ReservedIdentity.REMOTE_NODE)


@dataclass(frozen=True, slots=True)
class DnsTable:
    """What names resolve to, as the user gives it (``NAME=IP[,IP...]``): names in normal form."""

    names: Mapping[str, tuple[IPAddress, ...]] = field(default_factory=dict)

    @classmethod
    def parse(cls, items: Sequence[str]) -> DnsTable:
        """``api.example.test=192.0.2.10,192.0.2.11``, repeatable; a name given twice has all its addresses."""
        out: dict[str, list[IPAddress]] = {}
        for text in items:
            name_text, sep, ips_text = text.partition("=")
            if not sep or not ips_text.strip():
                raise AnalyzeError("--dns", f"{text!r}: write NAME=IP[,IP...], e.g. api.example.test=192.0.2.10")
            try:
                name = validate_name(name_text)
            except FqdnError as err:
                raise AnalyzeError("--dns", f"{text!r}: {err}") from None
            for ip_text in ips_text.split(","):
                try:
                    ip = ipaddress.ip_address(ip_text.strip())
                except ValueError:
                    raise AnalyzeError("--dns", f"{text!r}: {ip_text.strip()!r} is not an IP address") from None
                if ip not in out.setdefault(name, []):
                    out[name].append(ip)
        return cls({n: tuple(ips) for n, ips in sorted(out.items())})


@dataclass
class Model:
    engine: PolicyEngine
    pods: dict[str, PodModel]
    policies: list[Policy] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Policies refused (``keep_going``): each error names the file, the object and the field.
    invalid: list[str] = field(default_factory=list)
    dns: DnsTable = field(default_factory=DnsTable)
    #: Each address of the DNS table: the pod having it, or the CIDR identity of the address.
    addresses: dict[IPAddress, PodModel | int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    probe: Probe
    matrix: Mapping[str, Mapping[str, bool]]
    #: names[src][name]: may ``src`` connect to every address of ``name`` (with a DNS table only).
    names: Mapping[str, Mapping[str, bool]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "port": self.probe.port,
            "protocol": self.probe.protocol.name,
            "matrix": {s: dict(row) for s, row in self.matrix.items()},
        }
        if self.names:
            out["names"] = {s: dict(row) for s, row in self.names.items()}
        return out


def _meta(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    m = doc.get("metadata")
    return m if isinstance(m, Mapping) else {}


def _container_ports(pod: Mapping[str, Any], where: str) -> dict[str, set[tuple[IpProto, int]]]:
    out: dict[str, set[tuple[IpProto, int]]] = {}
    spec = pod.get("spec") or {}
    for ci, c in enumerate(spec.get("containers") or []):
        for pi, p in enumerate((c or {}).get("ports") or []):
            path = f"{where}: spec.containers[{ci}].ports[{pi}]"
            proto_name = str(p.get("protocol") or "TCP").upper()
            if proto_name not in _PROBE_PROTOCOLS:
                raise AnalyzeError("", f"{path}.protocol: unsupported protocol {proto_name!r}")
            number = p.get("containerPort")
            if not isinstance(number, int) or not 1 <= number <= 65535:
                raise AnalyzeError("", f"{path}.containerPort: invalid port {number!r}")
            if p.get("name"):
                out.setdefault(str(p["name"]), set()).add((_PROBE_PROTOCOLS[proto_name], number))
    return out


def build_model(documents: Iterable[Document], *, keep_going: bool = False, dns: DnsTable | None = None) -> Model:
    """Load documents into an engine. Raises :class:`AnalyzeError` on bad input.

    ``keep_going``: an invalid policy is left out and its error kept in ``Model.invalid``
    instead of raised (every other bad input still raises).
    """
    namespaces: dict[str, Mapping[str, Any]] = {}
    pods: list[tuple[Document, str, str]] = []
    policy_docs: list[Document] = []
    service_docs: list[Document] = []
    warnings: list[str] = []
    for doc in documents:
        kind = doc.body.get("kind")
        meta = _meta(doc.body)
        if kind == "Namespace":
            if not meta.get("name"):
                raise AnalyzeError(doc.source, "Namespace: metadata.name: required")
            namespaces[str(meta["name"])] = doc.body
        elif kind == "Pod":
            if not meta.get("name"):
                raise AnalyzeError(doc.source, "Pod: metadata.name: required")
            pods.append((doc, str(meta.get("namespace") or "default"), str(meta["name"])))
        elif kind in POLICY_KINDS:
            policy_docs.append(doc)
        elif kind in ("Service", "EndpointSlice"):
            if not meta.get("name"):
                raise AnalyzeError(doc.source, f"{kind}: metadata.name: required")
            service_docs.append(doc)
        else:
            warnings.append(f"{doc.source}: ignored {kind or 'document without kind'} {meta.get('name', '')}".rstrip())

    engine = PolicyEngine()
    allocator = LocalAllocator()
    engine.begin_batch()
    # Deterministic addresses for pods without status.podIP, avoiding given ones.
    given: set[IPAddress] = set()
    for doc, _, _ in pods:
        for ip in _pod_ips(doc):
            given.add(ip)
    hosts = (h for h in POD_CIDR.hosts() if h not in given and int(h) & 0xFF not in (0, 1))
    by_identity_ports: dict[int, dict[str, set[tuple[IpProto, int]]]] = {}
    by_identity_ips: dict[int, set[IPAddress]] = {}
    models: dict[str, PodModel] = {}
    seen: set[str] = set()
    for doc, ns, name in sorted(pods, key=lambda t: (t[1], t[2])):
        key = f"{ns}/{name}"
        if key in seen:
            raise AnalyzeError(doc.source, f"Pod {key}: duplicate pod")
        seen.add(key)
        spec = doc.body.get("spec") or {}
        node = str(spec.get("nodeName") or "")
        if spec.get("hostNetwork") is True:
            # The node's address and no identity of its own (ipam gives none to host-network pods).
            no_ports: dict[str, frozenset[tuple[IpProto, int]]] = {}
            models[key] = PodModel(key, int(ReservedIdentity.REMOTE_NODE), (), node, no_ports, host_network=True)
            continue
        labels = pod_identity_labels(doc.body, namespaces.get(ns))
        ident = allocator.allocate(labels)
        if engine.identity(ident.id) is None:
            engine.upsert_identity(ident)
        ips = _pod_ips(doc) or [next(hosts)]
        ports = _container_ports(doc.body, f"{doc.source}: Pod {key}")
        for n, v in ports.items():
            by_identity_ports.setdefault(ident.id, {}).setdefault(n, set()).update(v)
        by_identity_ips.setdefault(ident.id, set()).update(ips)
        models[key] = PodModel(key, ident.id, tuple(ips), node, {k: frozenset(v) for k, v in ports.items()})
    for ident_id, ip_set in by_identity_ips.items():
        engine.set_identity_ips(ident_id, ip_set)
    table = dns if dns is not None else DnsTable()
    addresses: dict[IPAddress, PodModel | int] = {}
    pod_of = {ip: pod for pod in models.values() for ip in pod.ips}
    for ip in sorted({ip for ips in table.names.values() for ip in ips}, key=lambda a: (a.version, a)):
        if ip in pod_of:
            addresses[ip] = pod_of[ip]
            continue
        cidr = allocator.allocate_cidr(f"{ip}/{ip.max_prefixlen}")
        if engine.identity(cidr.id) is None:
            engine.upsert_identity(cidr)
        addresses[ip] = cidr.id
    for ident_id, named in by_identity_ports.items():
        engine.set_named_ports(ident_id, named)
    for doc in service_docs:  # what toServices rules name
        meta = _meta(doc.body)
        ns, name = str(meta.get("namespace") or "default"), str(meta["name"])
        if doc.body.get("kind") == "Service":
            engine.set_service(ns, name, doc.body)
        else:
            engine.set_endpoint_slice(ns, name, doc.body)
    policies: list[Policy] = []
    invalid: list[str] = []
    seen_policies: set[str] = set()
    for doc in policy_docs:
        try:
            policy = parse_policy(doc.body)
        except PolicyValidationError as err:
            if not keep_going:
                raise AnalyzeError(doc.source, str(err)) from None
            invalid.append(str(AnalyzeError(doc.source, str(err))))
            continue
        warnings.extend(f"{doc.source}: {policy.key}: {w}" for w in policy.warnings)
        if str(policy.key) in seen_policies:
            warnings.append(f"{doc.source}: {policy.key} defined twice; the last one wins")
        seen_policies.add(str(policy.key))
        engine.upsert_policy(policy)
        policies.append(policy)
    engine.end_batch()
    return Model(engine, models, policies, warnings, invalid, table, addresses)


def _pod_ips(doc: Document) -> list[IPAddress]:
    status = doc.body.get("status") or {}
    texts: list[str] = []
    if status.get("podIP"):
        texts.append(str(status["podIP"]))
    for item in status.get("podIPs") or []:
        if isinstance(item, Mapping) and item.get("ip"):
            texts.append(str(item["ip"]))
    out: list[IPAddress] = []
    for t in dict.fromkeys(texts):
        try:
            out.append(ipaddress.ip_address(t))
        except ValueError:
            raise AnalyzeError(
                doc.source, f"Pod {_meta(doc.body).get('name')}: status.podIP: invalid address {t!r}"
            ) from None
    return out


def connectivity(model: Model, probe: Probe, *, self_traffic_allowed: bool = True) -> dict[str, dict[str, bool]]:
    """matrix[src][dst]: may ``src`` open a connection to ``dst`` on the probe?"""
    engine = model.engine
    keys = sorted(model.pods)
    matrix: dict[str, dict[str, bool]] = {}
    for s in keys:
        src = model.pods[s]
        egress_policy = engine.policy_for(src.identity)
        row: dict[str, bool] = {}
        for d in keys:
            dst = model.pods[d]
            if s == d and self_traffic_allowed:
                row[d] = True
                continue
            if src.host_network and (dst.host_network or (src.node and src.node == dst.node)):
                row[d] = True  # nothing judges it, or host traffic to a pod of its own node
                continue
            out = (
                lookup(egress_policy, Direction.EGRESS, dst.seen_from(src), probe.protocol, probe.port).allowed
                if not src.host_network
                else True
            )
            inn = (
                lookup(
                    engine.policy_for(dst.identity), Direction.INGRESS, src.seen_from(dst), probe.protocol, probe.port
                ).allowed
                if not dst.host_network
                else True
            )
            row[d] = out and inn
        matrix[s] = row
    return matrix


def name_reachability(model: Model, probe: Probe) -> dict[str, dict[str, bool]]:
    """names[src][name]: may pod ``src`` connect to every address of ``name`` on the probe?"""
    engine = model.engine
    out: dict[str, dict[str, bool]] = {}
    for s in sorted(model.pods):
        src = model.pods[s]
        rules = engine.rules_for(src.identity) if not src.host_network else []
        policy = engine.policy_for(src.identity) if not src.host_network else None
        row: dict[str, bool] = {}
        for name, ips in model.dns.names.items():
            row[name] = all(_address_allowed(model, src, rules, policy, name, ip, probe) for ip in ips)
        out[s] = row
    return out


def _address_allowed(
    model: Model,
    src: PodModel,
    rules: list[tuple[PolicyRef, Rule]],
    policy: ResolvedPolicy | None,
    name: str,
    ip: IPAddress,
    probe: Probe,
) -> bool:
    target = model.addresses[ip]
    if isinstance(target, PodModel):
        if target.key == src.key:
            return True
        remote = target.seen_from(src)
        inn = (
            target.host_network
            or lookup(
                model.engine.policy_for(target.identity),
                Direction.INGRESS,
                src.seen_from(target),
                probe.protocol,
                probe.port,
            ).allowed
        )
        if not inn:
            return False
    else:
        remote = target
    if src.host_network:
        return True
    base = lookup(policy, Direction.EGRESS, remote, probe.protocol, probe.port)
    by_default = base.reason in ("default-deny", "default-allow")
    return name_egress(rules, name, probe.protocol, probe.port, allowed=base.allowed, by_default=by_default).allowed


def analyze(
    documents: Iterable[Document],
    probes: Sequence[Probe],
    *,
    self_traffic_allowed: bool = True,
    keep_going: bool = False,
    dns: DnsTable | None = None,
) -> tuple[list[ProbeResult], Model]:
    """Documents and probes in, one matrix per probe out (plus the model, for reports); with a DNS
    table, each result also says which pods reach which names."""
    model = build_model(documents, keep_going=keep_going, dns=dns)
    results = [
        ProbeResult(
            p,
            connectivity(model, p, self_traffic_allowed=self_traffic_allowed),
            name_reachability(model, p) if model.dns.names else {},
        )
        for p in probes
    ]
    return results, model
