"""The policy repository: parsed policies by key, and a monotonic revision.

A policy object's rules are replaced whole when it is updated (there is no
partial merge), as Cilium replaces rules by their labels. Every accepted change
bumps the revision; ``seed_revision`` lets a restarted service continue from
its persisted revision so revisions never go back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from services.common.labels import LabelSet
from services.policy.engine.model import Policy, PolicyKind, PolicyRef, Rule


@dataclass(frozen=True, slots=True)
class RepositoryChange:
    """What one accepted change did: the previous and new object, and the new revision."""

    revision: int
    old: Policy | None
    new: Policy | None


class Repository:
    def __init__(self) -> None:
        self._policies: dict[PolicyRef, Policy] = {}
        self._revision = 0

    @property
    def revision(self) -> int:
        return self._revision

    def seed_revision(self, revision: int) -> None:
        """Never go below ``revision`` (used after a restart with persisted state)."""
        if revision < 0:
            raise ValueError("revision must be >= 0")
        self._revision = max(self._revision, revision)

    def bump(self) -> int:
        self._revision += 1
        return self._revision

    def upsert(self, policy: Policy) -> RepositoryChange:
        """Add a policy or replace all rules of the object with the same key."""
        old = self._policies.get(policy.key)
        self._policies[policy.key] = policy
        return RepositoryChange(self.bump(), old, policy)

    def delete(self, key: PolicyRef) -> RepositoryChange | None:
        """Remove a policy; ``None`` (and no revision bump) when it did not exist."""
        old = self._policies.pop(key, None)
        if old is None:
            return None
        return RepositoryChange(self.bump(), old, None)

    def get(self, key: PolicyRef) -> Policy | None:
        return self._policies.get(key)

    def __len__(self) -> int:
        return len(self._policies)

    def __iter__(self) -> Iterator[Policy]:
        return iter(sorted(self._policies.values(), key=lambda p: p.key))

    def search(
        self,
        *,
        kind: PolicyKind | None = None,
        namespace: str | None = None,
        name: str | None = None,
    ) -> list[Policy]:
        """Policies matching every given field, sorted by key."""
        return [
            p
            for p in self
            if (kind is None or p.key.kind is kind)
            and (namespace is None or p.key.namespace == namespace)
            and (name is None or p.key.name == name)
        ]

    def rules_selecting(self, labels: LabelSet) -> list[tuple[Policy, Rule]]:
        """Rules whose subject selector selects an identity with these labels."""
        out: list[tuple[Policy, Rule]] = []
        for policy in self:
            for rule in policy.rules:
                if rule.subject.matches_labels(labels):
                    out.append((policy, rule))
        return out
