"""The datapath service process with real BPF, namespaces and packets (root, bcc).

The control plane is the in-test :class:`ControlPlane` over real gRPC and NATS.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from palisade.v1 import common_pb2, datapath_pb2
from testkit.builders import policy_entry
from testkit.controlplane import ALLOW, ING, ControlPlane, control_plane
from testkit.harness import NatsServer, ServiceProcess, datapath_flags, health_status
from tests.datapath_service.helpers import create_endpoint, in_thread, started
from tests.datapath_service.pods import Pods

pytestmark = [pytest.mark.root, pytest.mark.bcc]

NODE = "node-a"


@pytest.fixture
async def cp(nats_server: NatsServer) -> AsyncIterator[ControlPlane]:
    async with control_plane(nats_server.url, NODE, cidr="10.251.3.0/24") as plane:
        yield plane


@pytest.fixture
def start_datapath(
    service: Callable[..., ServiceProcess], nats_server: NatsServer, cp: ControlPlane, tmp_path: Path, bpffs: str
) -> Callable[..., ServiceProcess]:
    def start(wait: bool = True) -> ServiceProcess:
        return service(
            "datapath",
            "--nats-url",
            nats_server.url,
            "--node-name",
            NODE,
            *datapath_flags(cp.policy_address, cp.ipam_address, tmp_path / "state", bpffs),
            "--retry-backoff-max",
            "0.5",
            "--log-level",
            "debug",
            wait=wait,
        )

    return start


async def test_policy_is_enforced_read_back_and_follows_a_relabel(
    start_datapath: Callable[[], ServiceProcess], cp: ControlPlane, pods: Pods
) -> None:
    proc, stub = await started(start_datapath)
    ns = pods.namespace
    web = await create_endpoint(stub, ns, "web", "web")
    db = await create_endpoint(stub, ns, "db", "db")
    other = await create_endpoint(stub, ns, "other", "other")
    pods.serve("db", 8080, 9090)
    db_ip = db.ips[0]

    rev = await cp.set_policy(db.identity, [policy_entry(ING, web.identity, 8080)])
    await cp.wait_realized(rev, [web.id, db.id, other.id])
    assert await in_thread(pods.connects, "web", db_ip, 8080)
    assert not await in_thread(pods.connects, "web", db_ip, 9090)
    assert not await in_thread(pods.connects, "other", db_ip, 8080)

    got = await stub.GetPolicyMap(datapath_pb2.GetPolicyMapRequest(endpoint=datapath_pb2.GetEndpointRequest(id=db.id)))
    assert [(e.key.direction, e.key.remote_identity, e.key.port_low, e.verdict) for e in got.entries] == [
        (ING, web.identity, 8080, ALLOW)
    ]
    assert got.enforcement.ingress and got.revision == rev

    # Relabel "other" to the labels of web: it gets web's identity, and with it web's access.
    moved = await stub.UpdateEndpoint(
        datapath_pb2.UpdateEndpointRequest(
            endpoint=datapath_pb2.GetEndpointRequest(id=other.id),
            labels=[common_pb2.Label(source="k8s", key="app", value="web")],
        )
    )
    assert moved.identity == web.identity
    assert await in_thread(pods.connects, "other", db_ip, 8080)

    # Delete leaves the others enforcing.
    await stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=web.id))
    assert not await asyncio.to_thread(os.path.exists, f"/run/netns/{pods.netns('web')}")
    assert not await in_thread(pods.connects, "other", db_ip, 9090)
    assert await in_thread(pods.connects, "other", db_ip, 8080)
    assert proc.terminate() == 0, proc.logs()[-3000:]


async def test_kill_9_keeps_enforcing_and_restart_restores_and_catches_up(
    start_datapath: Callable[[], ServiceProcess], cp: ControlPlane, pods: Pods
) -> None:
    proc, stub = await started(start_datapath)
    ns = pods.namespace
    eps = {name: await create_endpoint(stub, ns, name, name) for name in ("a", "b", "c", "d")}
    a, b, c, d = (eps[n] for n in "abcd")
    sink = pods.serve("b", 8080)
    pods.serve("d", 8080, 9090, 7070)
    await cp.set_policy(b.identity, [policy_entry(ING, a.identity, 8080)])
    rev = await cp.set_policy(d.identity, [policy_entry(ING, c.identity, 8080)])
    await cp.wait_realized(rev, [e.id for e in eps.values()])

    seconds = 14
    stream = pods.spawn("a", "stream", b.ips[0], "8080", str(seconds))
    probe = pods.spawn("c", "probe", d.ips[0], "8080", "9090", str(seconds))
    assert stream.stdout is not None and stream.stdout.readline().strip() == "connected"
    await asyncio.sleep(2)

    proc.kill()  # kill -9: no cleanup at all
    await asyncio.sleep(2)
    # While it is down: a policy change (its order is published, nobody is listening).
    rev_down = await cp.set_policy(
        d.identity, [policy_entry(ING, c.identity, 8080), policy_entry(ING, c.identity, 7070)]
    )
    await asyncio.sleep(2)
    proc, stub = await started(start_datapath)
    await cp.wait_realized(rev_down, [e.id for e in eps.values()])

    stream_out = await asyncio.to_thread(stream.communicate, None, seconds + 30)
    probe_out = await asyncio.to_thread(probe.communicate, None, seconds + 30)
    assert stream.returncode == 0, stream_out
    rounds = [line.split() for line in probe_out[0].splitlines() if line.strip()]
    assert len(rounds) == seconds
    assert all(r[1] == "1" for r in rounds), f"an allowed probe failed: {rounds}"
    assert all(r[2] == "0" for r in rounds), f"a denied probe got through: {rounds}"

    # Every endpoint came back with its id and address, at the current revision.
    listed = await stub.ListEndpoints(datapath_pb2.ListEndpointsRequest())
    assert {(e.id, e.pod, tuple(e.ips)) for e in listed.endpoints} == {
        (e.id, e.pod, tuple(e.ips)) for e in eps.values()
    }
    assert all(e.realized_revision >= rev_down for e in listed.endpoints)
    # The change made while the datapath was down is enforced.
    assert await in_thread(pods.connects, "c", d.ips[0], 7070)
    assert not await in_thread(pods.connects, "a", d.ips[0], 7070)

    # Not one packet of the stream was dropped: no drop counted for a or b.
    for ep in (a, b):
        got = await stub.GetEndpoint(datapath_pb2.GetEndpointRequest(id=ep.id))
        drops = {k: v for k, v in got.counters.items() if "deny" in k}
        assert drops == {}, (ep.pod, dict(got.counters))
    # ...while the denied probes to d were counted as drops the whole time.
    got = await stub.GetEndpoint(datapath_pb2.GetEndpointRequest(id=d.id))
    assert sum(v for k, v in got.counters.items() if "deny" in k) >= seconds
    sink.kill()
    assert proc.terminate() == 0, proc.logs()[-3000:]


async def test_not_serving_until_the_first_resync_put_the_policy_on_the_endpoints(
    start_datapath: Callable[..., ServiceProcess], cp: ControlPlane
) -> None:
    cp.refuse_resync = True
    proc = await asyncio.to_thread(start_datapath, False)
    # It answers, and has tried to resync more than once, yet says NOT_SERVING: it is not synced.
    async with asyncio.timeout(60):
        while len(cp.resyncs) < 3 or await asyncio.to_thread(health_status, proc.address, proc.name) == -1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # resync attempts and the port are observed from outside: no event to wait on
    assert await asyncio.to_thread(health_status, proc.address, proc.name) == health_pb2.HealthCheckResponse.NOT_SERVING
    cp.refuse_resync = False
    await asyncio.to_thread(proc.wait_serving)
    assert proc.terminate() == 0, proc.logs()[-3000:]
