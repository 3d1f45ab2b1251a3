"""The one builder of policy-map entries for the datapath's tests."""

from __future__ import annotations

from services.datapath.types import Direction, L4Proto, PolicyEntry, PolicyKey, Verdict


def entry(
    direction: Direction,
    identity: int,
    proto: L4Proto = L4Proto.ANY,
    low: int = 0,
    high: int = 0,
    *,
    deny: bool = False,
) -> PolicyEntry:
    """An entry as the realizer writes it (``identity`` 0 is every peer, ``proto`` ANY every protocol).
    ``low`` 0 is every port; a ``high`` of 0 with a ``low`` is the single port ``low`` (as the protobuf
    sends single ports; :class:`PolicyKey` stores ``low``-``low``), so ``entry(d, i, TCP, 80)`` and
    ``entry(d, i, TCP, 80, 80)`` are one key."""
    return PolicyEntry(PolicyKey(direction, identity, proto, low, high), Verdict.DENY if deny else Verdict.ALLOW)
