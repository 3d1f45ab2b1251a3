"""The policy documents of ``palisade policy import``: written back as YAML, checked before use. Pure (yaml only).

Splitting text into documents is :mod:`services.common.manifests`' job; this module
dumps a document as a policy's status shows it (libyaml's C dumper when PyYAML has
it) and refuses names and selector labels Kubernetes would refuse.
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

_Dumper: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


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
            if value is not None and not isinstance(value, str):
                continue  # the parser reports the wrong type with its path
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
                if isinstance(value, str):  # else the parser reports the wrong type
                    validate_label_value(value, f"{where}.values[{j}]")


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
