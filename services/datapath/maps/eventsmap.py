"""Flow events: a BPF ring buffer the program writes and the agent drains.

The program emits every drop and each new allowed connection (the first packet
that creates a conntrack entry), never established traffic, so the buffer's
volume follows connection rate, not packet rate. The consumer position lives
in the map, so a restarted agent continues where the last one stopped.

The program wakes the reader only once a backlog builds up (an eighth of the
ring), not for each event: the ring's default, a wakeup whenever the reader has
caught up, cost an interrupt and a context switch for nearly every new
connection. The reader polls instead, every ``POLL_SLICE_MS`` while it waits,
which bounds how late an event is seen.
"""

from __future__ import annotations

import ctypes
import errno
import time

from services.datapath.maps import addresses
from services.datapath.maps.bpf import BpfError, MapSpec, MapType, PinnedMap, RingBufferCallback, check, libbpf
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import Direction, FlowEvent, Reason, Verdict

NAME = "events"
#: Longest wait between two looks at the ring while a read waits for events.
POLL_SLICE_MS = 50
#: The program wakes the reader once this part of the ring is unread (1/8).
WAKEUP_FRACTION = 8


class FlowEventRecord(ctypes.Structure):
    # struct flow_event in bpf/palisade.c; ports in host order, addresses in network order.
    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("ep_id", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("src_identity", ctypes.c_uint32),
        ("dst_identity", ctypes.c_uint32),
        ("saddr", ctypes.c_uint8 * 16),
        ("daddr", ctypes.c_uint8 * 16),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("direction", ctypes.c_uint8),
        ("verdict", ctypes.c_uint8),
        ("reason", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 7),
    ]


C_STRUCTS = ((FlowEventRecord, "flow_event"),)


def spec(sizes: MapSizes) -> MapSpec:
    size_bytes = sizes.events_bytes
    if size_bytes < 4096 or size_bytes & (size_bytes - 1):
        raise ValueError("ring buffer size must be a power of two of at least one page")
    return MapSpec(NAME, MapType.RINGBUF, 0, 0, size_bytes)


def wakeup_bytes(sizes: MapSizes) -> int:
    """Unread bytes from which the program wakes the reader."""
    return sizes.events_bytes // WAKEUP_FRACTION


def to_event(rec: FlowEventRecord, mono_to_wall: float) -> FlowEvent:
    return FlowEvent(
        time=mono_to_wall + int(rec.ts_ns) / 1e9,
        endpoint_id=int(rec.ep_id),
        ifindex=int(rec.ifindex),
        direction=Direction.from_wire(int(rec.direction)),
        verdict=Verdict.from_wire(int(rec.verdict)),
        reason=Reason.from_wire(int(rec.reason)),
        source_identity=int(rec.src_identity),
        destination_identity=int(rec.dst_identity),
        source_ip=addresses.get(rec.saddr, int(rec.family)),
        destination_ip=addresses.get(rec.daddr, int(rec.family)),
        source_port=int(rec.sport),
        destination_port=int(rec.dport),
        protocol=int(rec.protocol),
    )


class EventReader:
    """Drains the pinned ring buffer through libbpf's ``ring_buffer`` consumer."""

    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned
        self._pending: list[FlowEvent] = []
        self._decode = True
        self._skipped = 0
        #: While reading: decode at most this many events, count the rest (0: decode all).
        self._limit = 0
        # bpf_ktime_get_ns is CLOCK_MONOTONIC; the offset turns it into Unix time.
        self._offset = time.time() - time.monotonic()

        def on_sample(_ctx: int | None, data: int | None, size: int) -> int:
            if not self._decode or (self._limit and len(self._pending) >= self._limit):
                self._skipped += 1
            elif data is not None and size >= ctypes.sizeof(FlowEventRecord):
                rec = FlowEventRecord.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(FlowEventRecord)))
                try:
                    self._pending.append(to_event(rec, self._offset))
                except ValueError:  # a record from a newer program; skip it
                    pass
            return 0

        # Keep the callback object alive as long as the ring buffer may call it.
        self._callback = RingBufferCallback(on_sample)
        rb = libbpf().ring_buffer__new(pinned.fd, self._callback, None, None)
        if not rb:
            code = ctypes.get_errno() or errno.EINVAL
            raise BpfError(code, "ring_buffer__new failed", pinned.path)
        self._rb: int | None = rb

    def read(self, timeout_ms: int = 0) -> list[FlowEvent]:
        """Events available now, waiting up to ``timeout_ms`` for the first one."""
        self._decode = True
        self._take(timeout_ms)
        out, self._pending = self._pending, []
        return out

    def take(self, timeout_ms: int, limit: int) -> tuple[list[FlowEvent], int]:
        """Like :meth:`read`, decoding at most ``limit`` events (0: all): the rest are consumed and
        counted, never decoded. Returns the events and how many were skipped."""
        self._limit = max(0, limit)
        try:
            events = self.read(timeout_ms)
        finally:
            self._limit = 0
        skipped, self._skipped = self._skipped, 0
        return events, skipped

    def skip(self, timeout_ms: int = 0) -> int:
        """Consume the events available now without decoding them (nobody wants them), waiting up
        to ``timeout_ms`` for the first one; returns how many there were."""
        self._decode = False
        try:
            self._take(timeout_ms)
        finally:
            self._decode = True
        skipped, self._skipped = self._skipped, 0
        return skipped

    def _take(self, timeout_ms: int) -> None:
        if self._rb is None:
            raise BpfError(errno.EBADF, "event reader is closed")
        lib = libbpf()
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        check(lib.ring_buffer__consume(self._rb), "ring_buffer__consume", self.map.path)
        while not (self._pending or self._skipped):  # (skipped: by skip, or past take's limit)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            # Returns early only when the program forces a wakeup (a backlog); the consume after
            # the slice finds what arrived without one.
            ret = lib.ring_buffer__poll(self._rb, min(POLL_SLICE_MS, left_ms))
            if ret != -errno.EINTR:
                check(ret, "ring_buffer__poll", self.map.path)
            check(lib.ring_buffer__consume(self._rb), "ring_buffer__consume", self.map.path)

    def close(self) -> None:
        if self._rb is not None:
            libbpf().ring_buffer__free(self._rb)
            self._rb = None
