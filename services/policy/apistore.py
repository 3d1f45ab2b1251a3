"""Policies imported over the API, kept in a JetStream object store so they survive restarts.

Kubernetes objects come back by themselves when the service restarts (the watcher's
stream replays them); policies imported with ``palisade policy import`` exist nowhere
else, so each accepted one is written here before the import is answered (and before
any order that enforces it is published), deleted with it, and loaded again before
the service reports synced. An object store chunks its objects, so a policy larger
than the bus's maximum payload is stored like any other.

One object per policy, named ``<kind>/<namespace>/<name>``, holding JSON
``{"version": 1, "kind", "namespace", "name", "origin", "object"}``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from nats.js.errors import NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from services.common.bus import Bus
from services.common.log import get_logger
from services.policy.engine.model import PolicyKind, PolicyRef
from services.policy.engine.registry import ApiChange, StoredPolicy

log = get_logger("apistore")

_FORMAT = 1


def object_name(key: PolicyRef) -> str:
    return f"{key.kind.value}/{key.namespace}/{key.name}"


def encode_policy(stored: StoredPolicy) -> bytes:
    return json.dumps(
        {
            "version": _FORMAT,
            "kind": stored.key.kind.value,
            "namespace": stored.key.namespace,
            "name": stored.key.name,
            "origin": stored.origin,
            "object": stored.object,
        },
        separators=(",", ":"),
    ).encode()


def decode_policy(data: bytes, *, where: str) -> StoredPolicy:
    try:
        raw: Any = json.loads(data)
        if raw.get("version") != _FORMAT:
            raise ValueError(f"unknown format version {raw.get('version')!r}")
        key = PolicyRef(PolicyKind(raw["kind"]), str(raw["namespace"]), str(raw["name"]))
        obj = raw["object"]
        if not isinstance(obj, dict):
            raise ValueError("object is not a JSON object")
        return StoredPolicy(key, obj, str(raw.get("origin") or ""))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where} holds no valid imported policy: {exc}") from None


def collapse(changes: Sequence[ApiChange]) -> list[ApiChange]:
    """The last change per key, in the order keys were first changed."""
    last: dict[PolicyRef, StoredPolicy | None] = {}
    for key, stored in changes:
        last[key] = stored
    return list(last.items())


class ApiPolicyStore:
    """Load, save and delete imported policies in one object store bucket."""

    def __init__(self, bus: Bus, store: ObjectStore, bucket: str) -> None:
        self._bus = bus
        self._store = store
        self.bucket = bucket

    @classmethod
    async def open(cls, bus: Bus, bucket: str) -> ApiPolicyStore:
        """Bind to the bucket, creating it on first use."""
        return cls(bus, await bus.object_store(bucket, "Palisade policies imported over the API"), bucket)

    async def load(self) -> list[StoredPolicy]:
        """Every stored policy; an unreadable object is logged and skipped (and left in place)."""
        try:
            infos = await self._store.list(ignore_deletes=True)
        except NotFoundError:
            return []
        out = []
        for info in infos:
            if info.deleted or not info.name:
                continue
            where = f"object {info.name!r} of bucket {self.bucket}"
            try:
                result = await self._store.get(info.name)
                out.append(decode_policy(result.data or b"", where=where))
            except ObjectNotFoundError:
                continue  # deleted since the listing
            except ValueError as exc:
                log.error("imported policy unreadable, skipped", object=info.name, error=str(exc))
        out.sort(key=lambda s: s.key)
        log.info("imported policies loaded", policies=len(out), bucket=self.bucket)
        return out

    async def save(self, changes: Sequence[ApiChange]) -> None:
        """Apply ``changes`` in order; retries until NATS answers (the caller's answer waits)."""
        for key, stored in collapse(changes):
            name = object_name(key)
            if stored is None:
                await self._bus.retry("delete imported policy", functools.partial(self._delete, name), object=name)
            else:
                put = functools.partial(self._put, name, encode_policy(stored))
                await self._bus.retry("store imported policy", put, object=name)

    async def _put(self, name: str, data: bytes) -> None:
        await self._store.put(name, data)

    async def _delete(self, name: str) -> None:
        try:
            await self._store.delete(name)
        except ObjectNotFoundError:
            pass
