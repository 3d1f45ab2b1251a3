"""ListFqdnCache, ListFqdnSelectors and names in Observe, over the agent's gRPC API (BPF fake, real
NATS and gRPC), answered from a DNS proxy's view served on its real socket in the state dir."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest

from palisade.v1 import datapath_pb2
from services.datapath import types as dt
from services.datapath.fqdncache import NameCache
from services.datapath.fqdnmaps import NameEndpoint
from services.datapath.fqdnview import NamesView, view
from services.datapath.namesapi import NamesApi, socket_path
from tests.datapath_service.agent import InProcessAgent
from tests.datapath_service.helpers import create, eventually

SELECTOR = "*.example.test"


class Proxy:
    """The DNS proxy's side as the test drives it: a real cache, served as the proxy serves it."""

    def __init__(self) -> None:
        self.cache = NameCache()
        self.endpoints: list[NameEndpoint] = []

    def view(self) -> NamesView:
        return view(self.cache, self.endpoints, time.monotonic(), time.time())

    def learn(self, agent: InProcessAgent, ep_id: int, name: str, ip: str) -> int:
        """Learned, and written to the ipcache as the proxy writes it, before any flow uses it."""
        self.cache.learn(ep_id, name, [(ip, 60.0)], time.monotonic())
        ident = self.cache.identity(ip)
        assert ident is not None and agent.datapath is not None
        agent.datapath.ipcache_upsert(f"{ip}/32", ident)
        return ident


@pytest.fixture
async def proxy(agent: InProcessAgent) -> AsyncIterator[Proxy]:
    served = Proxy()
    async with NamesApi(socket_path(agent.config.state_dir), served.view):
        yield served


async def test_cache_and_selectors_are_the_proxys(agent: InProcessAgent, proxy: Proxy) -> None:
    assert agent.stub is not None
    web = await create(agent, "web", app="web")
    other = await create(agent, "other", app="other")
    rules = dt.NameRules(fqdn=(dt.FqdnRule(SELECTOR),))
    proxy.endpoints = [NameEndpoint(web.id, web.identity, tuple(web.ips), rules)]
    api = proxy.learn(agent, web.id, "api.example.test", "192.0.2.1")
    proxy.learn(agent, other.id, "cdn.other.test", "198.51.100.7")

    got = await agent.stub.ListFqdnCache(datapath_pb2.ListFqdnCacheRequest())
    assert got.node == agent.config.node_name
    listed = [(n.name, a.ip, a.identity, list(a.endpoint_ids), list(a.pods)) for n in got.names for a in n.addresses]
    assert listed[0] == ("api.example.test", "192.0.2.1", api, [web.id], ["x/web"])
    assert [n.name for n in got.names] == ["api.example.test", "cdn.other.test"]
    assert 55 <= got.names[0].addresses[0].ttl_seconds <= 60

    by_name = await agent.stub.ListFqdnCache(datapath_pb2.ListFqdnCacheRequest(name="*.OTHER.test"))
    assert [n.name for n in by_name.names] == ["cdn.other.test"]
    by_pod = datapath_pb2.ListFqdnCacheRequest(endpoint=datapath_pb2.GetEndpointRequest(namespace="x", pod="web"))
    assert [n.name for n in (await agent.stub.ListFqdnCache(by_pod)).names] == ["api.example.test"]

    selectors = await agent.stub.ListFqdnSelectors(datapath_pb2.ListFqdnSelectorsRequest())
    (sel,) = selectors.selectors
    assert (sel.selector, list(sel.endpoint_ids), list(sel.pods)) == (SELECTOR, [web.id], ["x/web"])
    assert [(x.identity, x.ip, list(x.names)) for x in sel.selected] == [(api, "192.0.2.1", ["api.example.test"])]


