"""The datapath's Prometheus metrics.

The service process with real BPF, namespaces and packets is scraped over HTTP (root,
bcc); the agent over the in-memory fake checks, without root, what real packets are
too slow or rare for: lost flow events and counters of deleted endpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from palisade.v1 import datapath_pb2
from services.common.bus import Bus
from services.datapath import types as dt
from services.datapath.fake import FakeDatapath
from services.datapath.flows import FlowFilter
from services.datapath.metrics import AgentParts, DatapathMetrics, KernelTotals
from testkit.builders import policy_entry
from testkit.controlplane import ING, ControlPlane, control_plane
from testkit.harness import Metrics, NatsServer, ServiceProcess, creds, datapath_flags, scrape
from tests.datapath_service.agent import InProcessAgent
from tests.datapath_service.helpers import create as create_fake
from tests.datapath_service.helpers import create_endpoint, eventually, in_thread, started
from tests.datapath_service.pods import Pods

NODE = "node-a"


@pytest.fixture
async def cp(nats_server: NatsServer) -> AsyncIterator[ControlPlane]:
    async with control_plane(nats_server.url, NODE, cidr="10.251.4.0/24") as plane:
        yield plane


async def until(proc: ServiceProcess, check: Callable[[Metrics], bool], timeout: float = 10.0) -> Metrics:
    """Scrape until ``check`` holds (kernel counters are read at most once a second)."""
    async with asyncio.timeout(timeout):
        while True:
            m = await asyncio.to_thread(proc.metrics)
            if check(m):
                return m
            await asyncio.sleep(0.2)


@pytest.mark.root
@pytest.mark.bcc
async def test_service_metrics_follow_endpoints_orders_and_packets(
    service: Callable[..., ServiceProcess],
    nats_server: NatsServer,
    cp: ControlPlane,
    tmp_path: Path,
    bpffs: str,
    pods: Pods,
) -> None:
    def start() -> ServiceProcess:
        return service(
            "datapath",
            *("--nats-url", nats_server.url, "--node-name", NODE),
            *datapath_flags(cp.policy_address, cp.ipam_address, tmp_path / "state", bpffs),
            *("--retry-backoff-max", "0.5"),
        )

    proc, stub = await started(start)
    m = await asyncio.to_thread(proc.metrics)
    assert m.series("palisade_datapath_endpoints") == {
        (("state", s),): 0.0 for s in ("waiting", "ready", "regenerating", "restoring", "failed")
    }
    assert m.get("palisade_datapath_resyncs_total") == 1  # the startup resync
    assert m.get("palisade_datapath_orders_applied_total") == 0
    assert m.get("palisade_datapath_forwarded_packets_total") == 0
    assert m.get("palisade_datapath_dropped_packets_total") == 0

    ns = pods.namespace
    web = await create_endpoint(stub, ns, "web", "web")
    db = await create_endpoint(stub, ns, "db", "db")
    pods.serve("db", 8080, 9090)
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 8080)])
    await cp.wait_realized(rev, [web.id, db.id])
    assert await in_thread(pods.connects, "web", db.ips[0], 8080)
    assert not await in_thread(pods.connects, "web", db.ips[0], 9090, 0.5)

    def counted(m: Metrics) -> bool:
        return bool(
            m.get("palisade_datapath_forwarded_packets_total", reason="policy-allow", direction="ingress")
            and m.get("palisade_datapath_dropped_packets_total", direction="ingress")
        )

    m = await until(proc, counted)
    assert m.get("palisade_datapath_endpoints", state="ready") == 2
    assert m.get("palisade_datapath_endpoints") == 2
    assert m.get("palisade_datapath_realized_revision") == rev
    assert m.get("palisade_datapath_orders_applied_total", form="diff") == 1
    assert m.get("palisade_datapath_realized_reports_total") >= 2  # web and db at rev
    # The order's arrival to its report, once.
    assert m.get("palisade_datapath_order_realized_seconds_count") == 1
    assert 0 < m.get("palisade_datapath_order_realized_seconds_sum") < 10
    # The connection to 8080: its SYN by policy, the rest as established; the SYNs to 9090 dropped.
    assert m.get("palisade_datapath_forwarded_packets_total", reason="established") >= 2
    assert m.get("palisade_datapath_dropped_packets_total", reason="default-deny", direction="ingress") >= 1
    assert m.get("palisade_datapath_dropped_packets_total", reason="policy-allow") == 0  # no such series
    assert m.get("palisade_datapath_forwarded_bytes_total") >= 40 * m.get("palisade_datapath_forwarded_packets_total")
    assert m.get("palisade_datapath_flow_events_total") >= 1
    assert m.get("palisade_datapath_flow_events_lost_total", stage="ring_buffer") == 0
    # web's address was IPAM's choice (the node had not learnt its CIDR yet); db's picked here.
    assert m.get("palisade_datapath_address_picks_total", outcome="recorded") == 1
    assert m.get("palisade_datapath_address_picks_total", outcome="refused") == 0

    # An order lost in transit: the next one shows the gap, which a resync repairs.
    await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 8081)], publish=False)
    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 8082)])
    await cp.wait_realized(rev, [web.id, db.id])
    m = await until(proc, lambda m: m.get("palisade_datapath_realized_revision") == rev)
    assert m.get("palisade_datapath_sequence_gaps_total") == 1
    assert m.get("palisade_datapath_resyncs_total") == 2

    # Deleting web deletes its kernel counters; the node's totals keep what it counted.
    got = await stub.GetEndpoint(datapath_pb2.GetEndpointRequest(id=web.id))
    assert got.counters["egress/not-enforced"] > 0
    before = m
    await stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=web.id))
    await asyncio.sleep(1.2)
    after = await asyncio.to_thread(proc.metrics)
    assert after.get("palisade_datapath_endpoints", state="ready") == 1
    for name in ("forwarded_packets", "forwarded_bytes", "dropped_packets", "dropped_bytes"):
        old, new = before.series(f"palisade_datapath_{name}_total"), after.series(f"palisade_datapath_{name}_total")
        assert old.keys() == new.keys() and all(new[k] >= v for k, v in old.items()), name
    assert proc.terminate() == 0, proc.logs()[-3000:]


# --- without root: the agent over the in-memory datapath ----------------------------------------


@pytest.fixture
async def agent(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[tuple[InProcessAgent, ControlPlane]]:
    bus = await Bus.connect([nats_server.url], name="control-plane", tls=creds())
    plane = ControlPlane(bus, NODE)  # type: ignore[abstract]
    await plane.start()
    runner = InProcessAgent(nats_server.url, plane, tmp_path, NODE)
    runner.config = dataclasses.replace(runner.config, observe_buffer=2)
    await runner.start()
    await runner.wait_synced()
    yield runner, plane
    await runner.stop()
    FakeDatapath.open(runner.config.bpffs).teardown()
    await plane.stop()
    await bus.close()


async def test_agent_metrics_keep_deleted_endpoints_counts_and_count_lost_events(
    agent: tuple[InProcessAgent, ControlPlane],
) -> None:
    runner, cp = agent
    assert runner.agent is not None and runner.datapath is not None and runner.stub is not None
    a = runner.agent
    registry = CollectorRegistry()
    DatapathMetrics(AgentParts(a.manager, a.consumer, a.reporter, a.flows, runner.datapath), registry, min_interval=0)
    # Served over HTTP like the service's registry.
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        web = await create_fake(runner, "web", app="web")
        db = await create_fake(runner, "db", app="db")
        rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 80)])
        await cp.wait_realized(rev, [web.id, db.id])
        await eventually(lambda: registry.get_sample_value("palisade_datapath_order_realized_seconds_count") == 1)

        for port in (80, 80, 81, 81, 81):
            runner.datapath.simulate_flow(db.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, port)
        await eventually(lambda: a.flows.events == 5)
        # A slow Observe client: 5 events at once into a buffer of 2 lose 3.
        stream = a.flows.stream(FlowFilter(), limit=1)
        waiting = asyncio.ensure_future(anext(stream))
        await eventually(lambda: a.flows.subscribers == 1)
        for _ in range(5):
            a.flows.publish(datapath_pb2.FlowEvent(node=NODE))
        await waiting
        assert await anext(stream, None) is None  # its limit was 1: it leaves
        assert a.flows.subscribers == 0

        m = await asyncio.to_thread(scrape, server.server_port)
        assert m.get("palisade_datapath_flow_events_total") == 10
        assert m.get("palisade_datapath_flow_events_lost_total", stage="observer") == 3
        # Every flow counted per verdict, reason and direction, observed or not (the ring records them).
        assert m.get("palisade_datapath_flows_total", verdict="allow", reason="policy_allow", direction="ingress") == 2
        assert m.get("palisade_datapath_flows_total", verdict="deny", reason="default_deny", direction="ingress") == 3
        assert m.get("palisade_datapath_flow_ring_events") == 10
        assert m.get("palisade_datapath_forwarded_packets_total", reason="policy-allow", direction="ingress") == 2
        assert m.get("palisade_datapath_dropped_packets_total", reason="default-deny", direction="ingress") == 3

        # db goes, and its counters from the kernel with it; a new endpoint takes its id.
        await runner.stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=db.id))
        again = await create_fake(runner, "db2", app="db")
        assert again.id == db.id
        runner.datapath.simulate_flow(again.id, dt.Direction.INGRESS, web.ips[0], dt.L4Proto.TCP, 80)
        assert runner.datapath.counters().packets() == 1
        m = await asyncio.to_thread(scrape, server.server_port)
        assert m.get("palisade_datapath_forwarded_packets_total", reason="policy-allow") == 3
        assert m.get("palisade_datapath_dropped_packets_total", reason="default-deny") == 3
        assert m.get("palisade_datapath_endpoints", state="ready") == 2
    finally:
        server.shutdown()
        thread.join(5)


def test_kernel_totals_never_go_down() -> None:
    def counters(**packets: int) -> dt.Counters:
        values = {}
        for name, n in packets.items():
            ep = int(name[1:])
            values[dt.CounterKey(ep, dt.Reason.POLICY_ALLOW, dt.Direction.INGRESS)] = dt.CounterValue(n, 100 * n)
        return dt.Counters(values=values, events_lost=0)

    totals = KernelTotals()
    key = (dt.Reason.POLICY_ALLOW, dt.Direction.INGRESS)
    for step, expected in (
        (counters(e1=5, e2=3), 8),
        (counters(e1=7), 10),  # e2 went with 3
        (counters(e1=7, e2=1), 11),  # a new e2
        (counters(e1=2, e2=4), 16),  # e1's id reused by a new endpoint (a lower count), e2 grew
    ):
        totals.update(step)
        assert totals.totals()[key] == dt.CounterValue(expected, 100 * expected)
