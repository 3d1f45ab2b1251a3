"""The state of parsing one policy object: its name for errors, and what it reports (unsupported
features, warnings), with the two shape checks every part of the parser uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.policy.engine.model import PolicyRef, PolicyValidationError


class ParseContext:
    """Per-object parse state: the object's name for errors, and the reports."""

    def __init__(self, key: PolicyRef, cluster: str) -> None:
        self.key = key
        self.obj = str(key)
        self.cluster = cluster
        self.unsupported: list[str] = []
        self.warnings: list[str] = []

    def error(self, path: str, message: str) -> PolicyValidationError:
        return PolicyValidationError(self.obj, path, message)

    def unsupported_feature(self, path: str, feature: str) -> None:
        self.unsupported.append(f"{path}: {feature}")


def as_list(ctx: ParseContext, value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ctx.error(path, "must be a list")
    return value


def as_map(ctx: ParseContext, value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ctx.error(path, "must be an object")
    return value