async def test_bad_requests_name_what_is_wrong(agent: InProcessAgent, proxy: Proxy) -> None:
    assert agent.stub is not None
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.ListFqdnCache(datapath_pb2.ListFqdnCacheRequest(name="a..b"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("name: pattern 'a..b' has an empty label")
    nobody = datapath_pb2.GetEndpointRequest(namespace="x", pod="nobody")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.ListFqdnCache(datapath_pb2.ListFqdnCacheRequest(endpoint=nobody))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "x/nobody" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in agent.stub.Observe(datapath_pb2.ObserveRequest(filter=datapath_pb2.FlowFilter(fqdns=["**"]))):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("filter: fqdns: pattern '**': '**' must be followed by a domain")


async def test_without_the_proxy_listings_say_so_and_flows_still_stream(agent: InProcessAgent) -> None:
    assert agent.stub is not None and agent.datapath is not None
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.ListFqdnSelectors(datapath_pb2.ListFqdnSelectorsRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    path = socket_path(agent.config.state_dir)
    assert err.value.details().startswith(f"the node's DNS proxy does not answer at {path}")
    web = await create(agent, "web", app="web")
    agent.datapath.ipcache_upsert("192.0.2.1/32", dt.MIN_LOCAL_IDENTITY)
    call = agent.stub.Observe(datapath_pb2.ObserveRequest(limit=1))
    await eventually(lambda: agent.agent is not None and agent.agent.flows.subscribers == 1)
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "192.0.2.1", dt.L4Proto.TCP, 443)
    (ev,) = [e async for e in call]
    assert ev.destination_identity == dt.MIN_LOCAL_IDENTITY and list(ev.destination_names) == []


async def test_flows_carry_learned_names_and_filter_on_them(agent: InProcessAgent, proxy: Proxy) -> None:
    assert agent.stub is not None and agent.datapath is not None
    web = await create(agent, "web", app="web")
    flt = datapath_pb2.FlowFilter(fqdns=[SELECTOR])
    call = agent.stub.Observe(datapath_pb2.ObserveRequest(filter=flt, limit=2))
    await eventually(lambda: agent.agent is not None and agent.agent.flows.subscribers == 1)
    proxy.learn(agent, web.id, "api.example.test", "192.0.2.1")
    proxy.learn(agent, web.id, "cdn.other.test", "198.51.100.7")
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "203.0.113.9", dt.L4Proto.TCP, 443)  # not learned
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "198.51.100.7", dt.L4Proto.TCP, 443)  # not selected
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "192.0.2.1", dt.L4Proto.TCP, 443)
    # Learned after the datapath last asked the proxy: the flow that follows still gets its name.
    proxy.learn(agent, web.id, "www.example.test", "192.0.2.3")
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "192.0.2.3", dt.L4Proto.TCP, 443)
    events = [e async for e in call]
    assert [(e.destination_ip, list(e.destination_names)) for e in events] == [
        ("192.0.2.1", ["api.example.test"]),
        ("192.0.2.3", ["www.example.test"]),
    ]

    # The flow ring's history: names too, and --last counts the flows the names let through.
    history = datapath_pb2.ObserveRequest(last=1, filter=datapath_pb2.FlowFilter(fqdns=["cdn.other.test"]))
    got = [(e.destination_ip, list(e.destination_names)) async for e in agent.stub.Observe(history)]
    assert got == [("198.51.100.7", ["cdn.other.test"])]
    everything = [e async for e in agent.stub.Observe(datapath_pb2.ObserveRequest(last=10))]
    assert [list(e.destination_names) for e in everything] == [
        [],
        ["cdn.other.test"],
        ["api.example.test"],
        ["www.example.test"],
    ]

    # Following after the history: its newest match, the end-of-history mark, then live matches.
    follow = agent.stub.Observe(datapath_pb2.ObserveRequest(last=1, follow=True, limit=2, filter=flt))
    old, mark = await follow.read(), await follow.read()
    assert isinstance(old, datapath_pb2.FlowEvent) and isinstance(mark, datapath_pb2.FlowEvent)
    assert (list(old.destination_names), mark.history_end) == (["www.example.test"], True)
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "198.51.100.7", dt.L4Proto.TCP, 443)
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, "192.0.2.1", dt.L4Proto.TCP, 443)
    live = await follow.read()
    assert isinstance(live, datapath_pb2.FlowEvent) and list(live.destination_names) == ["api.example.test"]
    assert await follow.read() is grpc.aio.EOF  # its limit: two flows
