"""The CRD schemas are the engine's field model: they reject the typos the engine rejects.

The API server's strict field validation (kubectl's default) refuses a field the schema does
not declare; here that is emulated by ``additionalProperties: false`` on every object that
keeps no unknown fields, and ``jsonschema`` does the rest.
"""

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
from testkit.harness import ROOT
from tests.deploy.manifests import load_documents
from tests.policy import strategies
from tests.policy.typo_cases import CASES, doc_of

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


@pytest.mark.parametrize(
    ("kind", "case", "where", "edit", "path", "words"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_the_engine_and_the_schema_refuse_the_same_typos(
    kind: str, case: str, where: Callable[[Obj], Any], edit: Callable[[Obj], None], path: str, words: str
) -> None:
    doc = doc_of(kind)
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
