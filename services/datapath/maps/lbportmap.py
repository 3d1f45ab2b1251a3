"""Frontend ports: a bitmap of every port some service frontend listens on, a hint for the program.

A packet leaving a pod that its own conntrack tuple does not know is a reply (its
reversed tuple), a packet to a service frontend, or a new flow. Where its destination
port is a frontend's, the program asks the service map before the reversed tuple: a
frontend is no pod's source address, so a frontend hit is never a reply, and an
established service connection's packets skip one conntrack lookup. The hint never
decides anything: a port missing from it (not written yet) costs the old order, a
port left in it (its last frontend gone) one service-map miss.

An array of 1,024 64-bit words; port ``p`` (host order) is bit ``p % 64`` of word
``p // 64``.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Iterable

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "lb_ports"
WORDS = 1024
BITS = 64


class LbPortKey(ctypes.Structure):
    # struct lb_port_key in bpf/palisade.c
    _fields_ = [("word", ctypes.c_uint32)]


class LbPortValue(ctypes.Structure):
    # struct lb_port_value in bpf/palisade.c
    _fields_ = [("bits", ctypes.c_uint64)]


C_STRUCTS = ((LbPortKey, "lb_port_key"), (LbPortValue, "lb_port_value"))


def spec(sizes: MapSizes) -> MapSpec:
    """Every port, whatever the sizes."""
    return MapSpec(NAME, MapType.ARRAY, ctypes.sizeof(LbPortKey), ctypes.sizeof(LbPortValue), WORDS)


def words_of(ports: Iterable[int]) -> dict[int, int]:
    """The bitmap's non-zero words for ``ports``."""
    words: dict[int, int] = {}
    for port in ports:
        words[port // BITS] = words.get(port // BITS, 0) | 1 << (port % BITS)
    return words


class LbPortMap:
    """The bitmap, with how many frontends hold each port (one writer: the load balancer)."""

    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned
        self._words: dict[int, int] = {}
        for key, value in self.map.items(LbPortKey, LbPortValue):
            if int(value.bits):
                self._words[int(key.word)] = int(value.bits)
        self._holders: Counter[int] = Counter()

    def ports(self) -> set[int]:
        """The ports the map holds."""
        return {w * BITS + b for w, bits in self._words.items() for b in range(BITS) if bits >> b & 1}

    def reset(self, ports: Iterable[int]) -> None:
        """Hold ``ports`` (each once per frontend on it) and nothing else."""
        self._holders = Counter(ports)
        wanted = words_of(self._holders)
        for word in self._words.keys() | wanted.keys():
            self._write(word, wanted.get(word, 0))

    def hold(self, port: int) -> None:
        """A frontend on ``port`` was added."""
        self._holders[port] += 1
        if self._holders[port] == 1:
            word = port // BITS
            self._write(word, self._words.get(word, 0) | 1 << (port % BITS))

    def release(self, port: int) -> None:
        """A frontend on ``port`` was removed."""
        self._holders[port] -= 1
        if self._holders[port] <= 0:
            del self._holders[port]
            word = port // BITS
            self._write(word, self._words.get(word, 0) & ~(1 << (port % BITS)))

    def _write(self, word: int, bits: int) -> None:
        if self._words.get(word, 0) == bits:
            return
        self.map.update(LbPortKey(word=word), LbPortValue(bits=bits))
        if bits:
            self._words[word] = bits
        else:
            self._words.pop(word, None)
