"""The ipam service end to end: real NATS, etcd and gRPC; pods published as K8sDelta, observed on the bus."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from palisade.v1 import (
    common_pb2,
    identity_pb2,
    ipam_pb2,
)
from services.common.bus import Bus
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, creds, health_status
from testkit.ipam import SERVING, Api, BusView, K8s, eventually, ipam_args, namespace, node, pod


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect([nats_server.url], name="test", tls=creds()) as b:
        await b.ensure_streams()  # the watcher's and ipam's streams, so publishing works before ipam runs
        yield b


async def test_pod_identity_follows_pod_and_namespace_labels(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    view = await BusView.start(bus)
    k8s = K8s(bus)
    await k8s.apply(namespace("shop", {"team": "a"}))
    web1 = pod("shop", "web-1", {"app": "web", "pod-template-hash": "x1"}, ip="10.244.0.10", ports={"http": 8080})
    web2 = pod("shop", "web-2", {"app": "web", "pod-template-hash": "x2"}, ip="10.244.0.11", node="node-b")
    await k8s.apply(web1)
    await k8s.apply(web2)

    proc = service("ipam", *ipam_args(nats_server, etcd_server), wait=False)
    api = Api(proc.address)

    # Ready means synced: pods are applied, but no SERVING before the watcher's marker.
    async def pods_in() -> bool:
        try:
            status = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return status.details.get("pods") == "2" and bool(await api.resolve("shop", "web-2"))

    await eventually(pods_in)
    assert health_status(proc.address, proc.name) != SERVING
    assert not (await api.status.GetStatus(common_pb2.GetStatusRequest())).synced
    await k8s.synced()
    await eventually(lambda: health_status(proc.address, proc.name) == SERVING)
    status = await api.status.GetStatus(common_pb2.GetStatusRequest())
    assert status.synced and status.details["identities"] == "1" and status.details["allocations"] == "0"

    # Both replicas share one identity (the template hash is not identity-relevant).
    r1, r2 = await api.resolve("shop", "web-1"), await api.resolve("shop", "web-2")
    assert r1 is not None and r2 is not None
    web_id = r1.identity.id
    assert r2.identity.id == web_id and 256 <= web_id <= 65535
    assert (list(r1.ips), r1.node, list(r2.ips), r2.node) == (["10.244.0.10"], "node-a", ["10.244.0.11"], "node-b")

    # Its references, as the replica's view counts them (both pods hold it) and as etcd has them.
    async def both_referenced() -> bool:
        resolved = await api.resolve("shop", "web-1")
        stored = await api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=web_id), timeout=5)
        return resolved is not None and resolved.identity.references == stored.references == 2

    await eventually(both_referenced)
    labels = {f"{x.source}:{x.key}={x.value}" for x in r1.identity.labels}
    assert {
        "k8s:app=web",
        "k8s:io.kubernetes.pod.namespace=shop",
        "k8s:io.cilium.k8s.namespace.labels.team=a",
    } <= labels
    assert not any("pod-template-hash" in x for x in labels)
    assert r1.identity.references == 2
    announced = await eventually(lambda: view.live_identity(web_id))
    assert {(x.source, x.key, x.value) for x in announced.identity.labels} == {
        (x.source, x.key, x.value) for x in r1.identity.labels
    }
    entry = await eventually(lambda: view.entry("10.244.0.10/32"))
    assert (entry.identity, entry.node, entry.namespace, entry.pod) == (web_id, "node-a", "shop", "web-1")
    assert entry.named_ports["http"].port == 8080 and entry.named_ports["http"].protocol == common_pb2.PROTOCOL_TCP

    # A pod label change moves that pod (only) to a new identity; the old keeps its other holder.
    web1["metadata"]["labels"]["tier"] = "front"
    await k8s.apply(web1)
    front = await eventually(lambda: _moved(api, "shop", "web-1", web_id))
    assert front != web_id
    await eventually(lambda: (e := view.entry("10.244.0.10/32")) is not None and e.identity == front)
    assert (await api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=web_id))).references == 1
    assert view.live_identity(front) is not None

    # A namespace label change moves every pod of the namespace; the unused identities get collected.
    await k8s.apply(namespace("shop", {"team": "b"}))
    await eventually(lambda: _moved(api, "shop", "web-2", web_id))
    await eventually(lambda: _moved(api, "shop", "web-1", front))
    r1, r2 = await api.resolve("shop", "web-1"), await api.resolve("shop", "web-2")
    assert r1 is not None and r2 is not None and r1.identity.id != r2.identity.id
    assert "k8s:io.cilium.k8s.namespace.labels.team=b" in {f"{x.source}:{x.key}={x.value}" for x in r2.identity.labels}
    await eventually(lambda: (e := view.entry("10.244.0.11/32")) is not None and e.identity == r2.identity.id)
    await eventually(lambda: web_id in view.identities and view.identities[web_id].deleted)
    await eventually(lambda: front in view.identities and view.identities[front].deleted)
    code = await api.code(api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=web_id), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND

    # A pod that goes takes its ipcache entry with it.
    await k8s.delete(web2)
    await eventually(lambda: "10.244.0.11/32" in view.ipcache and view.ipcache["10.244.0.11/32"].deleted)
    await eventually(lambda: _gone(api, "shop", "web-2"))

    # A pod without status IPs gets its address from an IPAM allocation made for it.
    db = pod("shop", "db", {"app": "db"})
    await k8s.apply(db)
    db_id = (await eventually(lambda: api.resolve("shop", "db"))).identity.id
    alloc = await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-a", owner="pod/shop/db"), timeout=5)
    prefix = f"{alloc.ip}/32"
    entry = await eventually(lambda: view.entry(prefix))
    assert (entry.identity, entry.pod, entry.node) == (db_id, "db", "node-a")
    assert list((await api.resolve("shop", "db")).ips) == [alloc.ip]  # type: ignore[union-attr]
    await api.ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node="node-a", ip=alloc.ip), timeout=5)
    await eventually(lambda: prefix in view.ipcache and view.ipcache[prefix].deleted)
    assert proc.terminate() == 0


async def _moved(api: Api, ns: str, name: str, old: int) -> int | None:
    r = await api.resolve(ns, name)
    return r.identity.id if r is not None and r.identity.id != old else None


async def _gone(api: Api, ns: str, name: str) -> bool:
    code = await api.code(api.identity.ResolvePod(identity_pb2.ResolvePodRequest(namespace=ns, name=name), timeout=5))
    return bool(code == grpc.StatusCode.NOT_FOUND)


async def test_node_cidr_priority_and_grpc_error_codes(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    k8s = K8s(bus)
    await k8s.apply(
        node("n-spec", pod_cidrs=["10.50.0.0/30"], annotations={"io.cilium.network.ipv4-pod-cidr": "10.60.0.0/30"})
    )
    await k8s.apply(node("n-ann", annotations={"io.cilium.network.ipv4-pod-cidr": "10.60.0.0/30"}))
    await k8s.apply(node("n-pool"))
    await k8s.synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server, "--ipam-mode", "kubernetes", "--node-mask-v4", "30"))
    api = Api(proc.address)
    got = {}
    for name in ("n-spec", "n-ann", "n-pool"):
        cidr = await api.ipam.GetNodeCIDR(ipam_pb2.GetNodeCIDRRequest(node=name), timeout=5)
        got[name] = (list(cidr.cidrs), cidr.source)
    assert got == {
        "n-spec": (["10.50.0.0/30"], ipam_pb2.CIDR_SOURCE_NODE_SPEC),
        "n-ann": (["10.60.0.0/30"], ipam_pb2.CIDR_SOURCE_ANNOTATION),
        "n-pool": (["10.244.0.0/30"], ipam_pb2.CIDR_SOURCE_POOL),
    }
    # A /30 holds one pod address.
    first = await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="n-spec", owner="pod/a/a"), timeout=5)
    assert (first.ip, first.gateway, first.family) == ("10.50.0.2", "10.50.0.1", ipam_pb2.FAMILY_IPV4)
    errors = {
        "exhausted": api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="n-spec", owner="pod/a/b"), timeout=5),
        "double": api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="n-spec", owner="pod/a/a"), timeout=5),
        "unknown ip": api.ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node="n-spec", ip="10.50.0.3"), timeout=5),
        "wrong owner": api.ipam.ReleaseIP(
            ipam_pb2.ReleaseIPRequest(node="n-spec", ip="10.50.0.2", owner="pod/a/z"), timeout=5
        ),
        "bad ip": api.ipam.AllocateIP(
            ipam_pb2.AllocateIPRequest(node="n-ann", owner="pod/a/c", ip="10.50.0.2"), timeout=5
        ),
        "no labels": api.identity.AllocateIdentity(
            identity_pb2.AllocateIdentityRequest(node="n-pool", owner="x"), timeout=5
        ),
        "unknown id": api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=4242), timeout=5),
        "unknown ref": api.identity.ReleaseIdentity(
            identity_pb2.ReleaseIdentityRequest(id=4242, node="n-pool", owner="x"), timeout=5
        ),
        "unknown pod": api.identity.ResolvePod(identity_pb2.ResolvePodRequest(namespace="a", name="b"), timeout=5),
    }
    codes = {what: await api.code(call) for what, call in errors.items()}
    assert codes == {
        "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "double": grpc.StatusCode.ALREADY_EXISTS,
        "unknown ip": grpc.StatusCode.NOT_FOUND,
        "wrong owner": grpc.StatusCode.FAILED_PRECONDITION,
        "bad ip": grpc.StatusCode.INVALID_ARGUMENT,
        "no labels": grpc.StatusCode.INVALID_ARGUMENT,
        "unknown id": grpc.StatusCode.NOT_FOUND,
        "unknown ref": grpc.StatusCode.NOT_FOUND,
        "unknown pod": grpc.StatusCode.NOT_FOUND,
    }
    listed = await api.ipam.ListAllocations(ipam_pb2.ListAllocationsRequest(), timeout=5)
    assert [(a.node, a.ip, a.owner) for a in listed.allocations] == [("n-spec", "10.50.0.2", "pod/a/a")]
    try:
        await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="n-spec", owner="pod/a/b"), timeout=5)
    except grpc.aio.AioRpcError as err:
        assert "10.50.0.0/30" in (err.details() or "") and "release" in (err.details() or "")
    # Reserved identities answer their fixed numbers and list on request.
    host = await api.identity.AllocateIdentity(
        identity_pb2.AllocateIdentityRequest(
            labels=[common_pb2.Label(source="reserved", key="host")], node="n-pool", owner="x"
        ),
        timeout=5,
    )
    assert (host.identity.id, host.identity.kind) == (1, identity_pb2.IDENTITY_KIND_RESERVED)
    listed_ids = await api.identity.ListIdentities(identity_pb2.ListIdentitiesRequest(include_reserved=True))
    assert [i.id for i in listed_ids.identities] == [1, 2, 3, 4, 5, 6, 7]


async def _snapshot(api: Api) -> tuple:  # type: ignore[type-arg]
    allocations = await api.ipam.ListAllocations(ipam_pb2.ListAllocationsRequest(), timeout=5)
    identities = await api.identity.ListIdentities(identity_pb2.ListIdentitiesRequest(), timeout=5)
    return (
        sorted((a.node, a.ip, a.owner, a.cidr) for a in allocations.allocations),
        sorted((n.node, tuple(n.cidrs), n.source) for n in allocations.nodes),
        sorted(
            (i.id, tuple(sorted((x.source, x.key, x.value) for x in i.labels)), i.references)
            for i in identities.identities
        ),
    )


async def _publish_pods(k8s: K8s, pods: int) -> None:
    await k8s.apply(namespace("app", {"env": "prod"}))
    for i in range(pods):
        await k8s.apply(pod("app", f"p{i}", {"app": f"svc-{i % 4}"}, node=f"node-{i % 2}"))
    await k8s.synced()


async def _allocate(api: Api, pods: int) -> None:
    for i in range(pods):
        await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node=f"node-{i % 2}", owner=f"pod/app/p{i}"), timeout=5)
    # A datapath holding a reference of its own, and a CIDR identity.
    await api.identity.AllocateIdentity(
        identity_pb2.AllocateIdentityRequest(
            labels=[common_pb2.Label(source="k8s", key="app", value="health-probe")], node="node-0", owner="ep/12"
        ),
        timeout=5,
    )
    await api.identity.AllocateIdentity(
        identity_pb2.AllocateIdentityRequest(
            labels=[common_pb2.Label(source="cidr", key="192.168.0.0/16")], node="node-0", owner="policy/x"
        ),
        timeout=5,
    )


async def test_kill_9_and_restart_keeps_every_allocation(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    view = await BusView.start(bus)
    k8s = K8s(bus)
    await _publish_pods(k8s, pods=12)
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(proc.address)
    await _allocate(api, pods=12)

    def all_entries() -> bool:
        # Every pod address and the CIDR identity's prefix (its entry may come before the last pod's).
        live = {p for p, e in view.ipcache.items() if not e.deleted}
        return len(live) == 13 and "192.168.0.0/16" in live

    await eventually(all_entries)
    before = await _snapshot(api)
    resolved = {f"p{i}": await api.resolve("app", f"p{i}") for i in range(12)}
    assert len(before[0]) == 12 and len(before[2]) == 6  # 4 pod label sets, the probe and the CIDR identity
    bus_before = {p: (e.identity, e.deleted) for p, e in view.ipcache.items()}

    proc.kill()  # SIGKILL: no cleanup at all
    # Meanwhile a pod changes, one goes: the restarted service must catch up on both.
    await k8s.apply(pod("app", "p0", {"app": "svc-new"}, node="node-0"))
    await k8s.delete(pod("app", "p11", {}, node="node-1"))
    again = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(again.address)
    after = await _snapshot(api)
    assert after[0] == before[0] and after[1] == before[1]  # every address and node CIDR, unchanged
    old_ids = {i[0]: i for i in before[2]}
    for ident, labels, _refs in after[2]:
        if ident in old_ids:
            assert old_ids[ident][1] == labels  # never renumbered
    for i in range(1, 11):
        r = await api.resolve("app", f"p{i}")
        assert r is not None and r.identity.id == resolved[f"p{i}"].identity.id  # type: ignore[union-attr]
        assert list(r.ips) == list(resolved[f"p{i}"].ips)  # type: ignore[union-attr]
    assert (await api.resolve("app", "p0")).identity.id not in old_ids  # type: ignore[union-attr]
    assert await _gone(api, "app", "p11")
    # The datapath's own reference survived the restart (the node lease was adopted, not replaced).
    probe = [i for i in after[2] if ("k8s", "app", "health-probe") in i[1]]
    assert probe and probe[0][2] == 1
    p11_ip = resolved["p11"].ips[0]  # type: ignore[union-attr]
    await eventually(lambda: f"{p11_ip}/32" in view.ipcache and view.ipcache[f"{p11_ip}/32"].deleted)
    for prefix, (ident, deleted) in bus_before.items():
        if prefix != f"{p11_ip}/32" and prefix != f"{resolved['p0'].ips[0]}/32":  # type: ignore[union-attr]
            assert (view.ipcache[prefix].identity, view.ipcache[prefix].deleted) == (ident, deleted)
    # Allocating again neither duplicates nor loses anything.
    code = await api.code(api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-0", owner="pod/app/p2"), timeout=5))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    fresh = await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-0", owner="pod/app/new"), timeout=5)
    assert fresh.ip not in {a[1] for a in before[0]}


async def test_etcd_restart_is_survived(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    k8s = K8s(bus)
    await _publish_pods(k8s, pods=4)
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(proc.address)
    await _allocate(api, pods=4)
    before = await _snapshot(api)
    r2 = await api.resolve("app", "p2")
    assert r2 is not None

    etcd_server.stop()
    # While etcd is down a pod changes; the service applies it once etcd is back, dropping nothing.
    await k8s.apply(pod("app", "p1", {"app": "during-outage"}, node="node-1"))
    etcd_server.start()

    async def p1_moved() -> bool:
        r = await api.resolve("app", "p1")
        return r is not None and ("k8s", "app", "during-outage") in {
            (x.source, x.key, x.value) for x in r.identity.labels
        }

    await eventually(p1_moved, timeout=40)
    fresh = await api.ipam.AllocateIP(ipam_pb2.AllocateIPRequest(node="node-1", owner="pod/app/later"), timeout=30)
    assert fresh.ip not in {a[1] for a in before[0]}
    after = await _snapshot(api)
    assert set(before[0]) < set(after[0]) and after[1] == before[1]
    r2_after = await api.resolve("app", "p2")
    assert r2_after is not None and r2_after.identity.id == r2.identity.id
    assert health_status(proc.address, proc.name) == SERVING
    assert proc.terminate() == 0


def _labels(**kv: str) -> list[common_pb2.Label]:
    return [common_pb2.Label(source="k8s", key=k, value=v) for k, v in kv.items()]


async def _take(api: Api, owner: str, node: str = "node-a", **labels: str) -> int:
    ns = owner.split("/")[1]
    resp = await api.identity.AllocateIdentity(
        identity_pb2.AllocateIdentityRequest(
            labels=_labels(**labels, **{"io.kubernetes.pod.namespace": ns}), node=node, owner=owner
        ),
        timeout=5,
    )
    return int(resp.identity.id)


async def _address(api: Api, owner: str, node: str = "node-a", **ports: int) -> str:
    request = ipam_pb2.AllocateIPRequest(node=node, owner=owner)
    for name, port in ports.items():
        request.named_ports[name].port = port
        request.named_ports[name].protocol = (
            common_pb2.PROTOCOL_UDP if name.startswith("dns") else common_pb2.PROTOCOL_ANY
        )
    alloc = await api.ipam.AllocateIP(request, timeout=5)
    return str(alloc.ip)


async def test_api_endpoints_get_ipcache_entries_joined_from_identity_and_address(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    """An owner holding an identity reference and an address on a node gets an ipcache entry; restarts keep it."""
    view = await BusView.start(bus)
    k8s = K8s(bus)
    await k8s.apply(pod("shop", "db", {"app": "db"}, ip="10.244.0.200"))  # a bus pod
    await k8s.synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(proc.address)

    # Identity first, then the address with named ports (the datapath's order): one entry.
    web_id = await _take(api, "pod/dev/web", app="web")
    web_ip = await _address(api, "pod/dev/web", http=8080, dns=53)
    entry = await eventually(lambda: view.entry(f"{web_ip}/32"))
    assert (entry.identity, entry.node, entry.namespace, entry.pod) == (web_id, "node-a", "dev", "web")
    assert {n: (p.port, p.protocol) for n, p in entry.named_ports.items()} == {
        "http": (8080, common_pb2.PROTOCOL_TCP),
        "dns": (53, common_pb2.PROTOCOL_UDP),
    }
    # The other order joins too; one half alone does not.
    cli_ip = await _address(api, "pod/dev/cli")
    await _take(api, "pod/dev/only-identity", app="x")
    lonely_ip = await _address(api, "pod/dev/only-address")
    cli_id = await _take(api, "pod/dev/cli", app="cli")
    assert (await eventually(lambda: view.entry(f"{cli_ip}/32"))).identity == cli_id
    # A bus pod wins over an API endpoint with its owner: no entry for the API address, its identity stays.
    db_bus = await eventually(lambda: view.entry("10.244.0.200/32"))
    await _take(api, "pod/shop/db", app="impostor")
    api_db_ip = await _address(api, "pod/shop/db")
    await eventually(lambda: _resolves_to(api, "shop", "db", db_bus.identity))
    code = await api.code(
        api.ipam.AllocateIP(
            ipam_pb2.AllocateIPRequest(
                node="node-a", owner="pod/dev/bad", named_ports={"x": identity_pb2.NamedPort(port=70000)}
            ),
            timeout=5,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    status = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    assert status.details["api_endpoints"] == "2"
    for ip in (lonely_ip, api_db_ip):
        assert f"{ip}/32" not in view.ipcache
    assert view.entry("10.244.0.200/32") == db_bus

    # kill -9 and restart: the sweep keeps what API owners hold, the entries are rebuilt unchanged.
    published = {p: e.SerializeToString(deterministic=True) for p, e in view.ipcache.items()}
    proc.kill()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    api = Api(proc.address)
    status = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    assert status.synced and status.details["api_endpoints"] == "2"
    assert (await api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=web_id), timeout=5)).references == 1
    assert (await api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=cli_id), timeout=5)).references == 1
    # The stream is ordered: once a later entry is in, anything the sweep published is in too.
    await _take(api, "pod/dev/late", app="late")
    late_ip = await _address(api, "pod/dev/late")
    await eventually(lambda: view.entry(f"{late_ip}/32"))
    assert {p: view.ipcache[p].SerializeToString(deterministic=True) for p in published} == published

    # After the restart the ports come from the stored entry: a new identity keeps them.
    new_web = await _take(api, "pod/dev/web", app="web2")
    moved = await eventually(lambda: (e := view.entry(f"{web_ip}/32")) is not None and e.identity == new_web and e)
    assert set(moved.named_ports) == {"http", "dns"}

    # Either half going tombstones the entry.
    await api.ipam.ReleaseIP(ipam_pb2.ReleaseIPRequest(node="node-a", ip=web_ip, owner="pod/dev/web"), timeout=5)
    await eventually(lambda: view.ipcache[f"{web_ip}/32"].deleted)
    await api.identity.ReleaseIdentity(
        identity_pb2.ReleaseIdentityRequest(id=cli_id, node="node-a", owner="pod/dev/cli"), timeout=5
    )
    await eventually(lambda: view.ipcache[f"{cli_ip}/32"].deleted)
    tomb = view.ipcache[f"{cli_ip}/32"]
    assert (tomb.identity, tomb.namespace, tomb.pod) == (cli_id, "dev", "cli")
    status = await api.status.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    assert status.details["api_endpoints"] == "1"  # pod/dev/late
    assert proc.terminate() == 0


async def _resolves_to(api: Api, ns: str, name: str, identity: int) -> bool:
    r = await api.resolve(ns, name)
    if r is None or r.identity.id != identity:
        return False
    # The reference the API moved was taken back for the bus pod's labels.
    held = await api.identity.GetIdentity(identity_pb2.GetIdentityRequest(id=identity), timeout=5)
    return bool(held.references == 1)


async def test_node_addresses_are_remote_node_entries_that_follow_the_node_object(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess], bus: Bus
) -> None:
    """A Node's InternalIP/ExternalIP get the remote-node identity (6), named by the node; they move
    and go with the Node object, and survive an ipam restart."""
    view = await BusView.start(bus)
    k8s = K8s(bus)
    node_a = node("node-a")
    node_a["status"] = {
        "addresses": [
            {"type": "InternalIP", "address": "192.168.7.10"},
            {"type": "Hostname", "address": "node-a"},
            {"type": "ExternalIP", "address": "203.0.113.10"},
        ]
    }
    await k8s.apply(node_a)
    await k8s.synced()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    for prefix in ("192.168.7.10/32", "203.0.113.10/32"):
        entry = await eventually(functools.partial(view.entry, prefix))
        assert (entry.identity, entry.node, entry.pod) == (6, "node-a", "")
    assert not any(p.startswith("node-a") for p in view.ipcache)

    node_a["status"]["addresses"] = [{"type": "InternalIP", "address": "192.168.7.11"}]
    await k8s.apply(node_a)
    await eventually(lambda: view.entry("192.168.7.11/32"))
    await eventually(lambda: view.entry("192.168.7.10/32") is None)

    proc.kill()
    proc = service("ipam", *ipam_args(nats_server, etcd_server))
    await k8s.delete(node_a)
    await eventually(lambda: view.entry("192.168.7.11/32") is None)
