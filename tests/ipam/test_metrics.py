"""ipam's Prometheus metrics, scraped over HTTP from the service process after real allocations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from palisade.v1 import common_pb2, identity_pb2, ipam_pb2
from services.common.bus import Bus
from testkit.harness import EtcdServer, Metrics, NatsServer, ServiceProcess, creds
from testkit.ipam import Api, K8s, eventually, ipam_args, namespace, pod


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_streams()
        yield b


def label(key: str, value: str = "", source: str = "k8s") -> common_pb2.Label:
    return common_pb2.Label(source=source, key=key, value=value)


async def test_identity_and_address_metrics_follow_allocations(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    k8s = K8s(bus)
    await k8s.apply(namespace("shop"))
    await k8s.apply(pod("shop", "cart", {"app": "cart"}, ip="10.244.0.10"))
    await k8s.synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(proc.address)

    # The bus pod's identity was allocated by ipam itself; everything else starts at zero.
    m = await eventually(lambda: (m := proc.metrics()).get("palisade_ipam_identities", kind="cluster") == 1 and m)
    assert m.get("palisade_ipam_identity_allocations_total", kind="cluster", result="created") == 1
    assert m.get("palisade_ipam_identities", kind="cidr") == 0
    assert m.get("palisade_ipam_identity_releases_total") == 0
    assert m.get("palisade_ipam_allocation_seconds_count") == 0
    assert m.series("palisade_ipam_ip_allocations") == {}

    # Identities over the API: one new cluster identity held twice, one CIDR identity.
    async def allocate(owner: str, *labels: common_pb2.Label) -> identity_pb2.AllocateIdentityResponse:
        request = identity_pb2.AllocateIdentityRequest(labels=list(labels), node="node-a", owner=owner)
        response: identity_pb2.AllocateIdentityResponse = await api.identity.AllocateIdentity(request, timeout=5)
        return response

    web_a = await allocate("pod/x/a", label("app", "web"))
    web_b = await allocate("pod/x/b", label("app", "web"))
    net = await allocate("cidr/ext", label("10.0.0.0/8", source="cidr"))
    assert web_a.new and not web_b.new and web_a.identity.id == web_b.identity.id and net.new
    assert await api.code(api.identity.AllocateIdentity(identity_pb2.AllocateIdentityRequest(), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )

    # Addresses: three on node-a, one on node-b, then one of node-a released; two refused.
    ips = []
    for node, owner in (("node-a", "pod/x/a"), ("node-a", "pod/x/b"), ("node-a", "pod/x/c"), ("node-b", "pod/x/d")):
        alloc = await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node=node, owner=owner), timeout=5)
        ips.append(alloc.ip)
    await api.ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node="node-a", ip=ips[2]), timeout=5)
    refused_owner = api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-a", owner=""), timeout=5)
    assert await api.code(refused_owner) == grpc.StatusCode.INVALID_ARGUMENT
    twice = api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-a", owner="pod/x/a"), timeout=5)
    assert await api.code(twice) == grpc.StatusCode.ALREADY_EXISTS

    m = proc.metrics()
    # Every transaction went to etcd in some request (alone or batched with others).
    batches, transactions = m.get("palisade_ipam_etcd_batches_total"), m.get("palisade_ipam_etcd_transactions_total")
    assert 0 < batches <= transactions
    assert m.get("palisade_ipam_identities", kind="cluster") == 2
    assert m.get("palisade_ipam_identities", kind="cidr") == 1
    assert m.get("palisade_ipam_identity_allocations_total", kind="cluster", result="created") == 2
    assert m.get("palisade_ipam_identity_allocations_total", kind="cluster", result="existing") == 1
    assert m.get("palisade_ipam_identity_allocations_total", kind="cidr", result="created") == 1
    assert m.series("palisade_ipam_ip_allocations") == {(("node", "node-a"),): 2, (("node", "node-b"),): 1}
    errors = m.series("palisade_ipam_allocation_errors_total")
    assert errors == {
        (("code", "INVALID_ARGUMENT"), ("method", "AllocateIdentity")): 1,
        (("code", "INVALID_ARGUMENT"), ("method", "AllocateIP")): 1,
        (("code", "ALREADY_EXISTS"), ("method", "AllocateIP")): 1,
    }
    # Every call is timed, the refused ones included; other methods are not.
    assert m.get("palisade_ipam_allocation_seconds_count", method="AllocateIdentity") == 4
    assert m.get("palisade_ipam_allocation_seconds_count", method="AllocateIP") == 6
    assert m.series("palisade_ipam_allocation_seconds_count").keys() == {
        (("method", "AllocateIdentity"),),
        (("method", "AllocateIP"),),
    }
    assert 0 < m.get("palisade_ipam_allocation_seconds_sum") < 10
    assert m.get("palisade_ipam_allocation_seconds_bucket", method="AllocateIP", le="+Inf") == 6

    # Released identities are collected after the grace period (1 s here).
    for owner, ident in (("pod/x/a", web_a), ("pod/x/b", web_b), ("cidr/ext", net)):
        request = identity_pb2.ReleaseIdentityRequest(id=ident.identity.id, node="node-a", owner=owner)
        await api.identity.ReleaseIdentity(request, timeout=5)
    m = proc.metrics()
    assert m.get("palisade_ipam_identity_releases_total", kind="cluster") == 2
    assert m.get("palisade_ipam_identity_releases_total", kind="cidr") == 1

    def collected() -> Metrics | None:
        m = proc.metrics()
        return m if m.get("palisade_ipam_identities_collected_total") == 2 else None

    m = await eventually(collected)
    assert m.get("palisade_ipam_identities_collected_total", kind="cluster") == 1
    assert m.get("palisade_ipam_identities_collected_total", kind="cidr") == 1
    assert m.get("palisade_ipam_identities", kind="cluster") == 1  # the bus pod's
    assert m.get("palisade_ipam_identities", kind="cidr") == 0
    assert proc.terminate() == 0
