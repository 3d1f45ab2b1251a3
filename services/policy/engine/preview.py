"""Preview of a policy change: which identity pairs and which observed flows change verdict. Pure.

``after`` is an engine holding the running system's state with the change applied (the caller
copies the live engine and applies the new, edited or deleted policies to the copy, exactly as
the policy service would); ``before`` is the live engine, unchanged. Nothing here mutates either.

- **Pairs**: for every endpoint identity whose resolved policy differs between the two, and every
  endpoint identity it may talk to (both ways), the verdict of a new connection (egress of the
  source AND ingress of the destination, as ``analyze`` computes it) on each probe, before and
  after. Probes are given, or else the ports the changed policies name (a rule without ports is
  probed with port 0, which stands for "any other port").
- **Names**: an identity whose ``toFQDNs`` or DNS rules change gets a note saying which selectors
  come and go (the addresses they allow are learned by the nodes, so no pair or flow shows them).
- **Flows**: each observed flow (aggregated by subject, remote, direction, protocol and port) is
  judged on the side that observed it (the local endpoint's policy in the flow's direction),
  before and after.

Each change names the changed policies that select the identity whose policy decided it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.common.labels import ReservedIdentity
from services.policy.engine.ipcache import is_endpoint_identity
from services.policy.engine.model import Direction, IpProto, NameRules, Policy, PolicyRef
from services.policy.engine.policyengine import PolicyEngine
from services.policy.engine.resolve import lookup

#: The port that stands for "every port a rule does not name".
ANY_OTHER_PORT = 0


@dataclass(frozen=True, slots=True, order=True)
class DiffProbe:
    protocol: IpProto
    port: int


@dataclass(frozen=True, slots=True, order=True)
class FlowKey:
    """An observed flow as policy judges it: the local endpoint's identity (the subject), the remote
    identity, the direction seen from the subject, protocol and destination port."""

    subject: int
    remote: int
    direction: Direction
    protocol: int
    port: int


@dataclass(frozen=True, slots=True)
class ObservedFlow:
    key: FlowKey
    count: int
    #: An example pair of pods ("namespace/name", "" when unknown) and the node that saw it.
    source_pod: str = ""
    destination_pod: str = ""
    node: str = ""


@dataclass(frozen=True, slots=True)
class PairChange:
    source: int
    destination: int
    probe: DiffProbe
    allowed_before: bool
    allowed_after: bool
    policies: tuple[PolicyRef, ...]


@dataclass(frozen=True, slots=True)
class FlowChange:
    flow: ObservedFlow
    allowed_before: bool
    allowed_after: bool
    policies: tuple[PolicyRef, ...]


@dataclass(frozen=True, slots=True)
class Preview:
    pairs: tuple[PairChange, ...] = ()
    flows: tuple[FlowChange, ...] = ()
    probes: tuple[DiffProbe, ...] = ()
    #: Observed flows (summed counts) the preview judged, and left out (replies, host traffic...).
    flows_judged: int = 0
    #: Changes pairs and flows cannot show (rules on names), one sentence each.
    notes: tuple[str, ...] = field(default=())

    @property
    def newly_dropped(self) -> int:
        """Observed flows (summed counts) that pass today and would be dropped after the change."""
        return sum(c.flow.count for c in self.flows if c.allowed_before and not c.allowed_after)


def probes_of(policies: Iterable[Policy]) -> tuple[DiffProbe, ...]:
    """The ports the policies name (a range by its first port; every-port rules, and the default deny
    of a rule that enforces a direction, as port 0 of TCP and UDP); named ports cannot be probed
    without a pod and are left out."""
    out: set[DiffProbe] = set()
    for policy in policies:
        for rule in policy.rules:
            if rule.enforce_ingress or rule.enforce_egress:  # its default deny reaches every port
                out.update(DiffProbe(proto, ANY_OTHER_PORT) for proto in (IpProto.TCP, IpProto.UDP))
            for pr in rule.peer_rules:
                for spec in pr.ports:
                    if spec.name:
                        continue
                    protocols = (IpProto.TCP, IpProto.UDP) if spec.protocol is IpProto.ANY else (spec.protocol,)
                    for proto in protocols:
                        out.add(DiffProbe(proto, spec.port_low))
    return tuple(sorted(out))


def _changed_subjects(before: PolicyEngine, after: PolicyEngine) -> set[int]:
    ids = set(before.policies()) | set(after.policies())
    return {i for i in ids if is_endpoint_identity(i) and before.policy_for(i) != after.policy_for(i)}


def _selecting(
    engines: Sequence[PolicyEngine], changed: Sequence[Policy], identity: int, direction: Direction
) -> tuple[PolicyRef, ...]:
    """The changed policies (either version) with a rule that selects ``identity`` and has rules
    in ``direction`` (or enforces it)."""
    out: list[PolicyRef] = []
    for policy in changed:
        for rule in policy.rules:
            enforces = rule.enforce_ingress if direction is Direction.INGRESS else rule.enforce_egress
            if not enforces and not any(pr.direction is direction for pr in rule.peer_rules):
                continue
            if any(identity in engine.selection_set(rule.subject) for engine in engines):
                out.append(policy.key)
                break
    return tuple(sorted(set(out), key=str))


def _allowed(engine: PolicyEngine, subject: int, direction: Direction, remote: int, protocol: int, port: int) -> bool:
    return lookup(engine.policy_for(subject), direction, remote, protocol, port).allowed


def preview(
    before: PolicyEngine,
    after: PolicyEngine,
    changed: Sequence[Policy],
    *,
    pods: Mapping[int, Sequence[str]],
    probes: Sequence[DiffProbe] = (),
    flows: Iterable[ObservedFlow] = (),
) -> Preview:
    """``changed``: every version (old and new) of the policies the change touches. ``pods``: the
    live pods of each endpoint identity (only identities with pods are paired)."""
    engines = (before, after)
    chosen = tuple(sorted(set(probes))) if probes else probes_of(changed)
    subjects = _changed_subjects(before, after)
    peers = sorted(i for i, names in pods.items() if names and is_endpoint_identity(i))
    pairs: list[PairChange] = []
    seen: set[tuple[int, int]] = set()
    for c in sorted(subjects):
        if c not in pods:
            continue
        for other in peers:
            for src, dst in ((c, other), (other, c)):
                if (src, dst) in seen or (src == dst and len(pods.get(src, ())) < 2):
                    continue
                seen.add((src, dst))
                for probe in chosen:
                    out = [_allowed(e, src, Direction.EGRESS, dst, probe.protocol, probe.port) for e in engines]
                    inn = [_allowed(e, dst, Direction.INGRESS, src, probe.protocol, probe.port) for e in engines]
                    was, will = out[0] and inn[0], out[1] and inn[1]
                    if was == will:
                        continue
                    refs: set[PolicyRef] = set()
                    if out[0] != out[1]:
                        refs.update(_selecting(engines, changed, src, Direction.EGRESS))
                    if inn[0] != inn[1]:
                        refs.update(_selecting(engines, changed, dst, Direction.INGRESS))
                    pairs.append(PairChange(src, dst, probe, was, will, tuple(sorted(refs, key=str))))

    flow_changes: list[FlowChange] = []
    judged = 0
    for flow in flows:
        k = flow.key
        # Host traffic passes whatever the policy; flows of identities the change does not touch keep
        # their verdict: neither is judged again.
        if k.remote == ReservedIdentity.HOST or k.subject not in subjects:
            judged += flow.count
            continue
        judged += flow.count
        was = _allowed(before, k.subject, k.direction, k.remote, k.protocol, k.port)
        will = _allowed(after, k.subject, k.direction, k.remote, k.protocol, k.port)
        if was != will:
            flow_changes.append(FlowChange(flow, was, will, _selecting(engines, changed, k.subject, k.direction)))
    flow_changes.sort(key=lambda c: (c.allowed_after, -c.flow.count, c.flow.key))
    notes = tuple(n for i in sorted(subjects) if (n := _names_note(before, after, i, pods.get(i, ()))))
    return Preview(tuple(pairs), tuple(flow_changes), chosen, judged, notes)


def _names_note(before: PolicyEngine, after: PolicyEngine, identity: int, pods: Sequence[str]) -> str:
    """What changes in an identity's rules on names, in one sentence ("" when nothing does)."""
    old, new = (e.policy_for(identity) for e in (before, after))
    was = old.names if old is not None else NameRules()
    will = new.names if new is not None else NameRules()
    if was == will:
        return ""
    parts: list[str] = []
    for what, a, b in (
        ("toFQDNs", {str(f) for f in was.fqdn}, {str(f) for f in will.fqdn}),
        ("DNS rules", {str(d) for d in was.dns}, {str(d) for d in will.dns}),
    ):
        if b - a:
            parts.append(f"{what} added: " + "; ".join(sorted(b - a)))
        if a - b:
            parts.append(f"{what} removed: " + "; ".join(sorted(a - b)))
    who = f"identity {identity}" + (f" ({', '.join(list(pods)[:3])})" if pods else "")
    return f"{who}: rules on names change ({'; '.join(parts)}); connections to learned addresses are not previewed"
