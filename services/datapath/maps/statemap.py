"""Global datapath state: a one-slot array holding the policy epoch.

Every write that can change a verdict (policy, enforcement, identities, ipcache)
ends by bumping the epoch. Conntrack entries remember the epoch of their last
verdict; a packet of an entry from an older epoch is re-checked against the
current maps, so a change cuts the flows it denies and keeps the ones it allows.
"""

from __future__ import annotations

import ctypes

from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap
from services.datapath.maps.sizes import MapSizes

NAME = "state"


class StateKey(ctypes.Structure):
    # struct state_key in bpf/palisade.c
    _fields_ = [("index", ctypes.c_uint32)]


class StateValue(ctypes.Structure):
    # struct state_value in bpf/palisade.c
    _fields_ = [("policy_epoch", ctypes.c_uint64)]


C_STRUCTS = ((StateKey, "state_key"), (StateValue, "state_value"))


def spec(sizes: MapSizes) -> MapSpec:
    """One slot, whatever the sizes."""
    return MapSpec(NAME, MapType.ARRAY, ctypes.sizeof(StateKey), ctypes.sizeof(StateValue), 1)


class StateMap:
    def __init__(self, pinned: PinnedMap) -> None:
        self.map = pinned

    def epoch(self) -> int:
        value = self.map.lookup(StateKey(index=0), StateValue)
        return 0 if value is None else int(value.policy_epoch)

    def bump_epoch(self) -> int:
        """Advance the epoch; callers serialize writers (one agent process, one lock)."""
        epoch = self.epoch() + 1
        self.map.update(StateKey(index=0), StateValue(policy_epoch=epoch))
        return epoch
