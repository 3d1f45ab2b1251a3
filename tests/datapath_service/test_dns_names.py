"""The datapath's side of the DNS proxy: name rules from orders and resyncs, published with the
endpoints (dns-endpoints.json) and their steering entries, over the in-memory BPF fake."""

from __future__ import annotations

from pathlib import Path

from palisade.v1 import common_pb2
from services.datapath import types as dt
from services.datapath.dnsnames import FILE, NameSource, decode
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

    first = source.read_if_changed()
    assert first is not None
    published = {ep.ep_id: ep for ep in first.endpoints}
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
    last = source.read_if_changed()
    assert last is not None and last.endpoints == []


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


async def test_cidr_prefixes_published_as_the_ipcache_gains_and_loses_them(
    agent: InProcessAgent, cp: ControlPlane
) -> None:
    """The proxy's learned addresses keep what the CIDR prefix holding them allowed; the datapath
    publishes the ipcache's CIDR prefixes (ipam's CIDR identities, not pods') as they change."""
    web = await create(agent, "web", app="web")
    rev = await cp.set_names(web.identity, [FQDN], [DNS])
    await cp.wait_realized(rev, [web.id])
    path = Path(agent.config.state_dir) / FILE
    cidr = dt.MIN_CIDR_IDENTITY + 9

    def published() -> dict[str, int]:
        return decode(path.read_text()).prefixes

    assert published() == {}
    await cp.publish_ipcache("198.51.100.0/24", cidr)
    await cp.publish_ipcache("10.99.0.7/32", 300)  # a pod elsewhere: not a CIDR prefix
    await eventually(lambda: published() == {"198.51.100.0/24": cidr})
    await cp.publish_ipcache("198.51.100.0/24", 0, deleted=True)
    await eventually(lambda: published() == {})
    assert agent.datapath is not None and agent.datapath.ipcache_lookup("198.51.100.1") is None
