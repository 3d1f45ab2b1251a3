"""One module per BPF map: the ctypes layout of its key and value (mirroring the C
structs in ``bpf/palisade.c``) and the only place where byte order is converted.

:data:`ALL` says once which maps exist: the facade creates and pins each of them
(``spec``), the loader ties each one's structs to the C source (``C_STRUCTS``), and a
teardown unpins each by ``NAME``.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

from services.datapath.maps import (
    ct4map,
    ctmap,
    deliverymap,
    dnsmap,
    endpointmap,
    enforcementmap,
    eventsmap,
    ipcachemap,
    lbaffinitymap,
    lbbackendmap,
    lbctmap,
    lbportmap,
    lbrevnatmap,
    lbservicemap,
    metricsmap,
    policymap,
    snatmap,
    statemap,
)
from services.datapath.maps.bpf import MapSpec
from services.datapath.maps.sizes import MapSizes


class MapModule(Protocol):
    """What every map module provides."""

    @property
    def NAME(self) -> str:
        """The map's pin name under the datapath's bpffs directory."""
        ...

    @property
    def C_STRUCTS(self) -> tuple[tuple[type[ctypes.Structure], str], ...]:
        """Its key and value structs, with the names of the C structs they mirror."""
        ...

    def spec(self, sizes: MapSizes) -> MapSpec: ...


#: Every pinned map, in creation order.
ALL: tuple[MapModule, ...] = (
    ipcachemap,
    endpointmap,
    policymap,
    enforcementmap,
    statemap,
    ctmap,
    ct4map,
    metricsmap,
    eventsmap,
    lbservicemap,
    lbbackendmap,
    lbrevnatmap,
    lbaffinitymap,
    lbctmap,
    lbportmap,
    deliverymap,
    snatmap,
    dnsmap,
)
