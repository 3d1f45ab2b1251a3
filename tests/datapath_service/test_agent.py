"""The datapath agent end to end over the in-memory BPF fake: real NATS, real gRPC, no root needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from palisade.v1 import common_pb2, datapath_pb2, ipam_pb2, policy_pb2
from services.datapath import types as dt
from services.datapath.fake import FakeDatapath
from services.datapath.loader import ProgramConfig
from services.datapath.maps import metricsmap
from services.datapath.maps.sizes import MapSizes
from services.datapath.state import EndpointStore
from testkit.builders import policy_entry
from testkit.controlplane import ALLOW, DENY, ING, TCP, ControlPlane
from testkit.harness import NatsServer
from tests.datapath_service.agent import NODE, InProcessAgent
from tests.datapath_service.helpers import create, eventually, labels


def verdict(agent: InProcessAgent, ep_id: int, remote_ip: str, port: int) -> dt.Verdict:
    assert agent.datapath is not None
    return agent.datapath.evaluate(ep_id, dt.Direction.INGRESS, remote_ip, dt.L4Proto.TCP, port)[0]


async def test_endpoints_realize_ordered_policy_and_report_it(agent: InProcessAgent, cp: ControlPlane) -> None:
    assert agent.stub is not None
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    assert (web.id, db.id) == (1, 2)
    assert web.ips != db.ips and web.identity != db.identity
    assert web.state == datapath_pb2.ENDPOINT_STATE_READY

    # db admits web on 5432 and denies it on 22; nothing else.
    rev = await cp.set_policy(
        db.identity,
        [policy_entry(ING, web.identity, 5432), policy_entry(ING, web.identity, 22, verdict=DENY)],
    )
    await cp.wait_realized(rev, [web.id, db.id])
    assert cp.realized[db.id] == (db.identity, rev)
    assert verdict(agent, db.id, web.ips[0], 5432) is dt.Verdict.ALLOW
    assert verdict(agent, db.id, web.ips[0], 22) is dt.Verdict.DENY
    assert verdict(agent, db.id, web.ips[0], 80) is dt.Verdict.DENY  # default deny
    assert verdict(agent, web.id, db.ips[0], 80) is dt.Verdict.ALLOW  # web is not enforced

    # GetPolicyMap reads the map back: exactly the ordered entries.
    got = await agent.stub.GetPolicyMap(
        datapath_pb2.GetPolicyMapRequest(endpoint=datapath_pb2.GetEndpointRequest(namespace="x", pod="db"))
    )
    assert got.enforcement.ingress and not got.enforcement.egress
    assert got.revision == rev
    assert {(e.key.remote_identity, e.key.port_low, e.verdict) for e in got.entries} == {
        (web.identity, 5432, ALLOW),
        (web.identity, 22, DENY),
    }
    listed = await agent.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())
    assert [e.pod for e in listed.endpoints] == ["web", "db"]
    assert all(e.realized_revision == rev for e in listed.endpoints)


async def test_bad_requests_get_clear_codes_and_leave_other_endpoints_alone(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None
    web = await create(agent, "web", app="web")
    rev = await cp.set_policy(web.identity, [policy_entry(ING, 999, 80)])
    await cp.wait_realized(rev, [web.id])

    cases = [
        (datapath_pb2.CreateEndpointRequest(namespace="x", pod="web", labels=labels(app="web")), "ALREADY_EXISTS"),
        (datapath_pb2.CreateEndpointRequest(pod="p", labels=labels(app="a")), "INVALID_ARGUMENT"),
        (datapath_pb2.CreateEndpointRequest(namespace="x", labels=labels(app="a")), "INVALID_ARGUMENT"),
        (datapath_pb2.CreateEndpointRequest(namespace="x", pod="Bad_Name"), "INVALID_ARGUMENT"),
        (datapath_pb2.CreateEndpointRequest(namespace="x", pod="ghost"), "NOT_FOUND"),  # unknown, no labels
        (datapath_pb2.CreateEndpointRequest(namespace="x", pod="p", netns="/run/netns/absent"), "INVALID_ARGUMENT"),
    ]
    for request, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.stub.CreateEndpoint(request)
        assert err.value.code().name == code, request
        assert err.value.details()
    for ref, code in [
        (datapath_pb2.GetEndpointRequest(id=77), "NOT_FOUND"),
        (datapath_pb2.GetEndpointRequest(namespace="x", pod="nope"), "NOT_FOUND"),
        (datapath_pb2.GetEndpointRequest(namespace="x"), "INVALID_ARGUMENT"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.stub.GetEndpoint(ref)
        assert err.value.code().name == code
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=77))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "77" in (err.value.details() or "")

    # The failed creates released what they took and touched nothing else.
    assert set(cp.ips.values()) == {"pod/x/web"}
    assert agent.network.namespaces == {"/run/netns/pal_x_web"}
    assert verdict(agent, web.id, "10.9.9.9", 80) is dt.Verdict.DENY
    again = await agent.stub.GetEndpoint(datapath_pb2.GetEndpointRequest(id=web.id))
    assert again.state == datapath_pb2.ENDPOINT_STATE_READY and again.realized_revision == rev

    await agent.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(namespace="x", pod="web"))
    assert cp.ips == {} and agent.network.namespaces == set()
    assert agent.datapath is not None and agent.datapath.pinned_endpoints() == []


async def test_a_sequence_gap_resyncs_and_later_orders_apply_on_top(agent: InProcessAgent, cp: ControlPlane) -> None:
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 1)], publish=False)  # lost
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 2)])
    await cp.wait_realized(rev, [db.id])
    assert any(not r.identities for r in cp.resyncs[1:])  # a full resync after the startup one
    assert verdict(agent, db.id, web.ips[0], 2) is dt.Verdict.ALLOW
    assert verdict(agent, db.id, web.ips[0], 1) is dt.Verdict.DENY
    assert agent.agent is not None and agent.agent.consumer.sequencer.gaps == 1

    # A chunked order applies once all chunks are in; a fetch order resyncs.
    cp.sequence += 1
    cp.revision += 1
    chunks = [
        policy_pb2.RegenerationOrder(
            node=NODE,
            sequence=cp.sequence,
            revision=cp.revision,
            chunk=i,
            chunks=2,
            diffs=[
                common_pb2.IdentityPolicyDiff(
                    identity=db.identity,
                    enforcement=common_pb2.Enforcement(ingress=True),
                    add=[policy_entry(ING, web.identity, 10 + i)],
                    full=i == 0,
                )
            ],
        )
        for i in range(2)
    ]
    cp.policies[db.identity].entries = {e.key.SerializeToString(): e for c in chunks for e in c.diffs[0].add}
    await cp.publish_raw(chunks[1])
    await cp.publish_raw(chunks[0])
    await cp.wait_realized(cp.revision, [db.id])
    assert [verdict(agent, db.id, web.ips[0], p) for p in (2, 10, 11)] == [
        dt.Verdict.DENY,
        dt.Verdict.ALLOW,
        dt.Verdict.ALLOW,
    ]
    resyncs = len(cp.resyncs)
    cp.policies[db.identity].entries = {}
    cp.sequence += 1
    cp.revision += 1
    await cp.publish_raw(
        policy_pb2.RegenerationOrder(node=NODE, sequence=cp.sequence, revision=cp.revision, fetch=True)
    )
    await cp.wait_realized(cp.revision, [db.id])
    assert len(cp.resyncs) == resyncs + 1
    assert verdict(agent, db.id, web.ips[0], 10) is dt.Verdict.DENY


async def test_removed_identities_replace_orders_and_deleted_endpoints(agent: InProcessAgent, cp: ControlPlane) -> None:
    assert agent.stub is not None and agent.agent is not None
    manager = agent.agent.manager
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    await cp.set_policy(4500, [policy_entry(ING, web.identity, 9)])  # an identity with no endpoint here (yet)
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 80)])
    await cp.wait_realized(rev, [web.id, db.id])
    assert 4500 in manager.realizer.policies

    # The node no longer hosts 4500 (dropped) nor, as far as the policy service knows, db's identity:
    # db's endpoint still has it, so its policy stays enforced until the endpoint moves on.
    cp.sequence += 1
    cp.revision += 1
    await cp.publish_raw(
        policy_pb2.RegenerationOrder(
            node=NODE, sequence=cp.sequence, revision=cp.revision, removed_identities=[4500, db.identity]
        )
    )
    await cp.wait_realized(cp.revision, [web.id, db.id])
    assert 4500 not in manager.realizer.policies and db.identity in manager.realizer.policies
    assert verdict(agent, db.id, web.ips[0], 80) is dt.Verdict.ALLOW
    assert verdict(agent, db.id, web.ips[0], 81) is dt.Verdict.DENY

    # The policy service restarted: its first order (after a gap) is the whole state; no resync is needed.
    resyncs = len(cp.resyncs)
    cp.sequence += 2
    cp.revision += 1
    full = common_pb2.IdentityPolicyDiff(
        identity=web.identity,
        enforcement=common_pb2.Enforcement(ingress=True),
        add=[policy_entry(ING, db.identity, 443)],
        full=True,
    )
    await cp.publish_raw(
        policy_pb2.RegenerationOrder(
            node=NODE, sequence=cp.sequence, revision=cp.revision, diffs=[full, empty_full_diff(4600)], replace=True
        )
    )
    await cp.wait_realized(cp.revision, [web.id, db.id])
    assert len(cp.resyncs) == resyncs
    assert agent.agent.consumer.replaces == 1 and agent.agent.consumer.sequence == cp.sequence
    assert set(manager.realizer.policies) == {web.identity, db.identity, 4600}
    assert verdict(agent, web.id, db.ips[0], 443) is dt.Verdict.ALLOW
    assert verdict(agent, web.id, db.ips[0], 80) is dt.Verdict.DENY
    assert verdict(agent, db.id, web.ips[0], 80) is dt.Verdict.ALLOW  # kept for its endpoint

    # Deleting an endpoint tells the policy service to forget it; its kept policy goes with it.
    await agent.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=db.id))
    await eventually(lambda: any(r.deleted for r in cp.reports))
    (gone,) = [r for r in cp.reports if r.deleted]
    assert (gone.node, gone.endpoint_id, gone.identity, gone.pod) == (NODE, db.id, db.identity, "x/db")
    assert db.identity not in manager.realizer.policies
    # A new endpoint of a kept-then-dropped identity fetches its policy again.
    again = await create(agent, "db2", app="db")
    assert again.identity == db.identity and cp.resyncs[-1].identities == [db.identity]


def empty_full_diff(identity: int) -> common_pb2.IdentityPolicyDiff:
    return common_pb2.IdentityPolicyDiff(identity=identity, enforcement=common_pb2.Enforcement(ingress=True), full=True)


async def test_restart_restores_endpoints_cleans_stale_ones_and_catches_up(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    gone = await create(agent, "gone", app="gone")
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 5432)])
    await cp.wait_realized(rev, [db.id])

    await agent.stop()
    # While the agent is down: the pinned maps keep enforcing, policy changes, a pod's namespace goes.
    assert agent.datapath is not None
    down = FakeDatapath.open(agent.config.bpffs)
    assert down.evaluate(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, 5432)[0] is dt.Verdict.ALLOW
    rev2 = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 6000)])
    agent.network.namespaces.discard("/run/netns/pal_x_gone")
    cp.realized.clear()

    await agent.start()
    await agent.wait_synced()
    await cp.wait_realized(rev2, [web.id, db.id])
    listed = await agent.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())
    assert [(e.id, e.pod, list(e.ips)) for e in listed.endpoints] == [
        (web.id, "web", list(web.ips)),
        (db.id, "db", list(db.ips)),
    ]
    assert verdict(agent, db.id, web.ips[0], 6000) is dt.Verdict.ALLOW
    assert verdict(agent, db.id, web.ips[0], 5432) is dt.Verdict.DENY
    # Conntrack entries an older program wrote were moved once every endpoint ran the new programs.
    assert agent.datapath.migrations == [(True, {web.id, db.id})]
    # The stale endpoint is gone everywhere: programs, state, its address.
    assert gone.id not in {p.id for p in agent.datapath.pinned_endpoints()}
    assert not (Path(agent.config.state_dir) / str(gone.id)).exists()
    await eventually(lambda: gone.ips[0] not in cp.ips)
    assert cp.ips[web.ips[0]] == "pod/x/web"

    status = common_pb2.ServiceStatus()
    assert agent.agent is not None
    agent.agent.status(status)
    assert status.synced and status.revision == rev2 and status.details["endpoints"] == "2"
    # The address index follows the table through the restore: restored endpoints are found by
    # address, the stale one is not.
    manager = agent.agent.manager
    ip = web.ips[0]
    assert manager.local_identity(f"{ip}/32") == web.identity and manager.local_identity(f"{ip}/24") is None
    assert manager.local_identity(f"{gone.ips[0]}/32") is None
    await agent.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=web.id))
    assert manager.by_ip(ip) is None and manager.local_identity(f"{ip}/32") is None
    assert manager.by_ip(db.ips[0]) is manager.endpoints[db.id]


async def test_a_restart_finishes_the_teardown_of_an_endpoint_deleted_before_the_stop_and_never_restores_it(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None
    netns = "/run/netns/cni-sandbox"
    agent.network.namespaces.add(netns)
    request = datapath_pb2.CreateEndpointRequest(
        namespace="x", pod="web", container_id="c1", netns=netns, labels=labels(app="web")
    )
    ep = await agent.stub.CreateEndpoint(request)
    kept = await create(agent, "db", app="db")
    await agent.stop()
    # As a stop leaves a DEL answered before its veth went: the state kept aside, the veth there.
    store = EndpointStore(agent.config.state_dir)
    aside = store.mark_going(ep.id)
    assert ep.host_ifname in agent.network.links

    await agent.start()
    await agent.wait_synced()
    listed = await agent.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())
    assert [e.pod for e in listed.endpoints] == [kept.pod]
    assert ep.host_ifname not in agent.network.links and kept.host_ifname in agent.network.links
    assert not aside.exists() and store.going() == []


async def test_relabel_switches_identity_with_new_policy_first(agent: InProcessAgent, cp: ControlPlane) -> None:
    assert agent.stub is not None
    web = await create(agent, "web", app="web")
    cp.pods["x/api"] = 4000  # a pod the control plane knows from the bus
    api = await agent.stub.CreateEndpoint(datapath_pb2.CreateEndpointRequest(namespace="x", pod="api"))
    assert api.identity == 4000
    await cp.set_policy(4000, [policy_entry(ING, web.identity, 80)])
    rev = await cp.set_policy(4001, [policy_entry(ING, web.identity, 81)])
    await cp.wait_realized(rev, [api.id])
    assert verdict(agent, api.id, web.ips[0], 80) is dt.Verdict.ALLOW

    # ipam relabels the pod: a new ipcache entry for its address.
    await cp.relabel_pod("x", "api", 4001)
    await eventually(lambda: cp.realized.get(api.id, (0, 0))[0] == 4001)
    assert verdict(agent, api.id, web.ips[0], 81) is dt.Verdict.ALLOW
    assert verdict(agent, api.id, web.ips[0], 80) is dt.Verdict.DENY
    assert agent.datapath is not None and agent.datapath.resolve_identity(api.ips[0]) == 4001

    # An explicit update of a labelled pod allocates the new labels' identity.
    got = await agent.stub.UpdateEndpoint(
        datapath_pb2.UpdateEndpointRequest(endpoint=datapath_pb2.GetEndpointRequest(id=web.id), labels=labels(app="v2"))
    )
    assert got.identity not in (web.identity, 0)
    assert agent.datapath.resolve_identity(web.ips[0]) == got.identity
    assert ("k8s", "app", "v2") in {(x.source, x.key, x.value) for x in got.labels}


async def test_observe_streams_filtered_flow_events(agent: InProcessAgent, cp: ControlPlane) -> None:
    assert agent.stub is not None and agent.datapath is not None
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 80)])
    await cp.wait_realized(rev, [db.id])
    call = agent.stub.Observe(datapath_pb2.ObserveRequest(verdicts=[common_pb2.VERDICT_DENY], pod="x/db", limit=1))
    await eventually(lambda: agent.agent is not None and agent.agent.flows.subscribers == 1)
    agent.datapath.simulate_flow(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, 80)  # allowed
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, db.ips[0], dt.L4Proto.TCP, 99)  # other pod
    agent.datapath.simulate_flow(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, 99)  # the one
    events = [e async for e in call]
    assert len(events) == 1
    (ev,) = events
    assert (ev.pod, ev.verdict, ev.destination_port, ev.source_identity) == (
        "x/db",
        common_pb2.VERDICT_DENY,
        99,
        web.identity,
    )
    assert ev.reason == datapath_pb2.FLOW_REASON_DEFAULT_DENY and ev.node == NODE
    bad = datapath_pb2.ObserveRequest(verdicts=[7])  # type: ignore[list-item]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in agent.stub.Observe(bad):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("unknown verdict(s) 7; filter by VERDICT_ALLOW")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in agent.stub.Observe(datapath_pb2.ObserveRequest(pod="db")):
            pass
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "pod 'db' is not namespace/name",
    )


async def test_observe_replays_the_flow_ring_with_every_filter(agent: InProcessAgent, cp: ControlPlane) -> None:
    """Flows are recorded with no client attached; --last/--since replay them, filtered on the node."""
    assert agent.stub is not None and agent.datapath is not None and agent.agent is not None
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 80)])
    await cp.wait_realized(rev, [db.id])
    assert agent.agent.flows.subscribers == 0
    agent.datapath.simulate_flow(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, 80)  # allowed
    agent.datapath.simulate_flow(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.UDP, 53)  # dropped
    agent.datapath.simulate_flow(web.id, dt.Direction.EGRESS, db.ips[0], dt.L4Proto.TCP, 99)  # not enforced
    await eventually(lambda: len(agent.agent.flows.ring) == 3)  # type: ignore[union-attr]

    async def replay(**fields: Any) -> list[datapath_pb2.FlowEvent]:
        flt = datapath_pb2.FlowFilter(**fields.pop("filter", {}))
        return [e async for e in agent.stub.Observe(datapath_pb2.ObserveRequest(filter=flt, **fields))]  # type: ignore[union-attr]

    every = await replay(last=100)
    assert [e.destination_port for e in every] == [80, 53, 99]  # oldest first
    assert [e.destination_port for e in await replay(last=2)] == [53, 99]
    assert [e.destination_port for e in await replay(since=every[1].time)] == [53, 99]
    assert [e.destination_port for e in await replay(last=9, filter={"verdicts": [common_pb2.VERDICT_DENY]})] == [53]
    assert [e.destination_port for e in await replay(last=9, filter={"protocols": [common_pb2.PROTOCOL_UDP]})] == [53]
    assert [e.destination_port for e in await replay(last=9, filter={"ports": [99]})] == [99]
    # the remote side is named from the ipcache: both ends of every flow have their pod
    assert [e.destination_port for e in await replay(last=9, filter={"from_pods": ["x/web"]})] == [80, 53, 99]
    assert [e.destination_port for e in await replay(last=9, filter={"to_pods": ["x/web"]})] == []
    assert [e.destination_port for e in await replay(last=9, filter={"from_pods": ["x/db"]})] == []
    assert [e.destination_port for e in await replay(last=9, filter={"pods": ["x/db"]})] == [80, 53, 99]
    assert [e.destination_port for e in await replay(last=9, filter={"namespaces": ["y"]})] == []
    assert len(await replay(last=9, filter={"namespaces": ["x"]})) == 3
    from_web = await replay(last=9, filter={"from_identities": [web.identity]})
    assert [e.destination_port for e in from_web] == [80, 53, 99]
    assert [e.destination_port for e in await replay(last=9, filter={"from_identities": [db.identity]})] == []
    assert [e.destination_port for e in await replay(last=9, filter={"to_identities": [web.identity]})] == []

    # follow: the history, its end mark, then live flows
    call = agent.stub.Observe(datapath_pb2.ObserveRequest(last=1, follow=True, limit=3))
    agen = call.__aiter__()
    first = await anext(agen)
    mark = await anext(agen)
    assert first.destination_port == 99 and mark.history_end and mark.node == NODE
    agent.datapath.simulate_flow(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, 81)
    assert (await anext(agen)).destination_port == 81

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await replay(last=1, filter={"from_pods": ["web"]})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "from_pods" in (err.value.details() or "")


async def test_periodic_repair_rewrites_a_drifted_map(agent: InProcessAgent, cp: ControlPlane) -> None:
    assert agent.datapath is not None and agent.agent is not None
    web = await create(agent, "web", app="web")
    db = await create(agent, "db", app="db")
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 80)])
    await cp.wait_realized(rev, [db.id])
    # Someone writes the map behind the agent's back.
    agent.datapath.sync_policy(db.id, dt.Enforcement(ingress=False), [])
    assert verdict(agent, db.id, web.ips[0], 99) is dt.Verdict.ALLOW
    assert await agent.agent.manager.repair() == 1
    assert verdict(agent, db.id, web.ips[0], 99) is dt.Verdict.DENY
    assert verdict(agent, db.id, web.ips[0], 80) is dt.Verdict.ALLOW
    assert await agent.agent.manager.repair() == 0
    assert TCP == 6


def create_request(pod: str = "p", namespace: str = "x", **kw: object) -> datapath_pb2.CreateEndpointRequest:
    return datapath_pb2.CreateEndpointRequest(namespace=namespace, pod=pod, **kw)  # type: ignore[arg-type]


async def test_names_and_labels_are_checked_as_kubernetes_does_before_anything_is_taken(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None
    app = labels(app="a")
    cases = [
        (create_request("p" * 10_000, labels=app), "pod"),
        (create_request("web\n", labels=app), "pod"),
        (create_request("a_b", labels=app), "pod"),
        (create_request("p", "Shop_NS!", labels=app), "namespace"),
        (create_request("p", "a.*.>", labels=app), "namespace"),
        (create_request("p", "../../etc", labels=app), "namespace"),
        (create_request("p", "a b c", labels=app), "namespace"),
        (create_request("p", "n" * 64, labels=app), "namespace"),
        (create_request(labels=labels(**{"bad key": "v"})), "labels[0].key"),
        (create_request(labels=[common_pb2.Label(source="k8s", key="app\n", value="a")]), "labels[0].key"),
        (create_request(labels=[common_pb2.Label(source="k8s", key="a\0b", value="a")]), "labels[0].key"),
        (create_request(labels=labels(app="v" * 64)), "labels[0].value"),
        (create_request(labels=labels(app="x" * 1_000_000)), "labels[0].value"),  # a 1 MB label fails fast
        (create_request(labels=labels(**{"-bad.example.com/app": "a"})), "labels[0].key"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.stub.CreateEndpoint(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        details = err.value.details() or ""
        assert details.startswith(f"{field} ") and len(details) < 1000, details[:200]
    assert cp.identities == {} and cp.ips == {}, "nothing was allocated for a bad request"

    # Kubernetes accepts these, so the datapath does too.
    good = labels(**{"app.kubernetes.io/name": "a-b_c.d", "tier": ""})
    ep = await agent.stub.CreateEndpoint(create_request("p-1.v2", "team-a", labels=good))
    assert ep.state == datapath_pb2.ENDPOINT_STATE_READY
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.GetEndpoint(datapath_pb2.GetEndpointRequest(namespace="x", pod="q" * 10_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_namespace_that_already_holds_an_endpoint_is_refused_by_name(agent: InProcessAgent) -> None:
    assert agent.stub is not None
    web = await create(agent, "web", app="web")
    request = create_request("other", netns=web.netns, labels=labels(app="other"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.CreateEndpoint(request)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert (err.value.details() or "").startswith(f"netns: network namespace {web.netns} already holds endpoint")

    # A namespace someone else wired (it has a pod interface already): the precondition fails, by name.
    agent.network.namespaces.add("/run/netns/foreign")
    agent.network.pod_side["veth-foreign"] = "/run/netns/foreign"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.CreateEndpoint(create_request("other", netns="/run/netns/foreign", labels=labels(app="o")))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.value.details() or "").startswith("netns: cannot set up the network of x/other")
    assert "already has an interface eth0" in (err.value.details() or "")

    # A namespace left over under the name the datapath would create: the pod's name is in the way.
    agent.network.namespaces.add("/run/netns/pal_x_left")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.CreateEndpoint(create_request("left", labels=labels(app="l")))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.value.details() or "").startswith("pod: cannot set up the network of x/left")


async def test_create_honours_the_addresses_asked_for_or_refuses_them_by_field(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    assert agent.stub is not None
    app = labels(app="a")
    # In the node's pool: reserved exactly.
    inside = await agent.stub.CreateEndpoint(create_request("in", ips=["10.244.7.42"], labels=app))
    assert list(inside.ips) == ["10.244.7.42"] and cp.ips["10.244.7.42"] == "pod/x/in"
    # Outside it: only when the caller says so (a manifest's status.podIP), and then exactly that one.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.CreateEndpoint(create_request("out", ips=["10.0.1.1"], labels=app))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "10.0.1.1" in (err.value.details() or "") and "outside" in (err.value.details() or "")
    assert "pod/x/out" not in cp.ips.values() and "/run/netns/pal_x_out" not in agent.network.namespaces
    out = await agent.stub.CreateEndpoint(create_request("out", ips=["10.0.1.1"], outside_pool=True, labels=app))
    assert list(out.ips) == ["10.0.1.1"]
    # Taken by another pod: refused, nothing else changes.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.stub.CreateEndpoint(create_request("twin", ips=["10.0.1.1"], outside_pool=True, labels=app))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Malformed: INVALID_ARGUMENT naming the field, before anything is taken.
    for request, field in [
        (create_request("b", ips=["10.0.1"], labels=app), "ips[0] "),
        (create_request("b", ips=["10.0.1.2", "10.0.1.3"], labels=app), "ips[1] "),
        (create_request("b", ips=["127.0.0.1"], labels=app), "ips[0] "),
        (create_request("b", outside_pool=True, labels=app), "outside_pool: "),
        (create_request("b", ips=["fd00::5"], families=[ipam_pb2.FAMILY_IPV4], labels=app), "ips: "),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.stub.CreateEndpoint(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert (err.value.details() or "").startswith(field), err.value.details()
    assert sorted(cp.ips) == ["10.0.1.1", "10.244.7.42"]


async def test_no_endpoint_id_past_what_the_metrics_map_counts_is_handed_out(
    nats_server: NatsServer, cp: ControlPlane, tmp_path: Path
) -> None:
    # Room for the counters of endpoints 1 and 2 only (slot group 0 is the lost-events counter's).
    program = ProgramConfig(sizes=MapSizes(metrics=3 * metricsmap.SLOTS))
    runner = InProcessAgent(nats_server.url, cp, tmp_path, NODE, program=program)
    await runner.start()
    try:
        await runner.wait_synced()
        assert runner.stub is not None
        one = await create(runner, "one", app="one")
        two = await create(runner, "two", app="two")
        assert (one.id, two.id) == (1, 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await runner.stub.CreateEndpoint(create_request("three", labels=labels(app="three")))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == f"node {NODE} has 2 endpoints, the most its metrics map counts; delete one first"
        # The refusal took nothing, and the two endpoints keep working.
        assert set(cp.ips.values()) == {"pod/x/one", "pod/x/two"}
        listed = await runner.stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())
        assert [(e.id, e.state) for e in listed.endpoints] == [
            (1, datapath_pb2.ENDPOINT_STATE_READY),
            (2, datapath_pb2.ENDPOINT_STATE_READY),
        ]

        await runner.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(namespace="x", pod="one"))
        three = await create(runner, "three", app="three")
        assert three.id == 1
    finally:
        await runner.stop()
        FakeDatapath.open(runner.config.bpffs).teardown()


async def test_a_new_endpoint_reports_its_policy_without_waiting_for_an_order(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    """Orders applied before an endpoint existed did not report it: it reports once its map is written."""
    web = await create(agent, "web", app="web")
    rev = await cp.bump()
    await cp.wait_realized(rev, [web.id])
    db = await create(agent, "db", app="db")  # no order comes after it
    await cp.wait_realized(rev, [db.id])
    assert cp.realized[db.id] == (db.identity, rev)
