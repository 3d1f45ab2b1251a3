"""Reading and writing the YAML/JSON documents of ``palisade policy import``. Pure (yaml only).

libyaml's C loader and dumper are used when PyYAML has them (a 5 MB file loads in
seconds instead of tens of seconds). Nesting is bounded: a document nested deeper
than :data:`MAX_DEPTH` levels is refused with a clear error before any object is
built from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from services.common.errors import PalisadeError, clip
from services.common.validation import (
    validate_identity_label,
    validate_label_value,
    validate_name,
    validate_namespace,
)

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

#: Deepest nesting accepted in a document; real policies stay below 20.
MAX_DEPTH = 64


class DocumentError(ValueError):
    """The documents of an import cannot be read."""


def _too_deep(text: str) -> str | None:
    """Where ``text`` nests deeper than MAX_DEPTH, scanning parser events only.

    Must run before anything builds objects: libyaml's composer recurses in C and
    crashes the process on documents nested a hundred thousand levels deep.
    """
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    mark = event.start_mark
                    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        return None  # reported with its position by the load that follows
    return None


def split_documents(text: str, origin: str) -> list[tuple[str, Mapping[str, Any]]]:
    """(label, object) for each object in multi-document YAML/JSON; ``List`` kinds are expanded."""
    where = origin or "documents"
    too_deep = f"{where}: nested more than {MAX_DEPTH} levels deep; policies are never that deep"
    at = _too_deep(text)
    if at is not None:
        raise DocumentError(f"{too_deep} (at {at})")
    try:
        loaded = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise DocumentError(f"{where}: not valid YAML or JSON{at}: {problem}") from None
    except RecursionError:
        raise DocumentError(too_deep) from None
    out: list[tuple[str, Mapping[str, Any]]] = []
    for i, doc in enumerate(loaded):
        label = f"{where}[{i}]" if len(loaded) > 1 else where
        if not isinstance(doc, Mapping):
            raise DocumentError(f"{label}: expected an object with kind and metadata, got {type(doc).__name__}")
        items = doc.get("items")
        if str(doc.get("kind", "")).endswith("List") and isinstance(items, list):
            for j, item in enumerate(items):
                if not isinstance(item, Mapping):
                    raise DocumentError(f"{label}.items[{j}]: expected an object, got {type(item).__name__}")
                out.append((f"{label}.items[{j}]", item))
        else:
            out.append((label, doc))
    if not out:
        raise DocumentError(f"{where}: no documents; pass the YAML or JSON of one or more policies")
    return out


def dump_document(doc: Mapping[str, Any]) -> str:
    """The YAML a policy's status shows for ``doc`` (keys in their original order)."""
    return str(yaml.dump(dict(doc), Dumper=_Dumper, sort_keys=False))


#: Keys whose value is a label selector, wherever they appear in a policy.
_SELECTOR_KEYS = frozenset({"podSelector", "namespaceSelector", "endpointSelector", "nodeSelector"})
_SELECTOR_LISTS = frozenset({"fromEndpoints", "toEndpoints", "fromRequires", "toRequires", "fromNodes", "toNodes"})


def _split_source(key: str) -> tuple[str, str]:
    """``k8s:app`` -> (``k8s``, ``app``); keys without a source are Kubernetes labels."""
    source, colon, rest = key.partition(":")
    if colon and source and source.isalnum():
        return source, rest
    return "k8s", key


def _check_selector(selector: Any, path: str) -> None:
    if not isinstance(selector, Mapping):
        return  # the parser reports the wrong type with its path
    labels = selector.get("matchLabels")
    if isinstance(labels, Mapping):
        for key, value in labels.items():
            source, name = _split_source(str(key))
            validate_identity_label(source, name, "" if value is None else str(value), f"{path}.matchLabels")
    expressions = selector.get("matchExpressions")
    if isinstance(expressions, list):
        for i, expr in enumerate(expressions):
            if not isinstance(expr, Mapping):
                continue
            where = f"{path}.matchExpressions[{i}]"
            source, name = _split_source(str(expr.get("key", "")))
            validate_identity_label(source, name, "", where)
            values = expr.get("values")
            for j, value in enumerate(values if isinstance(values, list) else []):
                validate_label_value(str(value), f"{where}.values[{j}]")


def validate_document(doc: Mapping[str, Any], where: str) -> None:
    """Refuse names, namespaces and selector labels Kubernetes would refuse (PalisadeError, INVALID_ARGUMENT).

    What the policy means is the parser's business; this checks only what makes an object
    unaddressable or a selector unmatchable, so such a document never gets stored or echoed.
    """
    try:
        meta = doc.get("metadata")
        if isinstance(meta, Mapping):
            if meta.get("name") is not None:
                validate_name(str(meta["name"]), "metadata.name")
            if meta.get("namespace"):
                validate_namespace(str(meta["namespace"]), "metadata.namespace")
        stack: list[tuple[Any, str]] = [(doc.get("spec"), "spec"), (doc.get("specs"), "specs")]
        while stack:
            item, path = stack.pop()
            if isinstance(item, Mapping):
                for key, child in item.items():
                    child_path = f"{path}.{key}"
                    if key in _SELECTOR_KEYS:
                        _check_selector(child, child_path)
                    elif key in _SELECTOR_LISTS and isinstance(child, list):
                        for i, selector in enumerate(child):
                            _check_selector(selector, f"{child_path}[{i}]")
                    else:
                        stack.append((child, child_path))
            elif isinstance(item, list):
                stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    except PalisadeError as exc:
        raise PalisadeError(clip(f"{where}: {exc.message}"), exc.code) from None
