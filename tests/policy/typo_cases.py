# ruff: noqa: E501  (the tables of typos read best one case a line)
"""Misspelled and mistyped fields at every depth of the three policy kinds, with the error expected.

Shared by the tests of each entry point (the engine and the CRD schemas, ``palisade analyze``,
``ImportPolicies`` and the watcher's deltas). Each case: (kind, case, node to edit, edit, the
field's path in the error, words of the error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

Obj = dict[str, Any]

KNP = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: x}
spec:
  podSelector: {matchLabels: {app: c}}
  policyTypes: [Ingress, Egress]
  ingress:
  - from:
    - podSelector: {matchExpressions: [{key: app, operator: In, values: [a]}]}
      namespaceSelector: {matchLabels: {team: t}}
    - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}
    ports: [{port: 80, endPort: 90, protocol: TCP}]
  egress:
  - to: [{podSelector: {}}]
    ports: [{port: dns, protocol: UDP}]
"""
CNP = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: p, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: c}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: a}}]
    toPorts: [{ports: [{port: "80", protocol: TCP}], rules: {http: [{method: GET, path: /}]}}]
  - fromCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]
    icmps: [{fields: [{family: IPv4, type: EchoRequest}]}]
  ingressDeny:
  - fromEntities: [world]
    toPorts: [{ports: [{port: "22"}]}]
  egress:
  - toEndpoints: [{matchExpressions: [{key: app, operator: NotIn, values: [b]}]}]
  - toFQDNs: [{matchName: example.com}]
    toPorts: [{ports: [{port: "53", protocol: ANY}], rules: {dns: [{matchPattern: "*"}]}}]
  - toServices: [{k8sService: {serviceName: s, namespace: x}}]
  egressDeny:
  - toCIDR: [192.0.2.0/24]
  enableDefaultDeny: {ingress: true, egress: true}
