"""Watched objects as the watcher holds them: a key, identity fields and the (stripped) body.

Pure: conversion from API/manifest dicts, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.subjects import k8s_subject
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
