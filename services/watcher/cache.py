"""The watcher's store of current objects and the deltas that keep the bus equal to it.

Like client-go's informer store with Cilium's DeepEqual skip on top: every event
updates the store, but only a change of the relevant view (see ``filter``) becomes
a delta. A full list (initial, after ``410 Gone``, or a manifest rescan) is
diffed against the store, so objects that vanished meanwhile become tombstones.
The store is seeded with what the bus already holds, which makes a restarted
watcher tombstone objects deleted while it was down.

Pure: one owner task calls it; nothing here awaits.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from services.watcher.filter import relevant_view
from services.watcher.kinds import Kind
from services.watcher.objects import KObject, ObjectKey


class Op(enum.StrEnum):
    UPSERT = "upsert"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class Change:
    """One delta to publish. For DELETE, ``obj`` is the last known state."""

    op: Op
    obj: KObject


@dataclass(slots=True)
class Diff:
    """The outcome of applying source events: deltas to publish and events found to change nothing."""

    changes: list[Change] = field(default_factory=list)
    skipped: int = 0

    def __iadd__(self, other: Diff) -> Diff:
        self.changes.extend(other.changes)
        self.skipped += other.skipped
        return self


class ObjectCache:
    """Current objects per kind, as last seen by the source (or, before that, as held on the bus)."""

    def __init__(self) -> None:
        self._objects: dict[Kind, dict[ObjectKey, KObject]] = {kind: {} for kind in Kind}
        # Relevant views, computed once per stored object (a list diff compares many).
        self._views: dict[ObjectKey, dict[str, object]] = {}

    def seed(self, obj: KObject) -> None:
        """Record an object the bus holds from an earlier run; produces no delta."""
        self._store(obj)

    def upsert(self, obj: KObject) -> Diff:
        """An added or modified object; a delta only if its relevant view changed."""
        stored = self._objects[obj.key.kind].get(obj.key)
        if stored is obj:
            # The very object stored (a source's listing repeats what did not change; objects are
            # never mutated): nothing to compare, which costs a view per object of the listing.
            return Diff(skipped=1)
        view = _view(obj)
        known = stored is not None
        same = known and self._views[obj.key] == view
        self._store(obj, view)
        if same:
            return Diff(skipped=1)
        return Diff([Change(Op.UPSERT, obj)])

    def delete(self, obj: KObject) -> Diff:
        """A deleted object; a tombstone unless it was never published."""
        last = self._objects[obj.key.kind].pop(obj.key, None)
        self._views.pop(obj.key, None)
        if last is None:
            return Diff(skipped=1)
        return Diff([Change(Op.DELETE, obj)])

    def replace(self, kind: Kind, objects: Iterable[KObject]) -> Diff:
        """Make ``objects`` the complete set of ``kind``: upserts for new or changed ones,
        tombstones (in key order) for the ones that are gone."""
        diff = Diff()
        seen: set[ObjectKey] = set()
        for obj in objects:
            seen.add(obj.key)
            diff += self.upsert(obj)
        gone = sorted(key for key in self._objects[kind] if key not in seen)
        for key in gone:
            diff += self.delete(self._objects[kind][key])
        return diff

    def count(self, kind: Kind) -> int:
        return len(self._objects[kind])

    def objects(self, kind: Kind) -> Iterator[KObject]:
        return iter(self._objects[kind].values())

    def _store(self, obj: KObject, view: dict[str, object] | None = None) -> None:
        self._objects[obj.key.kind][obj.key] = obj
        self._views[obj.key] = view if view is not None else _view(obj)


def _view(obj: KObject) -> dict[str, object]:
    """What a consumer sees of ``obj``: its relevant view, and a conflict the watcher reports on it."""
    view = relevant_view(obj.key.kind, obj.body)
    if obj.conflict:
        view = {**view, "conflict": obj.conflict}
    return view
