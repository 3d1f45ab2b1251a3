"""Watched objects as the watcher holds them: a key, identity fields and the (stripped) body.

Pure: conversion from API/manifest dicts, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import Code, PalisadeError, clip
from services.common.subjects import k8s_subject
from services.common.validation import validate_label_key, validate_label_value, validate_name, validate_namespace
from services.watcher.filter import strip_noise
from services.watcher.kinds import Kind, KindInfo


class ObjectError(ValueError):
    """An object dict lacks what every Kubernetes object has (metadata.name)."""


@dataclass(frozen=True, slots=True, order=True)
class ObjectKey:
    """Identifies one object: the subject it lives on is derived from it."""

    kind: Kind
    #: "" for cluster-scoped kinds.
    namespace: str
    name: str
    #: Computed once: a listing of a big cluster looks every key up several times (an enum's
    #: hash is Python code).
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind.value, self.namespace, self.name)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def subject(self) -> str:
        return k8s_subject(self.kind, self.namespace, self.name)

    def __str__(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}" if self.namespace else f"{self.kind}/{self.name}"


@dataclass(frozen=True, slots=True)
class KObject:
    """One object as last seen. ``body`` is never mutated after construction."""

    info: KindInfo
    key: ObjectKey
    uid: str
    resource_version: str
    body: Mapping[str, Any]
    #: For manifest sources: the file (relative to the folder) holding the object.
    origin: str = ""
    #: For manifest sources: why other definitions of this object in other files are ignored.
    conflict: str = ""


def check_names(info: KindInfo, name: str, namespace: str, labels: object) -> None:
    """Names, namespace and labels as Kubernetes accepts them; PalisadeError naming the field otherwise.

    Objects from the API server already passed these checks there; manifest files did not,
    and a name such as ``a.*.>`` must never reach a subject on the bus.
    """
    if info.kind is Kind.NAMESPACE:
        validate_namespace(name, "metadata.name")
    else:
        validate_name(name, "metadata.name")
    if info.namespaced:
        validate_namespace(namespace, "metadata.namespace")
    if labels is None:
        return
    if not isinstance(labels, Mapping):
        raise PalisadeError("metadata.labels must be a map of key: value", Code.INVALID_ARGUMENT)
    for key, value in labels.items():
        validate_label_key(str(key), "metadata.labels key")
        validate_label_value("" if value is None else str(value), f"metadata.labels[{clip(str(key), 80)}]")


def metadata(body: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = body.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def from_api(info: KindInfo, raw: Mapping[str, Any], *, origin: str = "") -> KObject:
    """A KObject from an API object (list item or watch event object).

    List items come without apiVersion/kind (the API server leaves them out), so
    they are filled in: consumers parse ``object_json`` on its own. managedFields
    are stripped.
    """
    body = strip_noise(raw)
    body.setdefault("apiVersion", info.api_version)
    body.setdefault("kind", info.api_kind)
    meta = metadata(body)
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ObjectError(f"{info.api_kind} without metadata.name")
    namespace = str(meta.get("namespace") or "") if info.namespaced else ""
    return KObject(
        info=info,
        key=ObjectKey(info.kind, namespace, name),
        uid=str(meta.get("uid") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        body=body,
        origin=origin,
    )
