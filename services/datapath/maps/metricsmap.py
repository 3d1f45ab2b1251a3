"""Per-endpoint, per-reason, per-direction packet and byte counters (a per-CPU hash).

The program adds to its CPU's slot without atomics; reading sums the slots.
Flow events the ring buffer could not take are counted under endpoint 0 with
the reserved reason ``EVENT_LOST``.
"""

from __future__ import annotations

import ctypes

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import CounterKey, Counters, CounterValue, Direction, Reason

NAME = "metrics"
#: Reason number reserved for lost flow events (not a packet verdict).
EVENT_LOST = 255


class MetricsKey(ctypes.Structure):
    # struct metrics_key in bpf/palisade.c
    _fields_ = [
        ("ep_id", ctypes.c_uint32),
        ("reason", ctypes.c_uint8),
        ("direction", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class MetricsValue(ctypes.Structure):
    # struct metrics_value in bpf/palisade.c
    _fields_ = [
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


C_STRUCTS = ((MetricsKey, "metrics_key"), (MetricsValue, "metrics_value"))


def spec(sizes: MapSizes) -> MapSpec:
    return MapSpec(NAME, MapType.PERCPU_HASH, ctypes.sizeof(MetricsKey), ctypes.sizeof(MetricsValue), sizes.metrics)


class MetricsMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def read(self) -> Counters:
        values: dict[CounterKey, CounterValue] = {}
        lost = 0
        for key in list(self.map.keys(MetricsKey)):
            slots = self.map.lookup_percpu(key, MetricsValue)
            packets = sum(int(s.packets) for s in slots)
            if key.reason == EVENT_LOST:
                lost += packets
                continue
            try:
                ck = CounterKey(
                    int(key.ep_id), Reason.from_wire(int(key.reason)), Direction.from_wire(int(key.direction))
                )
            except ValueError:  # written by a newer program; not ours to interpret
                continue
            values[ck] = CounterValue(packets=packets, bytes=sum(int(s.bytes) for s in slots))
        return Counters(values=values, events_lost=lost)

    def delete_endpoint(self, ep_id: int) -> None:
        for key in list(self.map.keys(MetricsKey)):
            if key.ep_id == ep_id:
                self.map.delete(key)
