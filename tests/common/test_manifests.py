"""The one YAML/JSON document splitter: which objects come out, labelled how, and what is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.common.errors import Code
from services.common.manifests import MAX_DEPTH, DocumentError, split_documents

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}}
NP = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "b"}}


def _nested(levels: int) -> dict[str, Any]:
    """An object ``levels`` mappings deep."""
    doc: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        doc = {"x": doc}
    return doc


# (origin, text, json_file, expected [(label, name or kind)])
SPLITS: list[tuple[str, str, bool, list[tuple[str, str]]]] = [
    ("f.yaml", "", False, []),
    ("f.yaml", "---\n---\n", False, []),
    ("f.yaml", json.dumps(POD), False, [("f.yaml", "a")]),
    ("f.yaml", f"{json.dumps(POD)}\n---\n---\n{json.dumps(NP)}\n", False, [("f.yaml[0]", "a"), ("f.yaml[1]", "b")]),
    (
        "f.yaml",
        json.dumps({"apiVersion": "v1", "kind": "List", "items": [POD, NP]}),
        False,
        [("f.yaml.items[0]", "a"), ("f.yaml.items[1]", "b")],
    ),
    (
        "f.yaml",
        f"{json.dumps(POD)}\n---\n" + json.dumps({"kind": "NetworkPolicyList", "items": [NP]}),
        False,
        [("f.yaml[0]", "a"), ("f.yaml[1].items[0]", "b")],
    ),
    ("f.yaml", json.dumps({"kind": "List", "items": []}), False, []),
    ("f.yaml", json.dumps({"kind": "List"}), False, [("f.yaml", "List")]),  # no items: an object like any other
    ("f.yaml", json.dumps({"kind": "Blacklist", "items": "x"}), False, [("f.yaml", "Blacklist")]),
    ("f.json", json.dumps([POD, NP]), True, [("f.json[0]", "a"), ("f.json[1]", "b")]),
    ("f.yaml", "- " + json.dumps(POD), False, [("f.yaml[0]", "a")]),
    ("", json.dumps(POD), False, [("documents", "a")]),
    ("f.json", "null", True, []),
]


@pytest.mark.parametrize(("origin", "text", "json_file", "expected"), SPLITS)
def test_split(origin: str, text: str, json_file: bool, expected: list[tuple[str, str]]) -> None:
    docs = split_documents(text, origin, json_file=json_file)
    assert [(d.source, d.body.get("metadata", {}).get("name") or d.body["kind"]) for d in docs] == expected


# (origin, text, json_file, message pattern)
ERRORS: list[tuple[str, str, bool, str]] = [
    ("f.yaml", "just a string", False, r"^f.yaml: expected an object with apiVersion, kind and metadata, got str$"),
    ("f.yaml", f"{json.dumps(POD)}\n---\n- 1\n", False, r"^f.yaml\[1\]\[0\]: expected an object .*, got int$"),
    ("f.yaml", json.dumps({"kind": "List", "items": [POD, "x"]}), False, r"^f.yaml.items\[1\]: expected an object"),
    (
        "f.yaml",
        "kind: [unclosed",
        False,
        r"^f.yaml: not valid YAML or JSON at line [12], column \d+: .*expected ','.*flow sequence at line 1, column 7",
    ),
    ("f.json", '{"kind": "Pod",', True, r"^f.json: not valid JSON at line 1, column 16: Expecting"),
    ("f.json", "kind: Pod", True, r"^f.json: not valid JSON at line 1, column 1"),
    ("", "- 1", False, r"^documents\[0\]: expected an object"),
    ("f.yaml", "[" * 5000 + "]" * 5000, False, r"^f.yaml: document nested too deeply for the parser"),
    ("f.json", "[" * 5000 + "]" * 5000, True, r"^f.json: document nested too deeply for the parser"),
    ("f.json", '{"a": ' * 5000 + "1" + "}" * 5000, True, r"^f.json: document nested too deeply for the parser"),
    (
        "f.yaml",
        f"{json.dumps(POD)}\n---\n{json.dumps(_nested(MAX_DEPTH + 1))}",
        False,
        rf"^f.yaml\[1\]: document nested too deeply \(more than {MAX_DEPTH} levels\)",
    ),
    ("f.yaml", "&a {kind: Pod, self: *a}", False, r"^f.yaml: an object contains itself"),
]


@pytest.mark.parametrize(("origin", "text", "json_file", "message"), ERRORS)
def test_refused(origin: str, text: str, json_file: bool, message: str) -> None:
    with pytest.raises(DocumentError, match=message) as err:
        split_documents(text, origin, json_file=json_file)
    assert isinstance(err.value, ValueError) and err.value.code is Code.INVALID_ARGUMENT


def test_nesting_up_to_the_limit_is_accepted() -> None:
    [doc] = split_documents(json.dumps(_nested(MAX_DEPTH)), "f.json", json_file=True)
    assert "x" in doc.body


def test_shared_aliases_are_walked_once() -> None:
    """An alias bomb (each level refers nine times to the one below) is checked in time linear in its text."""
    lines = ["a0: &a0 [x]"]
    for i in range(1, 40):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("kind: Bomb")
    [doc] = split_documents("\n".join(lines), "bomb.yaml")
    assert doc.body["kind"] == "Bomb"


def test_aliases_deeper_than_the_limit_through_sharing_are_refused() -> None:
    lines = ["a0: &a0 {leaf: 1}"] + [f"a{i}: &a{i} {{x: *a{i - 1}, y: *a{i - 1}}}" for i in range(1, MAX_DEPTH + 1)]
    with pytest.raises(DocumentError, match="nested too deeply"):
        split_documents("\n".join(lines), "deep.yaml")
