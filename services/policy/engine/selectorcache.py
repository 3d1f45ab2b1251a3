"""Interned selectors and the identities each selects, kept up to date incrementally.

Like Cilium's selector cache: every selector used by a rule is registered
once (reference counted); its selection is computed when registered and then
updated as identities come, go or change. Identity updates return which
selectors changed and how (Cilium's ``IdentitySelectionUpdated(selector,
added, deleted)``), so the engine recomputes only the entries that depend on
them. Selections are exposed sorted, so results are stable.

Selectors are interned: :meth:`SelectorCache.canonical` gives the registered
instance, so callers holding it hit the cache's dicts by identity.

Indexes keep this fast: identities are indexed by (label key, value), and
each endpoint selector is filed under one of its ``In`` requirements, so an
identity update only evaluates selectors that could possibly match it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

from services.policy.engine.selector import CIDRSelector, EndpointSelector, IdentityView, Selector

_S = TypeVar("_S", bound=Selector)


@dataclass(frozen=True, slots=True)
class SelectionChange:
    """Identities a selector gained and lost in one update (both sorted)."""

    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


class SelectorCache:
    def __init__(self) -> None:
        self._identities: dict[int, IdentityView] = {}
        self._selections: dict[Selector, set[int]] = {}
        self._sorted: dict[Selector, tuple[int, ...]] = {}
        self._refs: dict[Selector, int] = {}
        self._canonical: dict[Selector, Selector] = {}
        self._label_index: dict[tuple[str, str], set[int]] = {}
        self._anchor_of: dict[Selector, tuple[tuple[str, str], ...]] = {}
        self._anchored: dict[tuple[str, str], set[Selector]] = {}
        self._unanchored: set[Selector] = set()
        self._member_of: dict[int, set[Selector]] = {}
        #: The registered CIDR selectors (what :meth:`cidr_selectors` answers without a scan).
        self._cidr_selectors: set[CIDRSelector] = set()

    # --- selectors ---------------------------------------------------------------

    def add_selector(self, selector: Selector) -> tuple[int, ...]:
        """Register (or add a reference to) a selector; returns its selection."""
        refs = self._refs.get(selector, 0)
        self._refs[selector] = refs + 1
        if refs:
            return self.selection(selector)
        self._canonical[selector] = selector
        if isinstance(selector, CIDRSelector):
            self._cidr_selectors.add(selector)
        selected = {i for i in self._candidates(selector) if selector.matches(self._identities[i])}
        self._selections[selector] = selected
        for i in selected:
            self._member_of.setdefault(i, set()).add(selector)
        anchors = self._choose_anchor(selector)
        self._anchor_of[selector] = anchors
        if anchors:
            for a in anchors:
                self._anchored.setdefault(a, set()).add(selector)
        else:
            self._unanchored.add(selector)
        return self.selection(selector)

    def remove_selector(self, selector: Selector) -> None:
        """Drop one reference; forget the selector when none is left."""
        refs = self._refs.get(selector, 0)
        if refs > 1:
            self._refs[selector] = refs - 1
            return
        if refs == 0:
            return
        del self._refs[selector]
        self._canonical.pop(selector, None)
        if isinstance(selector, CIDRSelector):
            self._cidr_selectors.discard(selector)
        for i in self._selections.pop(selector, set()):
            members = self._member_of.get(i)
            if members is not None:
                members.discard(selector)
        self._sorted.pop(selector, None)
        for a in self._anchor_of.pop(selector, ()):
            bucket = self._anchored.get(a)
            if bucket is not None:
                bucket.discard(selector)
                if not bucket:
                    del self._anchored[a]
        self._unanchored.discard(selector)

    def canonical(self, selector: _S) -> _S:
        """The registered instance equal to ``selector`` (itself if not registered).

        Holding the registered instance makes every later lookup an identity
        hit instead of a field-by-field comparison.
        """
        return cast(_S, self._canonical.get(selector, selector))

    def selection(self, selector: Selector) -> tuple[int, ...]:
        """Sorted ids selected by a registered selector (empty if unknown)."""
        cached = self._sorted.get(selector)
        if cached is None:
            cached = tuple(sorted(self._selections.get(selector, ())))
            self._sorted[selector] = cached
        return cached

    def selection_set(self, selector: Selector) -> set[int]:
        """The live selection set; callers must not modify it."""
        return self._selections.get(selector, set())

    def selectors(self) -> Iterable[Selector]:
        return self._refs.keys()

    def cidr_selectors(self) -> Iterable[CIDRSelector]:
        return self._cidr_selectors

    def __contains__(self, selector: object) -> bool:
        return selector in self._refs

    def selectors_selecting(self, identity: int) -> set[Selector]:
        return self._member_of.get(identity, set())

    # --- identities --------------------------------------------------------------

    def identity(self, identity: int) -> IdentityView | None:
        return self._identities.get(identity)

    def identities(self) -> Mapping[int, IdentityView]:
        return self._identities

    def upsert_identity(self, identity: int, view: IdentityView) -> dict[Selector, SelectionChange]:
        """Add or replace an identity (labels, IPs); returns selectors whose selection changed."""
        old = self._identities.get(identity)
        if old is not None:
            self._unindex(identity, old)
        self._identities[identity] = view
        for label in view.labels:
            self._label_index.setdefault((label.key, label.value), set()).add(identity)
        candidates = set(self._unanchored)
        for label in view.labels:
            candidates.update(self._anchored.get((label.key, label.value), ()))
        members = self._member_of.setdefault(identity, set())
        candidates.update(members)
        changes: dict[Selector, SelectionChange] = {}
        for sel in candidates:
            now = sel.matches(view)
            was = sel in members
            if now and not was:
                members.add(sel)
                self._selections[sel].add(identity)
                self._sorted.pop(sel, None)
                changes[sel] = SelectionChange(added=(identity,))
            elif was and not now:
                members.discard(sel)
                self._selections[sel].discard(identity)
                self._sorted.pop(sel, None)
                changes[sel] = SelectionChange(removed=(identity,))
        return changes

    def remove_identity(self, identity: int) -> dict[Selector, SelectionChange]:
        """Forget an identity; returns selectors that lost it."""
        old = self._identities.pop(identity, None)
        if old is None:
            return {}
        self._unindex(identity, old)
        changes: dict[Selector, SelectionChange] = {}
        for sel in self._member_of.pop(identity, set()):
            self._selections[sel].discard(identity)
            self._sorted.pop(sel, None)
            changes[sel] = SelectionChange(removed=(identity,))
        return changes

    # --- internals ---------------------------------------------------------------

    def _unindex(self, identity: int, view: IdentityView) -> None:
        for label in view.labels:
            bucket = self._label_index.get((label.key, label.value))
            if bucket is not None:
                bucket.discard(identity)
                if not bucket:
                    del self._label_index[(label.key, label.value)]

    def _choose_anchor(self, selector: Selector) -> tuple[tuple[str, str], ...]:
        """The (key, value) pairs of the most selective ``In`` requirement, if any."""
        if isinstance(selector, CIDRSelector):
            return ()
        best: tuple[tuple[str, str], ...] = ()
        best_size = -1
        for key, values in selector.anchors():
            pairs = tuple((key, v) for v in values)
            size = sum(len(self._label_index.get(p, ())) for p in pairs)
            if best_size < 0 or size < best_size:
                best, best_size = pairs, size
        return best

    def _candidates(self, selector: Selector) -> Iterable[int]:
        if isinstance(selector, EndpointSelector):
            anchors = self._choose_anchor(selector)
            if anchors:
                out: set[int] = set()
                for a in anchors:
                    out.update(self._label_index.get(a, ()))
                return out
        return list(self._identities)
