"""``toServices``: the Services a policy names, expanded into selectors of their backends.

Pure. As Cilium translates ``toServices``: a Service with a pod selector stands for
its backend pods, so it becomes an endpoint selector of those labels in the
Service's namespace; a Service without one (its EndpointSlices written by hand,
often for something outside the cluster) stands for its endpoints' addresses, so
it becomes one host CIDR per ready endpoint address. ``k8sService`` names one
Service; ``k8sServiceSelector`` matches Services by their labels. A namespace left
out means the policy's own namespace, or every namespace for a clusterwide policy.

The engine keeps each policy as declared and gives the selector cache the expanded
form; a Service or EndpointSlice change re-expands the policies that can name it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from services.common.k8sobjects import as_list, as_map, endpoint_serves, slice_service
from services.common.labels import LabelSet, LabelSource
from services.policy.engine.model import PeerRule, Policy, ServiceRef
from services.policy.engine.selector import (
    CIDRSelector,
    EndpointSelector,
    Operator,
    Requirement,
    Selector,
    namespace_requirement,
)


@dataclasses.dataclass(frozen=True)
class ServiceRecord:
    """What of a Service (and its EndpointSlices) a policy can name."""

    namespace: str
    name: str
    labels: LabelSet
    #: The pod selector; None for a Service without one.
    selector: Mapping[str, str] | None
    #: Ready endpoint addresses of its EndpointSlices (used only without a selector).
    addresses: tuple[str, ...] = ()


def service_fields(obj: Mapping[str, Any]) -> tuple[LabelSet, Mapping[str, str] | None]:
    """A Service object's labels and pod selector."""
    meta, spec = as_map(obj.get("metadata")), as_map(obj.get("spec"))
    labels = LabelSet.from_mapping(
        {str(k): str(v) for k, v in as_map(meta.get("labels")).items()}, source=LabelSource.K8S
    )
    raw = as_map(spec.get("selector"))
    selector = {str(k): str(v) for k, v in raw.items()} if raw and spec.get("type") != "ExternalName" else None
    return labels, selector


def slice_fields(obj: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """An EndpointSlice's Service name and its ready, non-terminating endpoints' addresses."""
    out: list[str] = []
    for ep in map(as_map, as_list(obj.get("endpoints"))):
        if not endpoint_serves(ep):
            continue
        for address in as_list(ep.get("addresses")):
            try:
                out.append(str(ipaddress.ip_address(str(address))))
            except ValueError:
                continue
    return slice_service(obj), tuple(sorted(set(out)))


class ServiceRegistry:
    """The cluster's Services as policies see them."""

    def __init__(self) -> None:
        self._services: dict[tuple[str, str], tuple[LabelSet, Mapping[str, str] | None]] = {}
        #: (namespace, slice name) -> its service name
        self._slice_service: dict[tuple[str, str], str] = {}
        #: (namespace, service name) -> slice name -> the slice's ready addresses
        self._slices: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {}

    def set_service(self, namespace: str, name: str, obj: Mapping[str, Any] | None) -> None:
        """Add, change or (``obj`` None) remove a Service."""
        if obj is None:
            self._services.pop((namespace, name), None)
        else:
            self._services[(namespace, name)] = service_fields(obj)

    def slice_matters(self, namespace: str, name: str, obj: Mapping[str, Any] | None) -> bool:
        """Whether adding, changing or (``obj`` None) deleting this slice can change an expansion: only
        when it belongs, before or after, to a Service without a selector (slices churn with pods;
        the others' backends are their pods, whatever the slices say)."""
        services = {self._slice_service.get((namespace, name)), slice_service(obj) if obj is not None else None}
        return any(
            (namespace, service) in self._services and self._services[(namespace, service)][1] is None
            for service in services
            if service
        )

    def set_slice(self, namespace: str, name: str, obj: Mapping[str, Any] | None) -> None:
        old = self._slice_service.pop((namespace, name), None)
        if old is not None:
            held = self._slices.get((namespace, old), {})
            held.pop(name, None)
            if not held:
                self._slices.pop((namespace, old), None)
        if obj is not None:
            service, addresses = slice_fields(obj)
            self._slice_service[(namespace, name)] = service
            self._slices.setdefault((namespace, service), {})[name] = addresses

    def records(self) -> Iterable[ServiceRecord]:
        for (namespace, name), (labels, selector) in sorted(self._services.items()):
            addresses: set[str] = set()
            if selector is None:
                for addrs in self._slices.get((namespace, name), {}).values():
                    addresses.update(addrs)
            yield ServiceRecord(namespace, name, labels, selector, tuple(sorted(addresses)))

    def selected(self, ref: ServiceRef) -> list[ServiceRecord]:
        out = []
        for record in self.records():
            if ref.namespace is not None and record.namespace != ref.namespace:
                continue
            if ref.name is not None and record.name != ref.name:
                continue
            if ref.selector is not None and not ref.selector.matches_labels(record.labels):
                continue
            out.append(record)
        return out

    def backends(self, ref: ServiceRef) -> list[Selector]:
        """The selectors standing for the backends of the Services ``ref`` names."""
        out: list[Selector] = []
        for record in self.selected(ref):
            if record.selector is not None:
                reqs = [Requirement(LabelSource.K8S, k, Operator.IN, (v,)) for k, v in sorted(record.selector.items())]
                out.append(EndpointSelector((*reqs, namespace_requirement(record.namespace))))
            else:
                out.extend(CIDRSelector(ipaddress.ip_network(a)) for a in record.addresses)
        return out

    def expand(self, policy: Policy) -> Policy:
        """``policy`` with each ``toServices`` rule's peers extended by the named Services' backends."""
        if not has_service_peers(policy):
            return policy
        rules = []
        for rule in policy.rules:
            peer_rules = []
            for pr in rule.peer_rules:
                if pr.services and pr.peers is not None:
                    extra = [sel for ref in pr.services for sel in self.backends(ref)]
                    pr = dataclasses.replace(pr, peers=tuple(dict.fromkeys((*pr.peers, *extra))))
                peer_rules.append(pr)
            rules.append(dataclasses.replace(rule, peer_rules=tuple(peer_rules)))
        return dataclasses.replace(policy, rules=tuple(rules))


def has_service_peers(policy: Policy) -> bool:
    return any(pr.services for rule in policy.rules for pr in rule.peer_rules)


def service_peer_rules(policy: Policy) -> list[PeerRule]:
    return [pr for rule in policy.rules for pr in rule.peer_rules if pr.services]
