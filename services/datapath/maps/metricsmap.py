"""Per-endpoint, per-reason, per-direction packet and byte counters (a per-CPU array).

Endpoint ``ep_id`` owns slots ``ep_id * SLOTS`` onwards: ``(egress ? 8 : 0) + reason``.
Slot 0 (endpoint 0 is never an endpoint) counts the flow events the ring buffer
could not take. The program adds to its CPU's slot without atomics; reading sums
the slots. An array index costs the program less than a hashed key, so the reader
walks the endpoints it knows instead of the map's keys.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import CounterKey, Counters, CounterValue, Direction, Reason

NAME = "metrics"
#: Reason number reserved for lost flow events (not a packet verdict).
EVENT_LOST = 255
#: Slots per endpoint (METRICS_SLOTS in bpf/palisade.c): 8 reasons per direction.
SLOTS = 16
#: Slot of the lost-events counter.
LOST_SLOT = 0


class MetricsKey(ctypes.Structure):
    # the array index (u32) in bpf/palisade.c
    _fields_ = [("slot", ctypes.c_uint32)]


class MetricsValue(ctypes.Structure):
    # struct metrics_value in bpf/palisade.c
    _fields_ = [
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


C_STRUCTS = ((MetricsValue, "metrics_value"),)


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.PERCPU_ARRAY, ctypes.sizeof(MetricsKey), ctypes.sizeof(MetricsValue), sizes.metrics)


def slot(ep_id: int, reason: Reason, direction: Direction) -> int:
    """The array index the program counts ``ep_id``'s packets of ``reason`` in ``direction`` at."""
    # Eight slots a direction: a reason numbered 8 or more counts in slot ``wire % 8`` (slot 0 has
    # no reason of its own), as the program's ``reason & 7`` does.
    return ep_id * SLOTS + (8 if direction is Direction.EGRESS else 0) + reason.wire % 8


class MetricsMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def read(self, ep_ids: Iterable[int]) -> Counters:
        """The counters of ``ep_ids`` (the endpoints the datapath holds) and the lost events."""
        values: dict[CounterKey, CounterValue] = {}
        for ep_id in ep_ids:
            for direction in Direction:
                for reason in Reason:
                    packets, nbytes = self._sum(slot(ep_id, reason, direction))
                    if packets:
                        values[CounterKey(ep_id, reason, direction)] = CounterValue(packets=packets, bytes=nbytes)
        return Counters(values=values, events_lost=self._sum(LOST_SLOT)[0])

    def delete_endpoint(self, ep_id: int) -> None:
        """Zero an endpoint's slots, so the next endpoint with its id starts from nothing."""
        zero = (MetricsValue * self.map.ncpus)()
        for index in range(ep_id * SLOTS, (ep_id + 1) * SLOTS):
            if index < self.map.spec.max_entries:
                self.map.update(MetricsKey(index), zero)

    def _sum(self, index: int) -> tuple[int, int]:
        slots = self.map.lookup_percpu(MetricsKey(index), MetricsValue)
        return sum(int(s.packets) for s in slots), sum(int(s.bytes) for s in slots)
