"""Services and EndpointSlices into load-balancer frontends: the rules, and the sync over real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from services.common.bus import K8S_STREAM, Bus
from services.datapath.fake import FakeDatapath
from services.datapath.k8sservices import frontends, parse_service, parse_slice
from services.datapath.servicesync import ServiceSync
from services.datapath.types import Backend, Frontend, L4Proto, LbService
from testkit.harness import NatsServer, creds
from testkit.ipam import K8s

NODE = "node-a"


def service(name: str = "web", ns: str = "prod", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"}],
    }
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": body}


def endpoint(ip: str, node: str = NODE, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [ip], "nodeName": node, "conditions": dict(conditions)}


def endpoint_slice(
    name: str, endpoints: list[dict[str, Any]], port: int = 8080, svc: str = "web", ns: str = "prod", **extra: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": extra.get("address_type", "IPv4"),
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def lb(svc: dict[str, Any], slices: list[dict[str, Any]], node: str = NODE) -> dict[Frontend, tuple[Backend, ...]]:
    result = frontends(parse_service(svc), [parse_slice(s) for s in slices], node)
    return {s.frontend: s.backends for s in result.services}


WEB = Frontend("10.96.0.10", 80, L4Proto.TCP)


@pytest.mark.parametrize(
    ("conditions", "serves"),
    [
        ({}, True),  # absent conditions: ready, not terminating
        ({"ready": True}, True),
        ({"ready": False}, False),
        ({"ready": True, "terminating": True}, False),
        ({"serving": True, "terminating": True}, False),
    ],
)
def test_only_ready_non_terminating_endpoints_serve(conditions: dict[str, bool], serves: bool) -> None:
    got = lb(service(), [endpoint_slice("web-1", [endpoint("10.0.0.1", NODE, **conditions)])])
    assert got[WEB] == ((Backend("10.0.0.1", 8080),) if serves else ())


def test_a_named_target_port_resolves_per_backend_pod() -> None:
    # The slice controller groups pods by the port number the name resolves to in each pod.
    slices = [
        endpoint_slice("web-a", [endpoint("10.0.0.1")], port=8080),
        endpoint_slice("web-b", [endpoint("10.0.0.2")], port=9090),
    ]
    assert lb(service(), slices)[WEB] == (Backend("10.0.0.1", 8080), Backend("10.0.0.2", 9090))


def test_frontends_per_cluster_ip_family_and_port() -> None:
    svc = service(
        clusterIPs=["10.96.0.10", "fd00::10"],
        ports=[
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "sig", "port": 2905, "protocol": "SCTP"},
            {"name": "gre", "port": 1, "protocol": "GRE"},
        ],
    )
    v4 = endpoint_slice("web-4", [endpoint("10.0.0.1")])
    v4["ports"].append({"name": "dns", "port": 5353, "protocol": "UDP"})
    v4["ports"].append({"name": "sig", "port": 3905, "protocol": "SCTP"})
    v6 = endpoint_slice("web-6", [endpoint("fd10::1")], address_type="IPv6")
    got = lb(svc, [v4, v6])
    assert got == {
        WEB: (Backend("10.0.0.1", 8080),),
        Frontend("10.96.0.10", 53, L4Proto.UDP): (Backend("10.0.0.1", 5353),),
        Frontend("10.96.0.10", 2905, L4Proto.SCTP): (Backend("10.0.0.1", 3905),),
        Frontend("fd00::10", 80, L4Proto.TCP): (Backend("fd10::1", 8080),),
        Frontend("fd00::10", 53, L4Proto.UDP): (),
        Frontend("fd00::10", 2905, L4Proto.SCTP): (),
    }
    # A protocol Kubernetes does not have is reported, never silently dropped.
    assert frontends(parse_service(svc), [], NODE).skipped == ("prod/web port 1/GRE: GRE is not load-balanced",)


def test_headless_and_external_name_services_have_no_frontend() -> None:
    assert lb(service(clusterIP="None"), []) == {}
    assert lb(service(type="ExternalName", externalName="example.com", clusterIP=""), []) == {}


def test_internal_traffic_policy_local_keeps_this_nodes_backends() -> None:
    slices = [endpoint_slice("web-1", [endpoint("10.0.0.1", node=NODE), endpoint("10.0.1.1", node="node-b")])]
    assert lb(service(internalTrafficPolicy="Local"), slices)[WEB] == (Backend("10.0.0.1", 8080),)
    assert lb(service(internalTrafficPolicy="Local"), slices, node="node-c")[WEB] == ()
    assert len(lb(service(), slices)[WEB]) == 2


def test_client_ip_affinity_timeout() -> None:
    assert parse_service(service(sessionAffinity="ClientIP")).affinity_timeout == 10800
    configured = service(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})
    assert parse_service(configured).affinity_timeout == 60
    assert parse_service(service()).affinity_timeout == 0


def test_slices_of_another_service_or_namespace_are_not_backends() -> None:
    slices = [
        endpoint_slice("db-1", [endpoint("10.0.0.9")], svc="db"),
        endpoint_slice("web-1", [endpoint("10.0.0.8")], ns="dev"),
    ]
    assert lb(service(), slices)[WEB] == ()


# -- the sync, on real NATS -------------------------------------------------------------


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_stream(K8S_STREAM)
        yield b


async def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def held(dp: FakeDatapath) -> dict[Frontend, tuple[int, list[Backend]]]:
    return {s.frontend: (s.id, sorted(s.backends.values())) for s in dp.lb_services()}


async def test_a_restart_keeps_ids_removes_what_disappeared_and_follows_changes(bus: Bus, tmp_path: Any) -> None:
    dp = FakeDatapath.open(str(tmp_path / "bpf"))
    # What the previous run left pinned: web (still a Service) and gone (deleted while down).
    kept = dp.lb_upsert(LbService(WEB, (Backend("10.0.0.1", 8080),)))
    stale = Frontend("10.96.0.99", 80, L4Proto.TCP)
    dp.lb_upsert(LbService(stale, (Backend("10.0.0.5", 80),)))
    k8s = K8s(bus)
    await k8s.apply(service())
    await k8s.apply(endpoint_slice("web-1", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))

    sync = ServiceSync(dp, NODE)
    await sync.start(bus)
    runner = asyncio.create_task(sync.run())
    try:
        assert held(dp) == {WEB: (kept.id, [Backend("10.0.0.1", 8080), Backend("10.0.0.2", 8080)])}
        (state,) = dp.lb_services()
        assert {i for i, b in state.backends.items() if b == Backend("10.0.0.1", 8080)} == set(kept.backends)

        # A backend goes away (its pod is terminating), then comes back ready.
        await k8s.apply(endpoint_slice("web-1", [endpoint("10.0.0.1"), endpoint("10.0.0.2", terminating=True)]))
        await eventually(lambda: held(dp)[WEB][1] == [Backend("10.0.0.1", 8080)], "backend removed")
        # A second Service, then the first deleted: its frontend goes, the other stays.
        await k8s.apply(service("db", clusterIP="10.96.0.20"))
        await eventually(lambda: Frontend("10.96.0.20", 80, L4Proto.TCP) in held(dp), "db frontend")
        await k8s.delete(service())
        # What is served is recorded once the Service's writes are done (after the maps change).
        await eventually(lambda: [(s.namespace, s.name) for s in sync.served()] == [("prod", "db")], "web gone")
        assert WEB not in held(dp)
        served = sync.served()
        assert [(s.namespace, s.name, s.port_name) for s in served] == [("prod", "db", "http")]
        assert served[0].state.backends == {}  # no slices: connections are refused
    finally:
        runner.cancel()
        await sync.stop()
        dp.close()
