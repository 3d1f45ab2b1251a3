"""CIDR identities held by the policy service: ipcache entries, precedence, release, collection.

Real NATS, etcd and the ipam service; the policy service's calls are made here with its certificate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc
from services.common.bus import Bus
from services.common.labels import CIDR_HOLDER_NODE, cidr_identity_labels, cidr_owner
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, channel, creds
from testkit.ipam import Api, BusView, K8s, eventually, ipam_args, pod


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_streams()
        yield b


class PolicyHolder:
    """IdentityService as the policy service calls it (its certificate, its pseudo-node)."""

    def __init__(self, address: str) -> None:
        self.stub = identity_pb2_grpc.IdentityServiceStub(channel(address, "ipam", "policy"))

    async def take(self, prefix: str, *, node: str = CIDR_HOLDER_NODE) -> int:
        labels = [common_pb2.Label(source=x.source, key=x.key, value=x.value) for x in cidr_identity_labels(prefix)]
        request = identity_pb2.AllocateIdentityRequest(labels=labels, node=node, owner=cidr_owner(prefix))
        response = await self.stub.AllocateIdentity(request, timeout=5)
        assert response.identity.kind == identity_pb2.IDENTITY_KIND_CIDR
        assert response.identity.cidr == prefix
        return int(response.identity.id)

    async def drop(self, identity: int, prefix: str) -> None:
        request = identity_pb2.ReleaseIdentityRequest(id=identity, node=CIDR_HOLDER_NODE, owner=cidr_owner(prefix))
        await self.stub.ReleaseIdentity(request, timeout=5)


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    raise AssertionError("the call succeeded; an error was expected")


def _is(view: BusView, prefix: str, identity: int) -> bool:
    entry = view.entry(prefix)
    return entry is not None and entry.identity == identity


async def test_a_held_cidr_identity_has_an_ipcache_entry_until_released_and_is_then_collected(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    view = await BusView.start(bus)
    k8s = K8s(bus)
    await k8s.synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    policy = PolicyHolder(proc.address)

    outside = await policy.take("198.51.100.10/32")
    wide = await policy.take("198.51.100.0/24")
    assert outside != wide
    assert await policy.take("198.51.100.10/32") == outside, "taking it again is the same reference"
    entry = await eventually(lambda: view.entry("198.51.100.10/32"))
    assert (entry.identity, entry.node, entry.namespace, entry.pod) == (outside, "", "", "")
    await eventually(lambda: _is(view, "198.51.100.0/24", wide))
    announced = await eventually(lambda: view.live_identity(outside))
    assert announced.identity.cidr == "198.51.100.10/32"
    held = await policy.stub.GetIdentity(identity_pb2.GetIdentityRequest(id=outside), timeout=5)
    assert held.references == 1

    # Released: its entry is tombstoned and, once unreferenced for the grace period, it is collected;
    # the prefix still held keeps its identity and entry through those collector passes.
    await policy.drop(wide, "198.51.100.0/24")
    await eventually(lambda: view.ipcache["198.51.100.0/24"].deleted)
    assert view.ipcache["198.51.100.0/24"].identity == wide
    await eventually(lambda: wide in view.identities and view.identities[wide].deleted)
    assert view.live_identity(outside) is not None
    assert _is(view, "198.51.100.10/32", outside)
    held = await policy.stub.GetIdentity(identity_pb2.GetIdentityRequest(id=outside), timeout=5)
    assert held.references == 1

    # kill -9 and restart: the references live under a lease ipam keeps itself, the entry is rebuilt.
    proc.kill()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    policy = PolicyHolder(proc.address)
    held = await policy.stub.GetIdentity(identity_pb2.GetIdentityRequest(id=outside), timeout=5)
    assert held.references == 1
    probe = await policy.take("203.0.113.0/24")  # the stream is ordered: once this is in, the sweep's work is
    await eventually(lambda: _is(view, "203.0.113.0/24", probe))
    assert _is(view, "198.51.100.10/32", outside), "the restart's sweep kept the entry"
    await policy.drop(outside, "198.51.100.10/32")
    await eventually(lambda: view.ipcache["198.51.100.10/32"].deleted)
    assert proc.terminate() == 0


async def test_a_pods_address_wins_over_a_cidr_identity_of_the_same_prefix(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    view = await BusView.start(bus)
    k8s = K8s(bus)
    web = pod("shop", "web", {"app": "web"}, ip="10.244.0.50")
    await k8s.apply(web)
    await k8s.synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    policy = PolicyHolder(proc.address)
    pod_entry = await eventually(lambda: view.entry("10.244.0.50/32"))
    assert pod_entry.pod == "web"

    # The CIDR identity of the pod's /32, taken while the pod has it: the pod's entry stays.
    cidr = await policy.take("10.244.0.50/32")
    other = await policy.take("10.244.0.51/32")  # ordered stream: once this is in, the first was handled
    await eventually(lambda: _is(view, "10.244.0.51/32", other))
    assert view.entry("10.244.0.50/32") == pod_entry
    # The pod goes: the address is the CIDR identity's; the pod comes back: it is the pod's again.
    await k8s.delete(web)
    await eventually(lambda: _is(view, "10.244.0.50/32", cidr))
    await k8s.apply(web)
    back = await eventually(lambda: (e := view.entry("10.244.0.50/32")) is not None and e.pod == "web" and e)
    assert back.identity == pod_entry.identity
    # Released while the pod has it: the pod's entry is untouched (no tombstone in between).
    await policy.drop(cidr, "10.244.0.50/32")
    await policy.drop(other, "10.244.0.51/32")
    await eventually(lambda: view.ipcache["10.244.0.51/32"].deleted)
    assert view.entry("10.244.0.50/32") == back
    assert proc.terminate() == 0


async def test_the_policy_service_may_hold_only_cidr_identities_on_its_own_node(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    await K8s(bus).synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    policy = PolicyHolder(proc.address)
    assert await _code(policy.take("198.51.100.10/32", node="node-a")) == grpc.StatusCode.PERMISSION_DENIED
    pod_labels = [common_pb2.Label(source="k8s", key="app", value="web")]
    request = identity_pb2.AllocateIdentityRequest(labels=pod_labels, node=CIDR_HOLDER_NODE, owner="pod/x/y")
    assert await _code(policy.stub.AllocateIdentity(request, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    # A datapath's pod identity cannot be released by it either.
    api = Api(proc.address)
    taken = await api.identity.AllocateIdentity(
        identity_pb2.AllocateIdentityRequest(labels=pod_labels, node="node-a", owner="pod/dev/web"), timeout=5
    )
    release = identity_pb2.ReleaseIdentityRequest(id=taken.identity.id, node="node-a", owner="pod/dev/web")
    assert await _code(policy.stub.ReleaseIdentity(release, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    allowed = await policy.take("198.51.100.10/32")
    view = await BusView.start(bus)
    await eventually(lambda: _is(view, "198.51.100.10/32", allowed))
    assert proc.terminate() == 0
