"""Kubernetes objects as plain dicts: tolerant accessors, and the Service/EndpointSlice rules that the
watcher, the datapath and the policy engine all apply. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The label tying an EndpointSlice to its Service (set by the slice controller).
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def as_map(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one (a field missing or of the wrong type)."""
    return value if isinstance(value, Mapping) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def slice_service(obj: Mapping[str, Any]) -> str:
    """The name of the Service an EndpointSlice belongs to ("" for none)."""
    return str(as_map(as_map(obj.get("metadata")).get("labels")).get(SERVICE_NAME_LABEL) or "")


def endpoint_serves(endpoint: Mapping[str, Any]) -> bool:
    """Whether an EndpointSlice endpoint takes traffic: ready and not terminating (absent conditions count as
    ready and not terminating, as Kubernetes specifies)."""
    conditions = as_map(endpoint.get("conditions"))
    return conditions.get("ready") is not False and conditions.get("terminating") is not True
