"""The CRD schemas are the engine's field model: they reject the typos the engine rejects.

The API server's strict field validation (kubectl's default) refuses a field the schema does
not declare; here that is emulated by ``additionalProperties: false`` on every object that
keeps no unknown fields, and ``jsonschema`` does the rest.
"""

# ruff: noqa: E501  (the tables of typos read best one case a line)
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from services.policy.engine.fields import openapi_schema
from services.policy.engine.model import PolicyKind, PolicyValidationError
from services.policy.engine.parse import parse_policy
from tests.deploy.manifests import load_documents
from tests.harness import ROOT
from tests.policy import strategies

CRDS = ROOT / "deploy" / "kubernetes" / "crds"
FILES = {
    PolicyKind.CILIUM_NETWORK_POLICY: CRDS / "ciliumnetworkpolicies.yaml",
    PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY: CRDS / "ciliumclusterwidenetworkpolicies.yaml",
}
CILIUM_EXAMPLES = ROOT.parent / "shared" / "testdata" / "cilium-examples"
Obj = dict[str, Any]


def strict(node: Obj) -> Obj:
    """A JSON schema that refuses what the API server refuses under strict field validation."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: strict(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(node["additionalProperties"])
    if "items" in node:
        out["items"] = strict(node["items"])
    return out


def prune_nulls(value: Any) -> Any:
    """What the API server stores: null values of non-nullable fields are dropped first."""
    if isinstance(value, dict):
        return {k: prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune_nulls(v) for v in value]
    return value


VALIDATORS = {kind: jsonschema.Draft4Validator(strict(openapi_schema(kind))) for kind in FILES}
# NetworkPolicy has no CRD (the API server owns it); its model's schema is checked the same way.
VALIDATORS[PolicyKind.NETWORK_POLICY] = jsonschema.Draft4Validator(strict(openapi_schema(PolicyKind.NETWORK_POLICY)))


def schema_errors(doc: Obj) -> list[str]:
    validator = VALIDATORS[PolicyKind(doc["kind"])]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(prune_nulls(doc))]


def engine_error(doc: Obj) -> str:
    try:
        parse_policy(doc)
    except PolicyValidationError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("kind", sorted(FILES))
def test_the_crds_hold_the_schema_of_the_engines_model(kind: PolicyKind) -> None:
    """No drift: scripts/gen_crds.py wrote them from the model, and nobody edited them since."""
    (crd,) = yaml.safe_load_all(FILES[kind].read_text())
    (version,) = crd["spec"]["versions"]
    assert version["schema"]["openAPIV3Schema"] == openapi_schema(kind), "run scripts/gen_crds.py"


def _examples() -> list[tuple[str, Obj]]:
    out = []
    for path in sorted(CILIUM_EXAMPLES.glob("*.yaml")):
        for doc in load_documents(path):
            if isinstance(doc, dict) and doc.get("kind") in {k.value for k in PolicyKind}:
                out.append((path.name, doc))
    return out


CANONICAL_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist"}


def test_every_cilium_example_is_accepted_by_the_schema_and_the_engine() -> None:
    examples = _examples()
    if not examples:
        pytest.skip(f"no Cilium policy corpus at {CILIUM_EXAMPLES}")
    assert len({name for name, _ in examples}) >= 100
    refused: set[str] = set()
    for name, doc in examples:
        policy = parse_policy(doc)
        errors = schema_errors(doc)
        if errors:
            # Two legacy forms the engine accepts with a warning, as Cilium's agent reads them, and
            # that the API server refuses with Cilium's own CRDs too: a lower-case operator, and
            # labels indented at the level of an empty matchLabels (examples/policies/multi_rule.yaml).
            paths = [e.split(":")[0] for e in errors]
            assert all(any(p in _dotted(w) for w in policy.warnings) for p in paths), f"{name}: {errors}"
            refused.add(name)
    assert len(refused) <= 3, refused


def _dotted(warning: str) -> str:
    """``spec.ingress[0].fromEndpoints[0].role: ...`` as jsonschema's ``spec.ingress.0.fromEndpoints.0``."""
    path = warning.split(":")[0]
    return path.replace("[", ".").replace("]", "")


# --- the same typos, refused by both ------------------------------------------------------------

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


def _doc(kind: str) -> Obj:
    if kind == "NetworkPolicy":
        return yaml.safe_load(KNP)
    doc: Obj = yaml.safe_load(CNP)
    if kind == "CiliumClusterwideNetworkPolicy":
        doc["kind"] = kind
        del doc["metadata"]["namespace"]
    return doc


def _rename(old: str, new: str) -> Callable[[Obj], None]:
    def change(node: Obj) -> None:
        node[new] = node.pop(old)

    return change


def _set(key: str, value: Any) -> Callable[[Obj], None]:
    return lambda node: node.__setitem__(key, value)


Edit = tuple[str, Callable[[Obj], Obj], Callable[[Obj], None], str]
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


@pytest.mark.parametrize(
    ("kind", "case", "where", "edit", "path", "words"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_the_engine_and_the_schema_refuse_the_same_typos(
    kind: str, case: str, where: Callable[[Obj], Any], edit: Callable[[Obj], None], path: str, words: str
) -> None:
    doc = _doc(kind)
    assert engine_error(doc) == "" and schema_errors(doc) == []
    edit(where(doc))
    error = engine_error(doc)
    name = "CiliumClusterwideNetworkPolicy p" if kind == "CiliumClusterwideNetworkPolicy" else f"{kind} x/p"
    assert error.startswith(f"{name}: {path}: "), error
    assert words in error, error
    errors = schema_errors(doc)
    assert errors, f"the schema accepts {case}"
    if kind != "NetworkPolicy" or case != "enum:protocol":
        last = path.rsplit(".", 1)[-1].split("[")[0]
        assert any(last in e for e in errors), errors


# --- any policy the engine accepts is valid under the schema, and typos are refused by both -----


def _objects(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of the objects inside ``value`` (to misspell one of their keys)."""
    out = []
    if isinstance(value, dict):
        if value:
            out.append(path)
        for k, v in value.items():
            if path == () and k == "metadata":
                continue
            out += _objects(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _objects(v, (*path, i))
    return out


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _misspell(key: str, how: int) -> str:
    return [key[:-1], key + "s", key.lower() if key != key.lower() else key.upper(), key[0] + key[2:]][how % 4] or "x"


@settings(max_examples=300, deadline=None)
@given(doc=strategies.documents, data=st.data())
def test_what_the_engine_accepts_the_schema_accepts_and_typos_are_refused_by_both(doc: Obj, data: Any) -> None:
    accepted = engine_error(doc) == ""
    if accepted:
        assert schema_errors(doc) == [], (doc, schema_errors(doc))
    if not accepted:
        return
    typo = copy.deepcopy(doc)
    node_path = data.draw(st.sampled_from(_objects(typo)))
    node = _at(typo, node_path)
    key = data.draw(st.sampled_from(sorted(node)))
    new = _misspell(str(key), data.draw(st.integers(0, 3)))
    if new in node or (node_path and node_path[-1] == "matchLabels") or (node_path == () and key != "spec"):
        return  # matchLabels keys are labels (any name is valid); apiVersion and kind have their own checks
    node[new] = node.pop(key)
    error = engine_error(typo)
    assert error, (typo, new)
    assert schema_errors(typo), (typo, new)
