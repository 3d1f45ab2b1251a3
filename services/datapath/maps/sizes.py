"""How big each pinned map is made (a pinned map keeps the size it was created with)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class MapSizes:
    """Maximum entries of each map; part of the program template (the C code sizes its maps too)."""

    #: Prefixes in the ipcache (both families).
    ipcache: int = 65536
    #: Keys in the endpoints map: one per endpoint plus one per endpoint address.
    endpoints: int = 16384
    #: LPM prefixes in the shared policy map (all endpoints together).
    policy: int = 262144
    #: Tracked connections, per family (one LRU map each: the least recently used are evicted when full).
    conntrack: int = 262144
    #: (endpoint, reason, direction) counter slots.
    metrics: int = 65536
    #: Service frontends and their backend slots (all services together); also bounds service ids.
    lb_services: int = 65536
    #: Service backends (a backend of two services counts twice).
    lb_backends: int = 65536
    #: ClientIP affinity entries (LRU).
    lb_affinity: int = 65536
    #: Connections to services (LRU).
    lb_conntrack: int = 262144
    #: Connections given a source port of their own because another flow held their tuple (LRU; two
    #: entries each).
    snat: int = 65536
    #: DNS steering entries: (endpoint, DNS port, protocol) of endpoints a DNS rule selects.
    dns_steer: int = 16384
    #: Ring buffer size in bytes (a power of two).
    events_bytes: int = 1 << 22
