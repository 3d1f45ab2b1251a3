"""The datapath's answers about learned names: the FQDN listings and the names of flows.

Both come from the DNS proxy's own view (``namesapi``): the listings ask it once per request;
flows ask it only when a flow names a learned address (its identity is node-local) that the
last answer did not hold and that is newer than that answer. The proxy writes a learned address
to the maps before it releases the answer, so a flow to an address always comes after the
proxy learned it, and one fresh answer names it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import datapath_pb2
from services.common.errors import PalisadeError
from services.common.log import get_logger
from services.datapath.fqdnview import NamesView
from services.datapath.types import is_local_identity

log = get_logger("fqdn")

ReadNames = Callable[[], Awaitable[NamesView]]

#: Flow times come from the kernel's clock, converted: a flow this much older than the last
#: answer still asks again for an address it did not hold.
CLOCK_MARGIN = 1.0
#: An address the proxy did not hold is asked for again no sooner than this.
MISS_INTERVAL = 1.0


def _stamp(wall: float) -> Timestamp:
    out = Timestamp()
    out.FromNanoseconds(int(wall * 1e9))
    return out


def cache_response(
    node: str, names: NamesView, selector: str, endpoint: int | None, pod_of: Callable[[int], str]
) -> datapath_pb2.ListFqdnCacheResponse:
    """The listing of the pairs ``selector`` and ``endpoint`` select (see :meth:`NamesView.select`)."""
    out = datapath_pb2.ListFqdnCacheResponse(node=node)
    by_name: dict[str, datapath_pb2.FqdnName] = {}
    for a in names.select(selector, endpoint):
        entry = by_name.get(a.name)
        if entry is None:
            entry = by_name[a.name] = out.names.add(name=a.name)
        entry.addresses.append(
            datapath_pb2.FqdnAddress(
                ip=a.ip,
                identity=a.identity,
                ttl_seconds=max(0, math.ceil(a.ttl_left)),
                expires=_stamp(a.expires),
                endpoint_ids=a.endpoints,
                pods=[p for p in (pod_of(e) for e in a.endpoints) if p],
            )
        )
    return out


def selectors_response(
    node: str, names: NamesView, pod_of: Callable[[int], str]
) -> datapath_pb2.ListFqdnSelectorsResponse:
    out = datapath_pb2.ListFqdnSelectorsResponse(node=node)
    for sel in names.selections():
        out.selectors.append(
            datapath_pb2.FqdnSelector(
                selector=sel.selector,
                selected=[datapath_pb2.FqdnSelected(identity=i, ip=ip, names=n) for i, ip, n in sel.selected],
                endpoint_ids=sel.endpoints,
                pods=[p for p in (pod_of(e) for e in sel.endpoints) if p],
            )
        )
    return out


class FlowNames:
    """Fills ``source_names``/``destination_names`` of flows from the proxy's view, shared by every
    Observe stream of the datapath."""

    def __init__(self, read: ReadNames, clock: Callable[[], float] = time.time) -> None:
        self._read = read
        self._clock = clock
        self._lock = asyncio.Lock()
        #: Address -> learned names, as of the last answer (an empty list: not held then).
        self._names: dict[str, list[str]] = {}
        #: When the last answer was asked for (wall clock); 0: never.
        self._asked = 0.0
        self._unavailable = False

    async def name(self, event: datapath_pb2.FlowEvent) -> datapath_pb2.FlowEvent:
        """``event``, or a copy of it with the names of its learned addresses."""
        sides = ((event.source_ip, event.source_identity), (event.destination_ip, event.destination_identity))
        learned = [ip for ip, ident in sides if is_local_identity(ident)]
        if not learned:
            return event
        when = event.time.ToNanoseconds() / 1e9
        if any(self._stale(ip, when) for ip in learned):
            async with self._lock:
                if any(self._stale(ip, when) for ip in learned):
                    await self._refresh(learned)
        src = self._names.get(event.source_ip, []) if event.source_ip in learned else []
        dst = self._names.get(event.destination_ip, []) if event.destination_ip in learned else []
        if not src and not dst:
            return event
        out = datapath_pb2.FlowEvent()
        out.CopyFrom(event)
        out.source_names.extend(src)
        out.destination_names.extend(dst)
        return out

    def _stale(self, ip: str, when: float) -> bool:
        held = self._names.get(ip)
        if held is None:
            return when + CLOCK_MARGIN > self._asked
        return not held and self._clock() - self._asked >= MISS_INTERVAL and when + CLOCK_MARGIN > self._asked

    async def _refresh(self, wanted: list[str]) -> None:
        self._asked = self._clock()
        try:
            names = await self._read()
        except PalisadeError as exc:
            if not self._unavailable:
                log.warning("flows shown without learned names", error=exc.message)
                self._unavailable = True
            for ip in wanted:
                self._names.setdefault(ip, [])
            return
        self._unavailable = False
        self._names = names.names_by_ip()
        for ip in wanted:
            self._names.setdefault(ip, [])


__all__ = ["FlowNames", "cache_response", "selectors_response"]
