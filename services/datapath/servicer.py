"""DatapathService over gRPC: endpoints, policy maps read back from the kernel, flow events, and
what the node's DNS proxy learned (read from the proxy, which owns it: ``fqdnapi``).

The service edge: requests are translated into the datapath's own types (``wire``)
before they reach the endpoint manager, answers back into protobuf. Every
:class:`~services.common.errors.PalisadeError` raised here or below becomes its gRPC
status in the server's error interceptor (``services.common.grpcserver``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc
from services.common import fqdn
from services.common.errors import Code, PalisadeError
from services.common.log import get_logger
from services.datapath import wire
from services.datapath.datapath import CounterSource
from services.datapath.endpoint import Endpoint
from services.datapath.flows import VERDICTS, FlowFilter, FlowHub
from services.datapath.fqdnapi import FlowNames, ReadNames, cache_response, selectors_response
from services.datapath.fqdnview import NamesView, name_filter
from services.datapath.manager import EndpointManager
from services.datapath.servicesync import ServiceSync

log = get_logger("servicer")


class DatapathServicer(datapath_pb2_grpc.DatapathServiceServicer):
    def __init__(
        self,
        manager: EndpointManager,
        flows: FlowHub,
        counters: CounterSource,
        services: ServiceSync | None = None,
        names: ReadNames | None = None,
    ) -> None:
        self._manager = manager
        self._flows = flows
        self._counters = counters
        self._services = services
        #: The DNS proxy's view of what it learned (None: this node runs no proxy).
        self._names = names
        self._flow_names = FlowNames(names) if names is not None else None

    def _pod_of(self, endpoint_id: int) -> str:
        ep = self._manager.endpoints.get(endpoint_id)
        return ep.record.key if ep is not None else ""

    async def _read_names(self) -> NamesView:
        if self._names is None:
            raise PalisadeError(
                f"node {self._manager.node} runs no DNS proxy: nothing is learned from names here",
                Code.FAILED_PRECONDITION,
            )
        return await self._names()

    async def _endpoint_proto(self, ep: Endpoint) -> datapath_pb2.Endpoint:
        out = wire.endpoint_to_proto(ep, self._manager.node)
        try:
            # This endpoint's only: reading every endpoint's costs milliseconds per hundred of them.
            counters = await asyncio.to_thread(self._counters.counters, [ep.id])
        except Exception as exc:  # counters are informational; the endpoint is still worth returning
            log.warning("reading counters failed", error=str(exc))
            return out
        for key, value in counters.values.items():
            if key.endpoint_id == ep.id and value.packets:
                out.counters[f"{key.direction}/{key.reason}"] = value.packets
        return out

    async def CreateEndpoint(
        self, request: datapath_pb2.CreateEndpointRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.Endpoint:
        ep = await self._manager.create(wire.request_from_proto(request))
        return await self._endpoint_proto(ep)

    async def DeleteEndpoint(
        self, request: datapath_pb2.DeleteEndpointRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.DeleteEndpointResponse:
        await self._manager.delete(wire.ref_from_proto(request))
        return datapath_pb2.DeleteEndpointResponse()

    async def GetEndpoint(
        self, request: datapath_pb2.GetEndpointRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.Endpoint:
        ep = self._manager.find(wire.ref_from_proto(request))
        return await self._endpoint_proto(ep)

    async def UpdateEndpoint(
        self, request: datapath_pb2.UpdateEndpointRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.Endpoint:
        ref = wire.ref_from_proto(request.endpoint)
        ep = await self._manager.relabel(ref, [wire.label_from_proto(x) for x in request.labels])
        return await self._endpoint_proto(ep)

    async def ListEndpoints(
        self, request: datapath_pb2.ListEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.ListEndpointsResponse:
        endpoints = sorted(self._manager.endpoints.values(), key=lambda e: e.id)
        node = self._manager.node
        return datapath_pb2.ListEndpointsResponse(endpoints=[wire.endpoint_to_proto(e, node) for e in endpoints])

    async def ListServices(
        self, request: datapath_pb2.ListServicesRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.ListServicesResponse:
        out = datapath_pb2.ListServicesResponse(node=self._manager.node)
        if self._services is None:
            return out
        for served in self._services.served():
            state = served.state
            out.frontends.append(
                datapath_pb2.ServiceFrontend(
                    namespace=served.namespace,
                    name=served.name,
                    port_name=served.port_name,
                    address=state.frontend.address,
                    port=state.frontend.port,
                    protocol=state.frontend.protocol.number,  # type: ignore[arg-type]  # IP numbers are the enum
                    id=state.id,
                    backends=[
                        datapath_pb2.ServiceBackend(address=b.address, port=b.port, id=i)
                        for i, b in sorted(state.backends.items(), key=lambda item: item[1])
                    ],
                    affinity_timeout_seconds=state.affinity_timeout,
                    local_only=served.local_only,
                )
            )
        out.skipped.extend(line for lines in self._services.skipped.values() for line in lines)
        return out

    async def GetPolicyMap(
        self, request: datapath_pb2.GetPolicyMapRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.GetPolicyMapResponse:
        ref = wire.ref_from_proto(request.endpoint)
        ep, enforcement, entries = await self._manager.read_policy_map(ref)
        return datapath_pb2.GetPolicyMapResponse(
            endpoint_id=ep.id,
            identity=ep.identity,
            revision=ep.realized_revision,
            enforcement=wire.enforcement_to_proto(enforcement),
            entries=[wire.entry_to_proto(e) for e in sorted(entries)],
        )

    async def ListFqdnCache(
        self, request: datapath_pb2.ListFqdnCacheRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.ListFqdnCacheResponse:
        selector = ""
        if request.name:
            try:
                selector = name_filter(request.name)
            except fqdn.FqdnError as exc:
                raise PalisadeError(f"name: {exc}", Code.INVALID_ARGUMENT) from None
        endpoint = None
        if request.HasField("endpoint"):
            endpoint = self._manager.find(wire.ref_from_proto(request.endpoint)).id
        names = await self._read_names()
        return cache_response(self._manager.node, names, selector, endpoint, self._pod_of)

    async def ListFqdnSelectors(
        self, request: datapath_pb2.ListFqdnSelectorsRequest, context: grpc.aio.ServicerContext
    ) -> datapath_pb2.ListFqdnSelectorsResponse:
        names = await self._read_names()
        return selectors_response(self._manager.node, names, self._pod_of)

    async def Observe(
        self, request: datapath_pb2.ObserveRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[datapath_pb2.FlowEvent]:
        flt = FlowFilter.from_request(request)
        unknown = [v for v in flt.verdicts if v not in VERDICTS]
        if unknown:
            names = ", ".join(str(v) for v in unknown)
            raise PalisadeError(
                f"unknown verdict(s) {names}; filter by VERDICT_ALLOW ({common_pb2.VERDICT_ALLOW}), "
                f"VERDICT_DENY ({common_pb2.VERDICT_DENY}) or VERDICT_AUDIT ({common_pb2.VERDICT_AUDIT})",
                Code.INVALID_ARGUMENT,
            )
        if request.pod and request.pod.count("/") != 1:
            raise PalisadeError(f"pod {request.pod!r} is not namespace/name", Code.INVALID_ARGUMENT)
        problems = flt.problems()
        if problems:
            raise PalisadeError("filter: " + "; ".join(problems), Code.INVALID_ARGUMENT)
        since_ns = request.since.ToNanoseconds() if request.HasField("since") else 0
        if not flt.fqdns:
            stream: AsyncIterator[Any] = self._flows.stream(
                flt, request.limit, since_ns=since_ns, last=request.last, follow=request.follow
            )
            async for event in stream:
                yield await self._named(event)
            return
        async for event in self._by_names(flt, request, since_ns):
            yield event

    async def _by_names(
        self, flt: FlowFilter, request: datapath_pb2.ObserveRequest, since_ns: int
    ) -> AsyncIterator[datapath_pb2.FlowEvent]:
        """Observe with ``fqdns``: names are known only here, so the hub filters on the rest and
        hands over its whole history; ``last`` and ``limit`` count the flows the names let through."""
        stream = self._flows.stream(
            dataclasses.replace(flt, fqdns=frozenset()),
            0,
            since_ns=since_ns or (1 if request.last else 0),
            follow=request.follow,
        )

        def newest(events: list[datapath_pb2.FlowEvent]) -> list[datapath_pb2.FlowEvent]:
            return events[-request.last :] if request.last else events

        history: list[datapath_pb2.FlowEvent] | None = [] if since_ns or request.last else None
        sent = 0
        async for event in stream:
            if event.history_end:
                out, history = [*newest(history or []), event], None
            else:
                event = await self._named(event)
                if not flt.matches_names(event):
                    continue
                if history is not None:
                    history.append(event)
                    continue
                out = [event]
            for ev in out:
                yield ev
                sent += 0 if ev.history_end else 1
                if request.limit and sent >= request.limit:
                    return
        for ev in newest(history or [])[: request.limit or None]:  # not following: the history alone
            yield ev

    async def _named(self, event: datapath_pb2.FlowEvent) -> datapath_pb2.FlowEvent:
        if self._flow_names is None or event.history_end:
            return event
        return await self._flow_names.name(event)
