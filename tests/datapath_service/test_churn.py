"""Pods created and deleted together (a rollout's burst) over the in-memory BPF fake: real NATS and gRPC.

Each pod gets its own endpoint, address and enforcement; endpoints of one new identity share one
fetch of its policy; deleting them all leaves no endpoint, address, veth or map entry behind.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from palisade.v1 import common_pb2, datapath_pb2
from services.datapath import types as dt
from testkit.builders import policy_entry
from testkit.controlplane import ING, ControlPlane
from tests.datapath_service.agent import InProcessAgent
from tests.datapath_service.helpers import create, eventually

#: The identity the control plane hands the first label set it sees (its numbering starts there).
FIRST_IDENTITY = 256
#: An outside address: the world identity (2) in the ipcache.
OUTSIDE = "198.51.100.7"


def verdict(agent: InProcessAgent, ep_id: int, remote_ip: str, port: int) -> dt.Verdict:
    assert agent.datapath is not None
    return agent.datapath.evaluate(ep_id, dt.Direction.INGRESS, remote_ip, dt.L4Proto.TCP, port)[0]


async def test_a_burst_of_creates_gets_one_policy_fetch_and_each_pod_its_own_address_and_enforcement(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    # The identity's policy is known to PolicyService only (no order brings it): each new endpoint
    # needs it fetched, and the burst's endpoints, all of that identity, share one fetch.
    await cp.set_policy(FIRST_IDENTITY, [policy_entry(ING, dt.IDENTITY_WORLD, 80)], publish=False)
    before = len(cp.resyncs)
    count = 12
    eps = await asyncio.gather(*(create(agent, f"web-{i}", app="web") for i in range(count)))

    assert {ep.identity for ep in eps} == {FIRST_IDENTITY}
    assert [list(r.identities) for r in cp.resyncs[before:]] == [[FIRST_IDENTITY]]
    assert len({ep.id for ep in eps}) == count
    assert len({ip for ep in eps for ip in ep.ips}) == count
    assert sorted(cp.ips) == sorted(ip for ep in eps for ip in ep.ips)
    for ep in eps:
        assert ep.state == datapath_pb2.ENDPOINT_STATE_READY
        assert verdict(agent, ep.id, OUTSIDE, 80) is dt.Verdict.ALLOW
        assert verdict(agent, ep.id, OUTSIDE, 81) is dt.Verdict.DENY

    # A later endpoint of that identity needs no fetch: the node has its policy.
    late = await create(agent, "web-late", app="web")
    assert len(cp.resyncs) == before + 1
    assert verdict(agent, late.id, OUTSIDE, 80) is dt.Verdict.ALLOW


async def test_creates_and_deletes_interleaved_leave_exactly_the_live_pods(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None and agent.datapath is not None
    await cp.set_policy(FIRST_IDENTITY, [policy_entry(ING, dt.IDENTITY_WORLD, 80)], publish=False)
    first = await asyncio.gather(*(create(agent, f"a-{i}", app="web") for i in range(8)))

    # Half of them go while as many new ones come, all at once.
    gone = first[:4]
    deletes = [
        agent.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=ep.id)) for ep in gone
    ]  # fmt: skip
    results = await asyncio.gather(*deletes, *(create(agent, f"b-{i}", app="web") for i in range(4)))
    second = [r for r in results if isinstance(r, datapath_pb2.Endpoint)]
    live = first[4:] + second

    listed = (await agent.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())).endpoints
    assert sorted(e.pod for e in listed) == sorted(e.pod for e in live)
    assert all(e.state == datapath_pb2.ENDPOINT_STATE_READY for e in listed)
    # Every live pod has an address of its own; the deleted ones' are back with IPAM (or reused).
    assert len({ip for e in listed for ip in e.ips}) == len(live)
    assert sorted(cp.ips) == sorted(ip for e in listed for ip in e.ips)
    # Only live endpoints are in the maps, each enforcing its policy; no veth of a deleted pod is left.
    assert [p.id for p in agent.datapath.pinned_endpoints()] == sorted(e.id for e in listed)
    for e in listed:
        assert verdict(agent, e.id, OUTSIDE, 80) is dt.Verdict.ALLOW
        assert verdict(agent, e.id, OUTSIDE, 81) is dt.Verdict.DENY
    assert sorted(agent.network.links) == sorted(e.host_ifname for e in listed)

    await asyncio.gather(
        *(agent.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=e.id)) for e in listed)
    )  # fmt: skip
    assert not (await agent.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())).endpoints
    assert cp.ips == {} and agent.network.links == {} and agent.datapath.pinned_endpoints() == []


async def test_a_new_endpoints_programs_meet_its_policy_and_an_order_during_their_attach_reaches_it(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.datapath is not None and agent.agent is not None
    dp, manager = agent.datapath, agent.agent.manager
    await cp.set_policy(FIRST_IDENTITY, [policy_entry(ING, dt.IDENTITY_WORLD, 80)], publish=False)
    # The attach is held (our fake's method, wrapped) until an order has changed the identity's policy.
    attach = dp.attach_endpoint
    seen: list[tuple[dt.Verdict, dt.Verdict]] = []
    release = threading.Event()

    def held_attach(spec: dt.EndpointSpec) -> None:
        # What the endpoint's map says as its programs go on: its identity's policy already.
        seen.append((verdict(agent, spec.id, OUTSIDE, 80), verdict(agent, spec.id, OUTSIDE, 81)))
        assert release.wait(30)
        attach(spec)

    dp.attach_endpoint = held_attach  # type: ignore[method-assign]
    creating = asyncio.create_task(create(agent, "web-0", app="web"))
    try:
        await eventually(lambda: bool(seen))
        assert seen == [(dt.Verdict.ALLOW, dt.Verdict.DENY)]
        # The owner is free while the programs attach: it applies an order meanwhile.
        revision = await cp.set_policy(FIRST_IDENTITY, [policy_entry(ING, dt.IDENTITY_WORLD, 81)])
        await eventually(lambda: manager.revision >= revision)
    finally:
        release.set()
    ep = await creating
    # The endpoint, not in the table when that order was applied, has it all the same.
    assert ep.state == datapath_pb2.ENDPOINT_STATE_READY
    assert verdict(agent, ep.id, OUTSIDE, 80) is dt.Verdict.DENY
    assert verdict(agent, ep.id, OUTSIDE, 81) is dt.Verdict.ALLOW


async def test_a_create_whose_pod_is_unknown_leaves_nothing_of_the_address_and_network_made_meanwhile(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None and agent.datapath is not None
    # No labels: the pod's identity is resolved, and ipam does not know the pod. Its address and
    # network are made at the same time as the identity is asked for.
    request = datapath_pb2.CreateEndpointRequest(namespace="x", pod="ghost")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await agent.stub.CreateEndpoint(request)
    assert failed.value.code() is grpc.StatusCode.NOT_FOUND
    assert cp.ips == {} and agent.network.links == {}
    assert not (await agent.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())).endpoints
    assert agent.datapath.pinned_endpoints() == []

    # Once ipam knows it, the same pod is created (nothing of the failed attempt stands in the way).
    cp.pods["x/ghost"] = FIRST_IDENTITY + 40
    ep = await agent.stub.CreateEndpoint(request)
    assert ep.identity == FIRST_IDENTITY + 40 and len(ep.ips) == 1
    assert sorted(cp.ips) == list(ep.ips) and list(agent.network.links) == [ep.host_ifname]


async def test_a_create_whose_caller_goes_away_is_finished_and_undone(agent: InProcessAgent, cp: ControlPlane) -> None:
    """A deadline that passes mid-create (here while the pod's veth is being made, in a thread that
    cannot be stopped) leaves nothing: no veth, address, identity reference, endpoint or reservation
    of the pod; the same pod is created afterwards as if the first attempt never was."""
    assert agent.stub is not None and agent.datapath is not None and agent.agent is not None
    request = datapath_pb2.CreateEndpointRequest(
        namespace="x", pod="late", labels=[common_pb2.Label(source="k8s", key="app", value="late")]
    )
    gate = threading.Event()
    agent.network.gate = gate
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await agent.stub.CreateEndpoint(request, timeout=0.5)
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert agent.network.links == {}, "the veth is still being made"
    gate.set()  # the kernel finishes the veth after the caller has gone

    def undone() -> bool:
        assert agent.datapath is not None and agent.agent is not None
        return (
            agent.network.links == {}
            and agent.network.namespaces == set()
            and cp.ips == {}
            and cp.owner_identity == {}
            and not agent.agent.manager.endpoints
            and agent.datapath.pinned_endpoints() == []
        )

    await eventually(undone)
    await agent.agent.manager.settled()
    agent.network.gate = None
    ep = await agent.stub.CreateEndpoint(request)
    assert list(agent.network.links) == [ep.host_ifname] and sorted(cp.ips) == list(ep.ips)
