"""Malformed input at ipam's API edge: INVALID_ARGUMENT naming the field, with a short message."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from palisade.v1 import common_pb2, identity_pb2, ipam_pb2
from services.common.bus import Bus
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, creds
from testkit.ipam import Api, K8s, ipam_args


@pytest.fixture
async def api(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess]
) -> AsyncIterator[Api]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as bus:
        await bus.ensure_streams()
        await K8s(bus).synced()
        proc = service("ipam", *ipam_args(nats_server, etcd_server))
        yield Api(proc.address)


def _label(key: str, value: str = "x", source: str = "k8s") -> common_pb2.Label:
    return common_pb2.Label(source=source, key=key, value=value)


def _identity(*labels: common_pb2.Label, node: str = "node-a", owner: str = "pod/ns/p") -> object:
    return identity_pb2.AllocateIdentityRequest(labels=list(labels), node=node, owner=owner)


MALFORMED: list[tuple[str, str, object, str]] = [
    ("identity", "AllocateIdentity", _identity(_label("a b")), "labels[0].key"),
    ("identity", "AllocateIdentity", _identity(_label("a\nb")), "labels[0].key"),
    ("identity", "AllocateIdentity", _identity(_label("a\x00b")), "labels[0].key"),
    ("identity", "AllocateIdentity", _identity(_label("app"), _label("tier", "v" * 1_000_000)), "labels[1].value"),
    ("identity", "AllocateIdentity", _identity(_label("app"), node="a.*.>"), "node"),
    ("identity", "AllocateIdentity", _identity(_label("app"), owner="pod/ns/" + "x" * 10_000), "owner"),
    ("identity", "AllocateIdentity", _identity(_label("app"), owner="pod ns p"), "owner"),
    ("identity", "ReleaseIdentity", identity_pb2.ReleaseIdentityRequest(id=300, node="../../etc", owner="o"), "node"),
    ("identity", "ResolvePod", identity_pb2.ResolvePodRequest(namespace="Shop_NS!", name="a"), "namespace"),
    ("identity", "ResolvePod", identity_pb2.ResolvePodRequest(namespace="shop", name="a" * 100_000), "name"),
    ("identity", "ListIdentities", identity_pb2.ListIdentitiesRequest(selector=[_label("a b")]), "selector[0].key"),
    ("ipam", "AllocateIP", ipam_pb2.AllocateIPRequest(node="../../etc", owner="pod/ns/p"), "node"),
    ("ipam", "AllocateIP", ipam_pb2.AllocateIPRequest(node="node-a", owner="pod/ns/" + "p" * 10_000), "owner"),
    ("ipam", "ReleaseIP", ipam_pb2.ReleaseIPRequest(node="a b c", ip="10.0.0.1"), "node"),
    ("ipam", "GetNodeCIDR", ipam_pb2.GetNodeCIDRRequest(node="x" * 100_000), "node"),
    ("ipam", "ListAllocations", ipam_pb2.ListAllocationsRequest(node="Node_A"), "node"),
]


async def test_malformed_input_is_invalid_argument_naming_the_field(api: Api) -> None:
    for stub, method, request, field in MALFORMED:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(getattr(api, stub), method)(request, timeout=10)
        details = err.value.details() or ""
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field, err.value.code(), details[:300])
        assert details.startswith(f"{field} "), (method, details[:300])
        assert len(details) < 3000, (method, len(details))


async def test_requested_addresses_outside_the_pool_over_grpc(api: Api) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-a", owner="pod/x/a", ip="192.168.9.9"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside_pool" in (err.value.details() or "")
    got = await api.ipam.AllocateIP(
        ipam_pb2.AllocateIPRequest(node="node-a", owner="pod/x/a", ip="192.168.9.9", outside_pool=True)
    )
    assert (got.ip, got.node) == ("192.168.9.9", "node-a")
    listed = await api.ipam.ListAllocations(ipam_pb2.ListAllocationsRequest(node="node-a"))
    assert [(a.ip, a.owner) for a in listed.allocations] == [("192.168.9.9", "pod/x/a")]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await api.ipam.AllocateIP(
            ipam_pb2.AllocateIPRequest(node="node-b", owner="pod/x/b", ip="192.168.9.9", outside_pool=True)
        )
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "node-a" in (err.value.details() or "")
