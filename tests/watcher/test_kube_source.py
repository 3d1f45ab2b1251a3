"""The Kubernetes source in-process against a list/watch HTTP server and a real NATS."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from palisade.v1 import common_pb2, k8s_pb2
from services.common.bus import Bus
from services.common.subjects import k8s_subject
from testkit.apiserver import FakeApiServer
from tests.watcher import objects as o
from tests.watcher.helpers import FAST_KUBE, StreamReader, eventually, kube_source, running

ALL_KINDS = [
    "namespace",
    "pod",
    "node",
    "networkpolicy",
    "ciliumnetworkpolicy",
    "ciliumclusterwidenetworkpolicy",
    "service",
    "endpointslice",
]

Reader = Callable[[], Awaitable[StreamReader]]


def populate(api: FakeApiServer, pods: int = 3) -> set[str]:
    """A small cluster; returns the subjects its objects live on."""
    api.create("namespaces", o.namespace("default"))
    api.create("namespaces", o.namespace("prod", team="a"))
    for i in range(pods):
        api.create("pods", o.pod(f"web-{i}", "prod", ip=f"10.0.1.{i + 10}", app="web"))
    api.create("nodes", o.node("node-1.example.com"))
    api.create("networkpolicies", o.netpol("deny", "prod"))
    api.create("ciliumnetworkpolicies", o.cnp("allow-world", "prod"))
    api.create("ciliumclusterwidenetworkpolicies", o.ccnp("egress"))
    api.create("services", o.service("web", "prod"))
    api.create("endpointslices", o.endpoint_slice("web-abcde", "prod", service="web", ip="10.0.1.10"))
    subjects = {
        k8s_subject("service", "prod", "web"),
        k8s_subject("endpointslice", "prod", "web-abcde"),
        k8s_subject("namespace", "", "default"),
        k8s_subject("namespace", "", "prod"),
        k8s_subject("node", "", "node-1.example.com"),
        k8s_subject("networkpolicy", "prod", "deny"),
        k8s_subject("ciliumnetworkpolicy", "prod", "allow-world"),
        k8s_subject("ciliumclusterwidenetworkpolicy", "", "egress"),
    }
    subjects |= {k8s_subject("pod", "prod", f"web-{i}") for i in range(pods)}
    return subjects


def pod_subject(name: str, ns: str = "prod") -> str:
    return k8s_subject("pod", ns, name)


async def test_initial_sync_publishes_every_object_then_the_marker(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    # 120 pods with 50 per page: the list is paged.
    expected = populate(apiserver, pods=120)
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        # synced is set when the marker's ack comes back, which a reader can beat.
        await eventually(run.watcher.synced.is_set, "the watcher to see its marker acked")
        assert set(stream.current()) == expected
        # The marker comes after every initial delta.
        assert len(stream.deltas) == len(expected)
        marker = stream.markers[0]
        assert list(marker.kinds) == ALL_KINDS
        assert list(marker.missing_kinds) == []
        assert marker.source == "kubernetes"

        pod = stream.last[pod_subject("web-7")]
        assert pod.kind == k8s_pb2.K8S_KIND_POD and pod.op == k8s_pb2.DELTA_OP_UPSERT
        assert (pod.namespace, pod.name, pod.source) == ("prod", "web-7", "kubernetes")
        body = json.loads(pod.object_json)
        stored = apiserver.resources["pods"].objects[("prod", "web-7")]
        assert pod.uid == stored["metadata"]["uid"]
        assert pod.resource_version == stored["metadata"]["resourceVersion"]
        # List items come without apiVersion/kind; consumers get them anyway. managedFields are stripped.
        assert (body["apiVersion"], body["kind"]) == ("v1", "Pod")
        assert "managedFields" not in body["metadata"]
        assert body["status"]["podIP"] == "10.0.1.17"
        node = stream.last[k8s_subject("node", "", "node-1.example.com")]
        assert node.namespace == "" and node.name == "node-1.example.com"

        status = common_pb2.ServiceStatus()
        run.watcher.fill_status(status)
        assert status.synced
        assert status.details["objects.pod"] == "120"
        assert status.details["errors"] == "0"
        assert run.metric("palisade_watcher_deltas_published_total", kind="pod", op="upsert") == 120
        assert run.metric("palisade_watcher_synced") == 1
        assert apiserver.count("pods", watch=False) == 3  # 50 + 50 + 20


async def test_add_modify_delete_and_irrelevant_updates_skipped(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    populate(apiserver, pods=1)
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")

        apiserver.create("pods", o.pod("api", "prod", app="api"))
        await eventually(lambda: pod_subject("api") in stream.last, "pod added")
        assert json.loads(stream.last[pod_subject("api")].object_json)["status"]["phase"] == "Pending"

        # Status-only noise: conditions and a container restart count. Not published.
        def noise(obj: dict[str, Any]) -> None:
            obj["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
            obj["status"]["containerStatuses"] = [{"name": "c", "restartCount": 1}]

        apiserver.patch("pods", "prod", "api", noise)
        # The pod gets its IP: relevant. Events of one kind are handled in order, so once this
        # arrives, the noise before it has been handled too.
        apiserver.patch("pods", "prod", "api", lambda p: p["status"].update(podIP="10.0.2.5", phase="Running"))
        await eventually(
            lambda: json.loads(stream.last[pod_subject("api")].object_json)["status"].get("podIP") == "10.0.2.5",
            "pod IP published",
        )
        assert stream.ops(pod_subject("api")) == [k8s_pb2.DELTA_OP_UPSERT] * 2
        assert run.metric("palisade_watcher_events_skipped_total", kind="pod") == 1

        apiserver.patch("pods", "prod", "api", lambda p: p["metadata"]["labels"].update(tier="backend"))
        await eventually(lambda: len(stream.ops(pod_subject("api"))) == 3, "label change published")
        assert json.loads(stream.last[pod_subject("api")].object_json)["metadata"]["labels"]["tier"] == "backend"

        apiserver.patch("namespaces", "", "prod", lambda n: n["metadata"]["labels"].update(env="prod"))
        apiserver.delete("pods", "prod", "api")
        await eventually(lambda: pod_subject("api") in stream.tombstones(), "tombstone")
        tomb = stream.last[pod_subject("api")]
        assert json.loads(tomb.object_json)["metadata"]["labels"]["tier"] == "backend"
        await eventually(
            lambda: "env" in stream.current()[k8s_subject("namespace", "", "prod")]["metadata"]["labels"],
            "namespace label",
        )
        assert run.metric("palisade_watcher_deltas_published_total", kind="pod", op="delete") == 1


async def test_cut_watch_resumes_from_its_resource_version(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    populate(apiserver)
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        await eventually(lambda: apiserver.active_watches("pods") == 1, "pods watched")
        watches = apiserver.count("pods", watch=True)

        # Mid-stream, half an event, then the connection drops.
        assert apiserver.cut(partial=True) == len(ALL_KINDS)
        apiserver.create("pods", o.pod("late", "prod", app="web"))
        apiserver.delete("pods", "prod", "web-0")
        await eventually(lambda: pod_subject("web-0") in stream.tombstones(), "tombstone after the cut")
        await eventually(lambda: pod_subject("late") in stream.current(), "pod created after the cut")

        assert apiserver.count("pods", watch=True) > watches
        # Resumed from the last resourceVersion: no relist, and nothing published twice.
        assert apiserver.count("pods", watch=False) == 1
        assert stream.ops(pod_subject("late")) == [k8s_pb2.DELTA_OP_UPSERT]
        assert stream.ops(pod_subject("web-1")) == [k8s_pb2.DELTA_OP_UPSERT]
        assert run.metric("palisade_watcher_errors_total", kind="pod", reason="stream") >= 1
        assert run.metric("palisade_watcher_relists_total", kind="pod") == 0


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_gone_relists_and_tombstones_what_vanished_meanwhile(
    gone_as_http: bool, apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    populate(apiserver)
    apiserver.gone_as_http = gone_as_http
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        await eventually(lambda: apiserver.active_watches("pods") == 1, "pods watched")

        # Disconnected while the cluster moves on and the history expires.
        apiserver.resources["pods"].fail_status = 500
        apiserver.cut(partial=False)
        apiserver.delete("pods", "prod", "web-0")
        apiserver.patch("pods", "prod", "web-1", lambda p: p["metadata"]["labels"].update(version="2"))
        apiserver.create("pods", o.pod("new", "prod", app="web"))
        apiserver.compact()
        apiserver.resources["pods"].fail_status = 0

        await eventually(lambda: pod_subject("web-0") in stream.tombstones(), "tombstone from the relist")
        await eventually(lambda: pod_subject("new") in stream.current(), "new pod from the relist")
        await eventually(
            lambda: stream.current()[pod_subject("web-1")]["metadata"]["labels"].get("version") == "2",
            "modified pod from the relist",
        )
        tomb = json.loads(stream.last[pod_subject("web-0")].object_json)
        assert tomb["metadata"]["name"] == "web-0"
        # Unchanged objects are not republished by the relist.
        assert stream.ops(pod_subject("web-2")) == [k8s_pb2.DELTA_OP_UPSERT]
        assert run.metric("palisade_watcher_relists_total", kind="pod") == 1
        assert apiserver.count("pods", watch=False) == 2

        # And watching goes on after the relist.
        apiserver.delete("pods", "prod", "new")
        await eventually(lambda: pod_subject("new") in stream.tombstones(), "tombstone after the relist")


async def test_bookmarks_keep_a_quiet_kind_resumable(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    listed = populate(apiserver)
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        await eventually(lambda: apiserver.active_watches("nodes") == 1, "nodes watched")
        node_watches = apiserver.count("nodes", watch=True)
        # Pods move the resourceVersion on; nodes see none of it but the bookmark.
        for i in range(5):
            apiserver.create("pods", o.pod(f"extra-{i}", "prod"))
        apiserver.compact()
        apiserver.bookmark()
        apiserver.cut(partial=False)

        await eventually(lambda: apiserver.count("nodes", watch=True) > node_watches, "nodes watched again")
        await eventually(lambda: apiserver.active_watches("nodes") == 1, "nodes watch established")
        await eventually(lambda: pod_subject("extra-4") in stream.current(), "pods published")
        # Without the bookmark, the node watch would resume from a compacted version and relist.
        assert run.metric("palisade_watcher_relists_total", kind="node") == 0
        assert apiserver.count("nodes", watch=False) == 1
        assert len(stream.deltas) == len(listed) + 5  # nothing republished


async def test_missing_crds_do_not_stop_other_kinds(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    populate(apiserver)
    apiserver.serve("ciliumnetworkpolicies", False)
    apiserver.serve("ciliumclusterwidenetworkpolicies", False)
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        marker = stream.markers[0]
        assert list(marker.kinds) == ["namespace", "pod", "node", "networkpolicy", "service", "endpointslice"]
        assert list(marker.missing_kinds) == ["ciliumnetworkpolicy", "ciliumclusterwidenetworkpolicy"]
        assert pod_subject("web-0") in stream.current()
        assert not any(s.startswith("palisade.k8s.cilium") for s in stream.current())
        await eventually(lambda: bool(stream.statuses) and len(stream.statuses[-1].errors) == 2, "status errors")
        assert "install the Cilium CRDs" in stream.statuses[-1].errors["ciliumnetworkpolicy"]

        def status() -> common_pb2.ServiceStatus:
            answer = common_pb2.ServiceStatus()
            run.watcher.fill_status(answer)
            return answer

        # Synced once the server has acknowledged the marker, which a reader may see a moment before.
        await eventually(lambda: status().synced, "synced")
        assert "missing.ciliumnetworkpolicy" in status().details

        # Watching goes on for the others...
        apiserver.create("pods", o.pod("more", "prod"))
        await eventually(lambda: pod_subject("more") in stream.current(), "pod while CRDs are missing")
        # ...and the CRD is picked up once installed.
        apiserver.serve("ciliumnetworkpolicies", True)
        await eventually(lambda: k8s_subject("ciliumnetworkpolicy", "prod", "allow-world") in stream.current(), "cnp")
        await eventually(lambda: len(stream.markers) == 2, "marker republished")
        assert list(stream.markers[-1].missing_kinds) == ["ciliumclusterwidenetworkpolicy"]
        assert "ciliumnetworkpolicy" in stream.markers[-1].kinds
        await eventually(lambda: len(stream.statuses[-1].errors) == 1, "status error cleared")


async def test_crd_removed_while_watching_tombstones_its_objects(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    populate(apiserver)
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)):
        await eventually(lambda: bool(stream.markers), "synced marker")
        apiserver.serve("ciliumclusterwidenetworkpolicies", False)
        subject = k8s_subject("ciliumclusterwidenetworkpolicy", "", "egress")
        await eventually(lambda: subject in stream.tombstones(), "tombstone of the CRD's object")
        await eventually(lambda: len(stream.markers) == 2, "marker republished")
        assert list(stream.markers[-1].missing_kinds) == ["ciliumclusterwidenetworkpolicy"]


async def test_rejected_credentials_are_reported(
    apiserver: FakeApiServer, tmp_path: Path, bus: Bus, reader: Reader
) -> None:
    apiserver.token = "another-token"
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")
    apiserver.token = "the-right-token"
    stream = await reader()
    async with running(bus, kube_source(kubeconfig)) as run:
        every_kind = len(ALL_KINDS)
        await eventually(lambda: len(stream.statuses) > 0 and len(stream.statuses[-1].errors) == every_kind, "errors")
        message = stream.statuses[-1].errors["pod"]
        assert "401" in message and "list and watch" in message
        assert not run.watcher.synced.is_set()
        assert run.metric("palisade_watcher_errors_total", kind="pod", reason="stream") >= 1
        # Fixed credentials (the server accepting the old token): it recovers and syncs.
        apiserver.token = "another-token"
        await eventually(lambda: bool(stream.markers), "synced marker after recovery")
        await eventually(lambda: len(stream.statuses[-1].errors) == 0, "errors cleared")


async def test_a_watch_ended_by_the_server_is_renewed_quietly(
    apiserver: FakeApiServer, kubeconfig: Path, bus: Bus, reader: Reader
) -> None:
    populate(apiserver)
    stream = await reader()
    settings = dataclasses.replace(FAST_KUBE, watch_timeout=1)
    async with running(bus, kube_source(kubeconfig, settings)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        await eventually(lambda: apiserver.count("pods", watch=True) >= 3, "watch renewed after its timeout")
        apiserver.create("pods", o.pod("after", "prod"))
        await eventually(lambda: pod_subject("after") in stream.current(), "pod after renewals")
        assert apiserver.count("pods", watch=False) == 1
        assert run.metric("palisade_watcher_errors_total", kind="pod", reason="stream") == 0
        assert not stream.statuses
