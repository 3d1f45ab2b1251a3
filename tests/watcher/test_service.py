"""The watcher as a process (`python -m services.watcher`) against a list/watch server and a real NATS."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import yaml
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from palisade.v1 import common_pb2, common_pb2_grpc, k8s_pb2
from services.common.subjects import k8s_subject
from testkit.apiserver import FakeApiServer
from testkit.harness import NatsServer, ServiceProcess, health_status, sync_channel
from tests.watcher import objects as o
from tests.watcher.helpers import StreamReader, eventually

Reader = Callable[[], Awaitable[StreamReader]]
Start = Callable[..., ServiceProcess]


def kube_args(nats: NatsServer, kubeconfig: Path) -> list[str]:
    return [
        "--nats-url",
        nats.url,
        "--source",
        "kubernetes",
        "--kubeconfig",
        str(kubeconfig),
        "--backoff-initial",
        "0.05",
        "--backoff-max",
        "0.5",
        "--missing-kind-retry",
        "0.5",
        "--log-format",
        "text",
    ]


def manifest_args(nats: NatsServer, folder: Path) -> list[str]:
    return ["--nats-url", nats.url, "--manifests", str(folder), "--manifests-poll", "0.05", "--log-format", "text"]


async def start(service: Start, *args: str, wait: bool = True) -> ServiceProcess:
    # In a thread: the list/watch server runs on this event loop and must keep answering.
    return await asyncio.to_thread(service, "watcher", *args, wait=wait)


def get_status(proc: ServiceProcess) -> common_pb2.ServiceStatus:
    with sync_channel(proc.address, proc.name) as ch:
        status: common_pb2.ServiceStatus = common_pb2_grpc.StatusServiceStub(ch).GetStatus(
            common_pb2.GetStatusRequest(), timeout=5
        )
        return status


def scrape(proc: ServiceProcess, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def cluster_state(api: FakeApiServer) -> dict[str, tuple[str, str]]:
    """subject -> (uid, resourceVersion) of every object the API server holds."""
    tokens = {
        "namespaces": "namespace",
        "pods": "pod",
        "nodes": "node",
        "networkpolicies": "networkpolicy",
        "ciliumnetworkpolicies": "ciliumnetworkpolicy",
        "ciliumclusterwidenetworkpolicies": "ciliumclusterwidenetworkpolicy",
    }
    out = {}
    for plural, res in api.resources.items():
        for (ns, name), obj in res.objects.items():
            out[k8s_subject(tokens[plural], ns, name)] = (obj["metadata"]["uid"], obj["metadata"]["resourceVersion"])
    return out


def stream_state(stream: StreamReader) -> dict[str, tuple[str, str]]:
    return {s: (d.uid, d.resource_version) for s, d in stream.last.items() if d.op == k8s_pb2.DELTA_OP_UPSERT}


def populate(api: FakeApiServer, pods: int) -> None:
    api.create("namespaces", o.namespace("prod"))
    api.create("nodes", o.node("node-1"))
    api.create("networkpolicies", o.netpol("deny", "prod"))
    api.create("ciliumnetworkpolicies", o.cnp("allow", "prod"))
    api.create("ciliumclusterwidenetworkpolicies", o.ccnp("egress"))
    for i in range(pods):
        api.create("pods", o.pod(f"p{i}", "prod", ip=f"10.0.{i // 250}.{i % 250 + 1}", app="web"))


async def test_not_serving_until_synced(
    apiserver: FakeApiServer, kubeconfig: Path, nats_server: NatsServer, service: Start
) -> None:
    populate(apiserver, pods=3)
    apiserver.resources["pods"].fail_status = 500
    proc = await start(service, *kube_args(nats_server, kubeconfig), wait=False)
    await eventually(lambda: apiserver.count("pods", watch=False) >= 2, "pods list retried")
    await eventually(lambda: apiserver.count("nodes", watch=True) >= 1, "nodes listed and watched")
    assert await asyncio.to_thread(health_status, proc.address, proc.name) == health_pb2.HealthCheckResponse.NOT_SERVING
    status = await asyncio.to_thread(get_status, proc)
    assert not status.synced
    assert "500" in status.details["error.pod"]

    apiserver.resources["pods"].fail_status = 0
    await asyncio.to_thread(proc.wait_serving)
    status = await asyncio.to_thread(get_status, proc)
    assert status.synced and status.details["objects.pod"] == "3" and status.details["errors"] == "0"
    assert await asyncio.to_thread(proc.terminate) == 0


async def test_kube_watcher_killed_and_restarted_leaves_exactly_the_current_state(
    apiserver: FakeApiServer, kubeconfig: Path, nats_server: NatsServer, service: Start, reader: Reader
) -> None:
    populate(apiserver, pods=20)
    first = await start(service, *kube_args(nats_server, kubeconfig))
    await asyncio.to_thread(first.kill)

    # While no watcher runs: deletions, a modification, an addition, and the history expires.
    for i in range(5):
        apiserver.delete("pods", "prod", f"p{i}")
    apiserver.delete("ciliumclusterwidenetworkpolicies", "", "egress")
    apiserver.patch("pods", "prod", "p10", lambda p: p["metadata"]["labels"].update(app="api"))
    apiserver.create("pods", o.pod("newcomer", "prod"))
    apiserver.compact()

    second = await start(service, *kube_args(nats_server, kubeconfig))
    stream = await reader()
    await eventually(lambda: len(stream.markers) == 1, "stream replayed up to the synced marker")
    assert stream_state(stream) == cluster_state(apiserver)
    expected_tombstones = {k8s_subject("pod", "prod", f"p{i}") for i in range(5)}
    expected_tombstones.add(k8s_subject("ciliumclusterwidenetworkpolicy", "", "egress"))
    assert stream.tombstones() == expected_tombstones
    assert stream.current()[k8s_subject("pod", "prod", "p10")]["metadata"]["labels"]["app"] == "api"
    # Only what changed was published by the second run.
    assert scrape(second, "palisade_watcher_deltas_published_total", kind="pod", op="upsert") == 2
    assert scrape(second, "palisade_watcher_deltas_published_total", kind="pod", op="delete") == 5
    assert await asyncio.to_thread(second.terminate) == 0


async def test_kube_watcher_survives_a_nats_restart(
    apiserver: FakeApiServer, kubeconfig: Path, nats_server: NatsServer, service: Start, reader: Reader
) -> None:
    populate(apiserver, pods=10)
    proc = await start(service, *kube_args(nats_server, kubeconfig))

    await asyncio.to_thread(nats_server.stop)
    # NATS is down: the watcher keeps reading the API server meanwhile.
    for i in range(10, 210):
        apiserver.create("pods", o.pod(f"p{i}", "prod", app="web"))
    for i in range(5):
        apiserver.delete("pods", "prod", f"p{i}")

    def received() -> float:
        return scrape(proc, "palisade_watcher_events_received_total", kind="pod")

    await eventually(lambda: received() == 10 + 200 + 5, "events read while NATS is down")
    assert scrape(proc, "palisade_watcher_publish_pending") >= 205

    await asyncio.to_thread(nats_server.start)
    stream = await reader()
    await eventually(lambda: stream_state(stream) == cluster_state(apiserver), "every delta after the restart")
    assert stream.tombstones() == {k8s_subject("pod", "prod", f"p{i}") for i in range(5)}
    await eventually(lambda: scrape(proc, "palisade_watcher_publish_pending") == 0, "nothing left pending")
    assert await asyncio.to_thread(proc.terminate) == 0


def write(path: Path, *docs: object) -> None:
    path.write_text(yaml.safe_dump_all(list(docs)))


async def test_manifest_watcher_killed_and_restarted_leaves_exactly_the_current_state(
    manifests: Path, nats_server: NatsServer, service: Start, reader: Reader
) -> None:
    write(manifests / "ns.yaml", o.namespace("prod"))
    write(manifests / "pods.yaml", *(o.pod(f"p{i}", "prod") for i in range(5)))
    write(manifests / "policy.yaml", o.netpol("deny", "prod"))
    first = await start(service, *manifest_args(nats_server, manifests))
    await asyncio.to_thread(first.kill)

    write(manifests / "pods.yaml", *(o.pod(f"p{i}", "prod", gen="2") for i in range(3, 8)))
    (manifests / "policy.yaml").unlink()

    await start(service, *manifest_args(nats_server, manifests))
    stream = await reader()
    await eventually(lambda: len(stream.markers) == 1, "stream replayed up to the synced marker")
    expected = {k8s_subject("namespace", "", "prod")} | {k8s_subject("pod", "prod", f"p{i}") for i in range(3, 8)}
    assert set(stream.current()) == expected
    current = stream.current()
    assert all(current[k8s_subject("pod", "prod", f"p{i}")]["metadata"]["labels"]["gen"] == "2" for i in range(3, 8))
    expected_tombstones = {k8s_subject("pod", "prod", f"p{i}") for i in range(3)}
    expected_tombstones.add(k8s_subject("networkpolicy", "prod", "deny"))
    assert stream.tombstones() == expected_tombstones


async def test_manifest_watcher_survives_a_nats_restart(
    manifests: Path, nats_server: NatsServer, service: Start, reader: Reader
) -> None:
    write(manifests / "pods.yaml", *(o.pod(f"p{i}", "prod") for i in range(5)))
    proc = await start(service, *manifest_args(nats_server, manifests))

    await asyncio.to_thread(nats_server.stop)
    write(manifests / "more.yaml", *(o.pod(f"m{i}", "prod") for i in range(100)))
    (manifests / "pods.yaml").unlink()
    await eventually(lambda: scrape(proc, "palisade_watcher_publish_pending") >= 105, "changes read while NATS is down")

    await asyncio.to_thread(nats_server.start)
    stream = await reader()
    expected = {k8s_subject("pod", "prod", f"m{i}") for i in range(100)}
    await eventually(lambda: set(stream.current()) == expected, "every delta after the restart")
    assert stream.tombstones() == {k8s_subject("pod", "prod", f"p{i}") for i in range(5)}
    status = await asyncio.to_thread(get_status, proc)
    assert status.details["objects.pod"] == "100"
    body = json.loads(stream.last[k8s_subject("pod", "prod", "m7")].object_json)
    assert body["metadata"]["namespace"] == "prod"
    assert await asyncio.to_thread(proc.terminate) == 0


async def test_manifest_watcher_killed_while_a_file_is_broken_deletes_nothing(
    manifests: Path, nats_server: NatsServer, service: Start, reader: Reader
) -> None:
    write(manifests / "deny.yaml", o.ccnp("deny-all"))
    write(manifests / "pods.yaml", o.pod("p0", "prod"))
    first = await start(service, *manifest_args(nats_server, manifests))
    (manifests / "deny.yaml").write_text("apiVersion: cilium.io/v2\nkind: [broken\n")
    await asyncio.to_thread(first.kill)

    await start(service, *manifest_args(nats_server, manifests))
    stream = await reader()
    await eventually(lambda: len(stream.markers) == 1, "stream replayed up to the synced marker")
    await eventually(lambda: "deny.yaml" in (stream.statuses[-1].errors if stream.statuses else {}), "error shown")
    assert k8s_subject("ciliumclusterwidenetworkpolicy", "", "deny-all") in stream.current()
    assert stream.tombstones() == set()
