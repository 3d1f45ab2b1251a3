"""The datapath's side of the DNS proxy: name rules from orders and resyncs, published with the
endpoints (dns-endpoints.json) and their steering entries, over the in-memory BPF fake."""

from __future__ import annotations

from palisade.v1 import common_pb2
from services.datapath import types as dt
from services.datapath.dnsnames import NameSource
from testkit.builders import policy_entry as entry
from testkit.controlplane import ControlPlane
from tests.datapath_service.agent import InProcessAgent
from tests.datapath_service.helpers import create, eventually

EGR = common_pb2.DIRECTION_EGRESS
FQDN = common_pb2.FqdnRule(
    selector="*.example.test", protocol=common_pb2.PROTOCOL_TCP, port_low=443, verdict=common_pb2.VERDICT_ALLOW
)
DNS = common_pb2.DnsRule(remote_identity=0, protocol=common_pb2.PROTOCOL_ANY, port=53, selectors=["*.example.test"])


async def test_name_rules_published_and_steered(agent: InProcessAgent, cp: ControlPlane) -> None:
    web = await create(agent, "web", app="web")
    await create(agent, "db", app="db")
    source = NameSource(agent.config.state_dir)
    world_443 = entry(EGR, dt.IDENTITY_WORLD, 443)
    rev = await cp.set_policy(web.identity, [world_443], ingress=False, egress=True)
    rev = await cp.set_names(web.identity, [FQDN], [DNS])
    await cp.wait_realized(rev, [web.id])

    published = {ep.ep_id: ep for ep in source.read_if_changed() or []}
    assert list(published) == [web.id], "only endpoints with name rules or world/CIDR entries"
    got = published[web.id]
    assert got.rules.fqdn == (dt.FqdnRule("*.example.test", dt.L4Proto.TCP, 443),)
    assert got.rules.dns == (dt.DnsRule(0, dt.L4Proto.ANY, 53, ("*.example.test",)),)
    assert [e.key.remote_identity for e in got.aliased] == [dt.IDENTITY_WORLD]
    assert agent.datapath is not None
    port = agent.config.dns_proxy_port
    assert agent.datapath.dns_steer_dump() == {(web.id, 53, 17): port, (web.id, 53, 6): port}

    # An order that changes entries only keeps the rules; one without names removes the steering.
    rev = await cp.set_policy(web.identity, [], ingress=False, egress=True)
    await cp.wait_realized(rev, [web.id])
    assert agent.datapath.dns_steer_dump() == {(web.id, 53, 17): port, (web.id, 53, 6): port}
    rev = await cp.set_names(web.identity, [], [])
    await cp.wait_realized(rev, [web.id])
    assert agent.datapath.dns_steer_dump() == {}
    assert source.read_if_changed() == []


async def test_name_rules_come_back_with_a_restart(agent: InProcessAgent, cp: ControlPlane) -> None:
    web = await create(agent, "web", app="web")
    rev = await cp.set_names(web.identity, [FQDN], [DNS])
    await cp.wait_realized(rev, [web.id])
    source = NameSource(agent.config.state_dir)
    before = source.read_if_changed()
    await agent.stop()
    started = await agent.start()
    # Until the resync is in, the restored endpoint's rules are unknown: nothing is published.
    assert source.read_if_changed() is None or started.manager.realizer.synced
    await eventually(lambda: started.manager.realizer.synced)
    await eventually(lambda: bool(NameSource(agent.config.state_dir).read_if_changed()))
    assert NameSource(agent.config.state_dir).read_if_changed() == before
    assert agent.datapath is not None and len(agent.datapath.dns_steer_dump()) == 2
