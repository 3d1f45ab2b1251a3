"""What the service knows about each policy object beyond its rules: source, error, revision.

Pure. The engine holds the rules that are enforced; the registry remembers, per
(source, object), the version enforced and the revision it was accepted at, and
the error of the latest version when that one was rejected (the previously
accepted version, if any, stays enforced: a rejected change changes nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from services.policy.engine.model import Policy, PolicyKind, PolicyRef
from services.policy.engine.sources import Source

RecordKey = tuple[Source, PolicyRef]


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """An accepted API policy as persisted: its key, the object imported, and where it came from."""

    key: PolicyRef
    object: Mapping[str, Any]
    origin: str = ""


#: A change to the persisted API policies: the policy to keep, or None to forget it.
ApiChange = tuple[PolicyRef, StoredPolicy | None]


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    source: Source
    #: The object's key as users name it (not the engine's key).
    key: PolicyRef
    #: The version enforced; None when no version was ever accepted.
    policy: Policy | None
    #: Revision at which ``policy`` was accepted (0 until settled at the end of its batch).
    revision: int
    #: Why the latest version was rejected; empty when the latest version is enforced.
    error: str
    #: The latest document received, accepted or not.
    document: str
    #: Where the latest document came from: "kubernetes", "manifests:<dir> <file>", "api <file>".
    origin: str = ""
    #: Other definitions of the object that its source ignores (several manifest files); empty if none.
    conflict: str = ""

    @property
    def rejected(self) -> bool:
        return bool(self.error)


class Registry:
    def __init__(self) -> None:
        self._records: dict[RecordKey, PolicyRecord] = {}
        self._unsettled: set[RecordKey] = set()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[PolicyRecord]:
        return iter(sorted(self._records.values(), key=lambda r: (r.key, r.source)))

    def unordered(self) -> Iterator[PolicyRecord]:
        """Every record in no particular order: for scans on every commit, which need none (sorting
        1,000 records by key costs more than the scan)."""
        return iter(self._records.values())

    def get(self, source: Source, key: PolicyRef) -> PolicyRecord | None:
        return self._records.get((source, key))

    def accepted(
        self,
        source: Source,
        key: PolicyRef,
        policy: Policy,
        document: str,
        *,
        changed: bool,
        origin: str = "",
        conflict: str = "",
    ) -> None:
        """The latest version is enforced; ``changed`` when the engine got new rules."""
        old = self._records.get((source, key))
        revision = old.revision if old is not None and not changed else 0
        self._records[(source, key)] = PolicyRecord(source, key, policy, revision, "", document, origin, conflict)
        if changed or old is None or old.revision == 0:
            self._unsettled.add((source, key))

    def rejected(
        self, source: Source, key: PolicyRef, error: str, document: str, *, origin: str = "", conflict: str = ""
    ) -> None:
        old = self._records.get((source, key))
        if old is None:
            self._records[(source, key)] = PolicyRecord(source, key, None, 0, error, document, origin, conflict)
        else:
            self._records[(source, key)] = dataclasses.replace(
                old, error=error, document=document, origin=origin, conflict=conflict
            )

    def remove(self, source: Source, key: PolicyRef) -> PolicyRecord | None:
        self._unsettled.discard((source, key))
        return self._records.pop((source, key), None)

    def settle(self, revision: int) -> None:
        """Versions accepted in the batch just committed take the batch's revision."""
        for rk in self._unsettled:
            record = self._records.get(rk)
            if record is not None and record.policy is not None:
                self._records[rk] = dataclasses.replace(record, revision=revision)
        self._unsettled.clear()

    def search(self, namespace: str = "") -> list[PolicyRecord]:
        """Records in ``namespace`` (cluster-wide ones only when listing all namespaces)."""
        return [
            r
            for r in self
            if not namespace
            or (r.key.namespace == namespace and r.key.kind is not PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY)
        ]

    def counts(self) -> dict[tuple[Source, bool], int]:
        """Number of records per (source, rejected)."""
        out: dict[tuple[Source, bool], int] = {}
        for r in self._records.values():
            out[(r.source, r.rejected)] = out.get((r.source, r.rejected), 0) + 1
        return out
