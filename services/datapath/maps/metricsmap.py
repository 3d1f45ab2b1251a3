"""Per-endpoint, per-reason, per-direction packet and byte counters (a per-CPU array).

Endpoint ``ep_id`` owns slots ``ep_id * SLOTS`` onwards: ``(egress ? DIRECTION_SLOTS : 0) +
reason``. Slot 0 (endpoint 0 is never an endpoint) counts the flow events the ring buffer
could not take. The map's size therefore bounds endpoint ids (:func:`max_endpoint_id`): an
endpoint beyond it would have no slots and its packets would go uncounted. The program
adds to its CPU's slot without atomics; reading sums the slots. An array index costs the
program less than a hashed key, so the reader walks the endpoints it knows instead of the
map's keys.
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
#: Slots per direction of an endpoint (METRICS_DIR_SLOTS in the program): a power of two, so a
#: reason numbered past it wraps with a mask.
DIRECTION_SLOTS = 8
#: Slots per endpoint (METRICS_SLOTS in the program): one run of DIRECTION_SLOTS per direction.
SLOTS = 2 * DIRECTION_SLOTS
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
    if max_endpoint_id(sizes) < 1:
        raise ValueError(f"metrics map size {sizes.metrics}: give at least {2 * SLOTS} ({SLOTS} slots an endpoint)")
    return MapSpec(NAME, MapType.PERCPU_ARRAY, ctypes.sizeof(MetricsKey), ctypes.sizeof(MetricsValue), sizes.metrics)


def max_endpoint_id(sizes: MapSizes) -> int:
    """The highest endpoint id whose slots all fit in a metrics map of ``sizes`` (ids start at 1)."""
    return sizes.metrics // SLOTS - 1


def slot(ep_id: int, reason: Reason, direction: Direction) -> int:
    """The array index the program counts ``ep_id``'s packets of ``reason`` in ``direction`` at."""
    # A reason numbered DIRECTION_SLOTS or more counts in slot ``wire % DIRECTION_SLOTS`` (slot 0
    # has no reason of its own), as the program's ``reason & (METRICS_DIR_SLOTS - 1)`` does.
    base = DIRECTION_SLOTS if direction is Direction.EGRESS else 0
    return ep_id * SLOTS + base + reason.wire % DIRECTION_SLOTS


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
