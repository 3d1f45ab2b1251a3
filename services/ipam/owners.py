"""Holdings keyed by who holds them, with an index from each owner to the nodes it holds on.

ipam's allocators keep what each owner (``pod/<ns>/<name>``, ``cidr/<prefix>``, ...) holds
on each node: an identity reference keyed by (node, owner), an address keyed by
(node, family, owner). Joining an owner's holdings after a change (a bus pod deleted,
an address released) asks where that owner holds anything; answering it from the whole
map costs one look per holding in the cluster, on every pod deletion. :class:`OwnerIndexed`
is a mapping that keeps that answer at hand; given a ``tally``, it also counts its values by
what the tally makes of them (how many owners hold each identity), likewise without a scan.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, MutableMapping
from typing import Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

#: The (node, owner) a key names.
Split = Callable[[K], tuple[str, str]]


class OwnerIndexed(MutableMapping[K, V], Generic[K, V]):
    """A dict whose keys each name a (node, owner), answering :meth:`nodes_of` an owner without a scan."""

    def __init__(
        self, split: Split[K], items: Iterable[tuple[K, V]] = (), tally: Callable[[V], Hashable] | None = None
    ) -> None:
        self._split = split
        self._data: dict[K, V] = {}
        #: owner -> node -> how many keys of the owner name that node.
        self._nodes: dict[str, dict[str, int]] = {}
        self._tally = tally
        #: tally(value) -> how many keys hold such a value.
        self._counts: dict[Hashable, int] = {}
        for key, value in items:
            self[key] = value

    def count(self, tallied: Hashable) -> int:
        """How many keys hold a value whose tally is ``tallied`` (0 without a tally)."""
        return self._counts.get(tallied, 0)

    def _uncount(self, value: V) -> None:
        if self._tally is not None:
            tallied = self._tally(value)
            left = self._counts[tallied] - 1
            if left:
                self._counts[tallied] = left
            else:
                del self._counts[tallied]

    def nodes_of(self, owner: str) -> set[str]:
        """The nodes where ``owner`` has a key."""
        return set(self._nodes.get(owner, ()))

    def pairs(self) -> set[tuple[str, str]]:
        """Every (node, owner) some key names."""
        return {(node, owner) for owner, nodes in self._nodes.items() for node in nodes}

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, /, default: V | T) -> V | T: ...
    def get(self, key: K, /, default: object = None) -> object:
        return self._data.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self._data:
            node, owner = self._split(key)
            nodes = self._nodes.setdefault(owner, {})
            nodes[node] = nodes.get(node, 0) + 1
        else:
            self._uncount(self._data[key])
        self._data[key] = value
        if self._tally is not None:
            tallied = self._tally(value)
            self._counts[tallied] = self._counts.get(tallied, 0) + 1

    def __delitem__(self, key: K) -> None:
        self._uncount(self._data.pop(key))
        node, owner = self._split(key)
        nodes = self._nodes[owner]
        nodes[node] -= 1
        if not nodes[node]:
            del nodes[node]
            if not nodes:
                del self._nodes[owner]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()
        self._nodes.clear()
        self._counts.clear()