"""


def doc_of(kind: str) -> Obj:
    if kind == "NetworkPolicy":
        knp: Obj = yaml.safe_load(KNP)
        return knp
    doc: Obj = yaml.safe_load(CNP)
    if kind == "CiliumClusterwideNetworkPolicy":
        doc["kind"] = kind
        del doc["metadata"]["namespace"]
    return doc


def _rename(old: str, new: str) -> Callable[[Obj], None]:
    def change(node: Obj) -> None:
        node[new] = node.pop(old)

    return change


def _set(key: str | int, value: Any) -> Callable[[Any], None]:
    """Set ``key`` of an object (or index of a list) to ``value``."""

    def change(node: Any) -> None:
        node[key] = value

    return change


CILIUM_EDITS: list[tuple[str, Callable[[Obj], Any], Callable[[Obj], None], str, str]] = [
    # (case, node to edit, edit, path in the engine's error, words)
    ("top", lambda d: d, _rename("spec", "sepc"), "sepc", "did you mean 'spec'"),
    ("rule", lambda d: d["spec"], _rename("ingress", "ingres"), "spec.ingres", "did you mean 'ingress'"),
    ("rule-selector", lambda d: d["spec"], _rename("endpointSelector", "endpointselector"), "spec.endpointselector", "did you mean 'endpointSelector'"),
    ("peer", lambda d: d["spec"]["ingress"][0], _rename("fromEndpoints", "fromEndpoint"), "spec.ingress[0].fromEndpoint", "did you mean 'fromEndpoints'"),
    ("selector", lambda d: d["spec"]["ingress"][0]["fromEndpoints"][0], _rename("matchLabels", "matchLabel"), "spec.ingress[0].fromEndpoints[0].matchLabel", "did you mean 'matchLabels'"),
    ("expression", lambda d: d["spec"]["egress"][0]["toEndpoints"][0]["matchExpressions"][0], _rename("values", "value"), "spec.egress[0].toEndpoints[0].matchExpressions[0].value", "did you mean 'values'"),
    ("port-rule", lambda d: d["spec"]["ingress"][0]["toPorts"][0], _rename("ports", "port"), "spec.ingress[0].toPorts[0].port", "did you mean 'ports'"),
    ("port", lambda d: d["spec"]["ingress"][0]["toPorts"][0]["ports"][0], _rename("protocol", "protocl"), "spec.ingress[0].toPorts[0].ports[0].protocl", "did you mean 'protocol'"),
    ("l7", lambda d: d["spec"]["ingress"][0]["toPorts"][0]["rules"]["http"][0], _rename("method", "methd"), "spec.ingress[0].toPorts[0].rules.http[0].methd", "did you mean 'method'"),
    ("cidr-set", lambda d: d["spec"]["ingress"][1]["fromCIDRSet"][0], _rename("except", "excep"), "spec.ingress[1].fromCIDRSet[0].excep", "did you mean 'except'"),
    ("icmp", lambda d: d["spec"]["ingress"][1]["icmps"][0]["fields"][0], _rename("type", "typ"), "spec.ingress[1].icmps[0].fields[0].typ", "did you mean 'type'"),
    ("deny", lambda d: d["spec"]["ingressDeny"][0], _rename("fromEntities", "fromEntity"), "spec.ingressDeny[0].fromEntity", "did you mean 'fromEntities'"),
    ("deny-l7", lambda d: d["spec"]["ingressDeny"][0]["toPorts"][0], _set("rules", {"http": []}), "spec.ingressDeny[0].toPorts[0].rules", "unknown field"),
    ("fqdn", lambda d: d["spec"]["egress"][1]["toFQDNs"][0], _rename("matchName", "matchname"), "spec.egress[1].toFQDNs[0].matchname", "did you mean 'matchName'"),
    ("service", lambda d: d["spec"]["egress"][2]["toServices"][0]["k8sService"], _rename("serviceName", "service"), "spec.egress[2].toServices[0].k8sService.service", "did you mean 'serviceName'"),
    ("default-deny", lambda d: d["spec"]["enableDefaultDeny"], _rename("egress", "egres"), "spec.enableDefaultDeny.egres", "did you mean 'egress'"),
    ("type:list", lambda d: d["spec"]["egressDeny"][0], _set("toCIDR", "192.0.2.0/24"), "spec.egressDeny[0].toCIDR", "must be a list"),
    ("type:object", lambda d: d["spec"], _set("endpointSelector", ["app"]), "spec.endpointSelector", "must be an object"),
    ("type:label", lambda d: d["spec"]["endpointSelector"]["matchLabels"], _set("app", ["c"]), "spec.endpointSelector.matchLabels.app", "must be a string"),
    ("type:bool", lambda d: d["spec"]["enableDefaultDeny"], _set("ingress", "yes"), "spec.enableDefaultDeny.ingress", "must be true or false"),
    ("type:endPort", lambda d: d["spec"]["ingress"][0]["toPorts"][0]["ports"][0], _set("endPort", "90"), "spec.ingress[0].toPorts[0].ports[0].endPort", "must be an integer"),
    ("range:endPort", lambda d: d["spec"]["ingress"][0]["toPorts"][0]["ports"][0], _set("endPort", 70000), "spec.ingress[0].toPorts[0].ports[0].endPort", "out of range"),
    ("enum:protocol", lambda d: d["spec"]["ingress"][0]["toPorts"][0]["ports"][0], _set("protocol", "TPC"), "spec.ingress[0].toPorts[0].ports[0].protocol", "did you mean 'TCP'"),
    ("enum:entity", lambda d: d["spec"]["ingressDeny"][0]["fromEntities"], _set(0, "wrold"), "spec.ingressDeny[0].fromEntities[0]", "did you mean 'world'"),
    ("enum:icmp", lambda d: d["spec"]["ingress"][1]["icmps"][0]["fields"][0], _set("type", "EchoRequets"), "spec.ingress[1].icmps[0].fields[0].type", "unknown value"),
    ("enum:family", lambda d: d["spec"]["ingress"][1]["icmps"][0]["fields"][0], _set("family", "IPv5"), "spec.ingress[1].icmps[0].fields[0].family", "unknown value"),
]  # fmt: skip
KNP_EDITS: list[tuple[str, Callable[[Obj], Any], Callable[[Obj], None], str, str]] = [
    ("top", lambda d: d, _rename("spec", "spc"), "spc", "did you mean 'spec'"),
    ("spec", lambda d: d["spec"], _rename("ingress", "ingres"), "spec.ingres", "did you mean 'ingress'"),
    ("types", lambda d: d["spec"], _rename("policyTypes", "policyType"), "spec.policyType", "did you mean 'policyTypes'"),
    ("rule", lambda d: d["spec"]["ingress"][0], _rename("from", "form"), "spec.ingress[0].form", "did you mean 'from'"),
    ("peer", lambda d: d["spec"]["ingress"][0]["from"][0], _rename("podSelector", "podselector"), "spec.ingress[0].from[0].podselector", "did you mean 'podSelector'"),
    ("selector", lambda d: d["spec"]["ingress"][0]["from"][0]["namespaceSelector"], _rename("matchLabels", "matchlabels"), "spec.ingress[0].from[0].namespaceSelector.matchlabels", "did you mean 'matchLabels'"),
    ("expression", lambda d: d["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0], _rename("operator", "op"), "spec.ingress[0].from[0].podSelector.matchExpressions[0].op", "unknown field"),
    ("ip-block", lambda d: d["spec"]["ingress"][0]["from"][1]["ipBlock"], _rename("except", "exept"), "spec.ingress[0].from[1].ipBlock.exept", "did you mean 'except'"),
    ("port", lambda d: d["spec"]["ingress"][0]["ports"][0], _rename("endPort", "endport"), "spec.ingress[0].ports[0].endport", "did you mean 'endPort'"),
    ("egress", lambda d: d["spec"]["egress"][0], _rename("to", "too"), "spec.egress[0].too", "did you mean 'to'"),
    ("type:ports", lambda d: d["spec"]["egress"][0], _set("ports", {"port": 53}), "spec.egress[0].ports", "must be a list"),
    ("type:endPort", lambda d: d["spec"]["ingress"][0]["ports"][0], _set("endPort", "90"), "spec.ingress[0].ports[0].endPort", "must be an integer"),
    ("enum:protocol", lambda d: d["spec"]["ingress"][0]["ports"][0], _set("protocol", "tcp"), "spec.ingress[0].ports[0].protocol", "did you mean 'TCP'"),
    ("enum:type", lambda d: d["spec"]["policyTypes"], _set(1, "Egres"), "spec.policyTypes[1]", "did you mean 'Egress'"),
]  # fmt: skip
CASES = [(k, *e) for k in ("CiliumNetworkPolicy", "CiliumClusterwideNetworkPolicy") for e in CILIUM_EDITS] + [
    ("NetworkPolicy", *e) for e in KNP_EDITS
]
