"""A simulated node: the datapath's real order path over an in-memory datapath.

Each :class:`SimNode` runs the product's own :class:`~services.datapath.orders.OrderConsumer`
(a JetStream consumer of ``palisade.regen.<node>``, the sequencer, resyncs over gRPC) and
:class:`~services.datapath.orders.Reporter` (realized revisions over gRPC), exactly as
``services.datapath`` does, but the orders are applied to dictionaries instead of BPF maps:
what a node costs the control plane, without a kernel. The scale benchmark runs a thousand
of them in one process.

The endpoints of a node are given by its owner (the benchmark reads them from the ipcache,
as a kubelet would create them): after every order or resync each endpoint reports the
node's revision, as a datapath that wrote the order into every endpoint's map does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.bus import Bus
from services.datapath import types as dt
from services.datapath.orders import OrderConsumer, PolicyPort, Reporter


@dataclass(slots=True)
class MemoryPolicy:
    """The node's policy as its maps would hold it: identity -> (enforcement, key -> entry)."""

    policies: dict[int, tuple[dt.Enforcement, dict[dt.PolicyKey, dt.PolicyEntry]]] = field(default_factory=dict)

    def apply(self, batch: dt.OrderBatch) -> None:
        if batch.replace:
            self.reset(batch.as_resync())
            return
        for identity in batch.removed:
            self.policies.pop(identity, None)
        for diff in batch.diffs:
            _, entries = self.policies.get(diff.identity, (dt.Enforcement(), {}))
            entries = {} if diff.full else entries
            for key in diff.remove:
                entries.pop(key, None)
            for entry in diff.add:
                entries[entry.key] = entry
            self.policies[diff.identity] = (diff.enforcement, entries)

    def reset(self, state: dt.ResyncState) -> None:
        self.policies = {p.identity: (p.enforcement, {e.key: e for e in p.entries}) for p in state.policies}


class SimNode:
    """One simulated node; ``async with`` starts its consumer and reporter, leaving stops them."""

    def __init__(self, name: str, bus: Bus, policy: PolicyPort, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._bus = bus
        self._clock = clock
        self.state = MemoryPolicy()
        self.reporter = Reporter(name, policy)
        self.consumer = OrderConsumer(name, policy, self, clock=clock)
        #: Pod "namespace/name" -> (endpoint id, identity).
        self.endpoints: dict[str, tuple[int, int]] = {}
        self._next_id = 1
        self.revision = 0
        #: Revision -> when (``clock``) this node first applied an order or resync at or past it.
        self.applied_at: dict[int, float] = {}
        #: Bytes of every order this node received (the order subjects' traffic to it).
        self.received_bytes = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> SimNode:
        await self.consumer.subscribe(self._bus)
        self._tasks = [
            asyncio.create_task(self.consumer.run(), name=f"sim-orders-{self.name}"),
            asyncio.create_task(self.reporter.run(), name=f"sim-reporter-{self.name}"),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- endpoints (from the ipcache, as a kubelet creates pods) -------------------------------

    def add_endpoint(self, pod: str, identity: int) -> None:
        old = self.endpoints.get(pod)
        if old is not None and old[1] == identity:
            return
        endpoint_id = old[0] if old is not None else self._next_id
        if old is None:
            self._next_id += 1
        self.endpoints[pod] = (endpoint_id, identity)
        if self.revision:
            self.reporter.add([dt.Realized(endpoint_id, identity, self.revision, pod)])

    def remove_endpoint(self, pod: str) -> None:
        old = self.endpoints.pop(pod, None)
        if old is not None:
            self.reporter.deleted(old[0], old[1], pod)

    # --- the PolicyApplier the order consumer drives -------------------------------------------

    async def apply_order(self, batch: dt.OrderBatch) -> None:
        self.state.apply(batch)
        self._realized(batch.revision, batch.arrived or None)

    async def apply_resync(self, state: dt.ResyncState) -> None:
        self.state.reset(state)
        self._realized(state.revision, None)

    def _realized(self, revision: int, arrived: float | None) -> None:
        self.revision = max(self.revision, revision)
        self.applied_at.setdefault(revision, self._clock())
        self.reporter.add(
            [dt.Realized(eid, ident, self.revision, pod) for pod, (eid, ident) in self.endpoints.items()], arrived
        )
