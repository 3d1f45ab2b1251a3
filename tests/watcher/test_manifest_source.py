"""The manifest-folder source in-process against a real NATS."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from palisade.v1 import common_pb2, k8s_pb2
from services.common.bus import Bus
from services.common.largeobjects import BUCKET
from services.common.subjects import k8s_subject
from services.watcher.kinds import KINDS
from services.watcher.manifests import ManifestSource
from tests.watcher import objects as o
from tests.watcher.helpers import StreamReader, eventually, manifest_source, running

Reader = Callable[[], Awaitable[StreamReader]]


def write(path: Path, *docs: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(list(docs)))


def layout(folder: Path) -> set[str]:
    """A folder with nesting, multi-document YAML, .yml, JSON Lists and an unwatched kind."""
    write(folder / "namespaces.yaml", o.namespace("prod", team="a"), o.namespace("default"))
    no_namespace = o.pod("lonely", app="x")
    del no_namespace["metadata"]["namespace"]
    write(folder / "apps" / "web.yml", o.pod("web", "prod", ip="10.0.0.5", app="web"), no_namespace)
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "prod"}}
    write(folder / "apps" / "deploy.yaml", deployment)
    policies = {"apiVersion": "v1", "kind": "List", "items": [o.netpol("deny", "prod"), o.cnp("allow", "prod")]}
    (folder / "policies").mkdir()
    (folder / "policies" / "all.json").write_text(json.dumps(policies))
    write(folder / "cluster" / "ccnp.yaml", o.ccnp("egress"), o.node("node-1"))
    (folder / "README.md").write_text("not a manifest")
    write(folder / ".hidden.yaml", o.pod("hidden", "prod"))
    return {
        k8s_subject("namespace", "", "prod"),
        k8s_subject("namespace", "", "default"),
        k8s_subject("pod", "prod", "web"),
        k8s_subject("pod", "default", "lonely"),
        k8s_subject("networkpolicy", "prod", "deny"),
        k8s_subject("ciliumnetworkpolicy", "prod", "allow"),
        k8s_subject("ciliumclusterwidenetworkpolicy", "", "egress"),
        k8s_subject("node", "", "node-1"),
    }


async def test_initial_sync_from_a_folder(manifests: Path, bus: Bus, reader: Reader) -> None:
    expected = layout(manifests)
    stream = await reader()
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        assert set(stream.current()) == expected
        assert len(stream.deltas) == len(expected)
        marker = stream.markers[0]
        assert marker.source == f"manifests:{manifests}"
        assert len(marker.kinds) == len(KINDS) and not marker.missing_kinds

        web = stream.last[k8s_subject("pod", "prod", "web")]
        assert web.origin == "apps/web.yml"
        assert web.source == f"manifests:{manifests}"
        assert web.uid and web.resource_version
        body = json.loads(web.object_json)
        assert body["metadata"]["uid"] == web.uid
        assert body["metadata"]["resourceVersion"] == web.resource_version
        assert body["status"]["podIP"] == "10.0.0.5"
        lonely = json.loads(stream.last[k8s_subject("pod", "default", "lonely")].object_json)
        assert lonely["metadata"]["namespace"] == "default"
        assert stream.last[k8s_subject("networkpolicy", "prod", "deny")].origin == "policies/all.json"

        status = common_pb2.ServiceStatus()
        run.watcher.fill_status(status)
        assert status.synced and status.details["objects.pod"] == "2"
        assert run.metric("palisade_watcher_events_received_total", kind="pod") == 2


async def test_adding_editing_and_removing_files(manifests: Path, bus: Bus, reader: Reader) -> None:
    write(manifests / "a.yaml", o.pod("a1", "prod", app="a"), o.pod("a2", "prod", app="a"))
    stream = await reader()
    a1, a2, b1 = (k8s_subject("pod", "prod", n) for n in ("a1", "a2", "b1"))
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: bool(stream.markers), "synced marker")
        first = stream.last[a1]

        write(manifests / "sub" / "b.yaml", o.pod("b1", "prod", app="b"))
        await eventually(lambda: b1 in stream.current(), "object of a new file")

        # A comment and reordered keys change nothing; then a real edit of another object.
        text = (manifests / "a.yaml").read_text()
        (manifests / "a.yaml").write_text("# a comment\n" + text)
        write(manifests / "sub" / "b.yaml", o.pod("b1", "prod", app="b", tier="db"))
        await eventually(lambda: stream.current()[b1]["metadata"]["labels"].get("tier") == "db", "edit")
        assert stream.ops(a1) == [k8s_pb2.DELTA_OP_UPSERT]

        write(manifests / "a.yaml", o.pod("a1", "prod", app="a", version="2"), o.pod("a2", "prod", app="a"))
        await eventually(lambda: len(stream.ops(a1)) == 2, "edited object")
        edited = stream.last[a1]
        assert edited.uid == first.uid
        assert int(edited.resource_version) > int(first.resource_version)
        assert stream.ops(a2) == [k8s_pb2.DELTA_OP_UPSERT]

        # Removing a document from a file deletes that object only.
        write(manifests / "a.yaml", o.pod("a1", "prod", app="a", version="2"))
        await eventually(lambda: a2 in stream.tombstones(), "tombstone of the removed document")
        assert a1 in stream.current()

        # Removing a file deletes its objects.
        (manifests / "sub" / "b.yaml").unlink()
        await eventually(lambda: b1 in stream.tombstones(), "tombstone of the removed file")
        assert json.loads(stream.last[b1].object_json)["metadata"]["labels"]["tier"] == "db"
        assert run.metric("palisade_watcher_deltas_published_total", kind="pod", op="delete") == 2


async def test_a_bad_file_is_reported_and_keeps_its_objects(manifests: Path, bus: Bus, reader: Reader) -> None:
    write(manifests / "good.yaml", o.pod("good", "prod"))
    write(manifests / "flaky.yaml", o.pod("flaky", "prod", app="v1"))
    (manifests / "broken-from-start.yaml").write_text("kind: Pod\nmetadata: [unclosed\n")
    stream = await reader()
    good, flaky = k8s_subject("pod", "prod", "good"), k8s_subject("pod", "prod", "flaky")
    async with running(bus, manifest_source(manifests)) as run:
        # A file broken from the start does not keep the others from syncing.
        await eventually(lambda: bool(stream.markers), "synced marker")
        assert {good, flaky} <= set(stream.current())
        await eventually(lambda: "broken-from-start.yaml" in stream.statuses[-1].errors, "status of the bad file")

        (manifests / "flaky.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata:\n  name: flaky\n  labels: {a: [\n")
        await eventually(lambda: "flaky.yaml" in stream.statuses[-1].errors, "status names the file")
        message = stream.statuses[-1].errors["flaky.yaml"]
        assert "flaky.yaml" in message and "line" in message and "fix the file" in message
        status = common_pb2.ServiceStatus()
        run.watcher.fill_status(status)
        assert "error.flaky.yaml" in status.details
        assert run.metric("palisade_watcher_errors_total", kind="", reason="parse") == 2

        # Everything else keeps working; the bad file's object stays as it was.
        write(manifests / "good.yaml", o.pod("good", "prod", edited="yes"))
        await eventually(lambda: "edited" in stream.current()[good]["metadata"]["labels"], "other file edited")
        assert stream.ops(flaky) == [k8s_pb2.DELTA_OP_UPSERT]
        assert stream.current()[flaky]["metadata"]["labels"] == {"app": "v1"}

        # A document without a name is as bad as broken YAML.
        (manifests / "flaky.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: {}\n")
        await eventually(lambda: "metadata.name" in stream.statuses[-1].errors.get("flaky.yaml", ""), "no name")
        assert stream.ops(flaky) == [k8s_pb2.DELTA_OP_UPSERT]

        # Fixing the file recovers.
        write(manifests / "flaky.yaml", o.pod("flaky", "prod", app="v2"))
        await eventually(lambda: stream.current()[flaky]["metadata"]["labels"] == {"app": "v2"}, "fixed file")
        await eventually(lambda: "flaky.yaml" not in stream.statuses[-1].errors, "error cleared")
        (manifests / "broken-from-start.yaml").unlink()
        await eventually(lambda: not stream.statuses[-1].errors, "all errors cleared")


async def test_restart_reconciles_against_the_stream(manifests: Path, bus: Bus, reader: Reader) -> None:
    write(manifests / "a.yaml", o.pod("keep", "prod"), o.pod("edit", "prod"), o.pod("drop", "prod"))
    write(manifests / "b.yaml", o.namespace("gone"))
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: run.watcher.synced.is_set(), "first run synced")
        await run.watcher.publisher.wait_idle()

    # While no watcher runs, the folder changes.
    write(manifests / "a.yaml", o.pod("keep", "prod"), o.pod("edit", "prod", changed="yes"), o.pod("new", "prod"))
    (manifests / "b.yaml").unlink()

    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: run.watcher.synced.is_set(), "second run synced")
        stream = await reader()
        await eventually(lambda: len(stream.markers) == 1, "replayed up to the marker")
        assert set(stream.current()) == {k8s_subject("pod", "prod", n) for n in ("keep", "edit", "new")}
        assert stream.tombstones() == {k8s_subject("pod", "prod", "drop"), k8s_subject("namespace", "", "gone")}
        assert stream.current()[k8s_subject("pod", "prod", "edit")]["metadata"]["labels"]["changed"] == "yes"
        # The unchanged object was recognised from the stream and not republished.
        assert run.metric("palisade_watcher_deltas_published_total", kind="pod", op="upsert") == 2
        assert run.metric("palisade_watcher_events_skipped_total", kind="pod") == 1


async def test_a_file_broken_across_a_restart_keeps_what_was_published(
    manifests: Path, bus: Bus, reader: Reader
) -> None:
    write(manifests / "deny.yaml", o.ccnp("deny-all"), o.netpol("deny", "prod"))
    write(manifests / "other.yaml", o.pod("web", "prod"))
    deny, netpol = (
        k8s_subject("ciliumclusterwidenetworkpolicy", "", "deny-all"),
        k8s_subject("networkpolicy", "prod", "deny"),
    )
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: run.watcher.synced.is_set(), "first run synced")
        await run.watcher.publisher.wait_idle()
        # Broken while running: the last good state stays (as before).
        (manifests / "deny.yaml").write_text("kind: [unclosed\n")
        await eventually(lambda: "deny.yaml" in run.watcher.reconciler.errors(), "broken file reported")

    # The restarted watcher never read the file whole: what the bus holds from it is its last good state.
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: run.watcher.synced.is_set(), "second run synced")
        await run.watcher.publisher.wait_idle()
        stream = await reader()
        await eventually(lambda: len(stream.markers) == 1, "replayed up to the marker")
        assert {deny, netpol} <= set(stream.current())
        assert stream.tombstones() == set()
        assert "fix the file" in run.watcher.reconciler.errors()["deny.yaml"]
        assert (
            run.metric("palisade_watcher_deltas_published_total", kind="ciliumclusterwidenetworkpolicy", op="delete")
            == 0
        )

        # Removing the broken file is a deletion like any other.
        (manifests / "deny.yaml").unlink()
        await eventually(lambda: stream.tombstones() == {deny, netpol}, "objects of the removed file deleted")
        await eventually(lambda: "deny.yaml" not in run.watcher.reconciler.errors(), "error cleared")


async def test_an_object_in_two_files_keeps_the_first_definition_and_is_an_error(
    manifests: Path, bus: Bus, reader: Reader
) -> None:
    write(manifests / "a.yaml", o.netpol("shared", "prod", app="from-a"))
    stream = await reader()
    subject = k8s_subject("networkpolicy", "prod", "shared")
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: run.watcher.synced.is_set(), "synced")
        await eventually(lambda: subject in stream.current(), "published")

        # A later file, even one earlier in path order, does not take the name over silently.
        write(manifests / "0-later.yaml", o.netpol("shared", "prod", app="from-later"))
        await eventually(lambda: "0-later.yaml: networkpolicy/prod/shared" in run.watcher.reconciler.errors(), "error")
        message = run.watcher.reconciler.errors()["0-later.yaml: networkpolicy/prod/shared"]
        assert "already defined in a.yaml" in message and "remove or rename" in message
        await eventually(lambda: bool(stream.last[subject].conflict), "conflict on the object")
        assert "also defined in 0-later.yaml" in stream.last[subject].conflict
        assert stream.current()[subject]["spec"]["podSelector"]["matchLabels"]["app"] == "from-a"
        status = common_pb2.ServiceStatus()
        run.watcher.fill_status(status)
        assert status.details["errors"] == "1"

        # Editing either file changes nothing about which one is in force.
        write(manifests / "0-later.yaml", o.netpol("shared", "prod", app="from-later-2"))
        write(manifests / "a.yaml", o.netpol("shared", "prod", app="from-a-2"))
        await eventually(
            lambda: stream.current()[subject]["spec"]["podSelector"]["matchLabels"]["app"] == "from-a-2", "edit"
        )

        # The definition in force removed: the other takes over, and the error clears.
        (manifests / "a.yaml").unlink()
        await eventually(
            lambda: stream.current()[subject]["spec"]["podSelector"]["matchLabels"]["app"] == "from-later-2",
            "took over",
        )
        await eventually(lambda: not run.watcher.reconciler.errors(), "error cleared")
        assert stream.last[subject].conflict == ""
        assert subject not in stream.tombstones()


def huge_ccnp(name: str, rules: int) -> dict[str, object]:
    """A CCNP of ``rules`` deny rules: several MB, more than the bus's maximum payload."""
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "db"}},
            "ingressDeny": [
                {
                    "fromCIDR": [f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}/32"],
                    "toPorts": [{"ports": [{"port": str(1 + i % 65000), "protocol": "TCP"}]}],
                }
                for i in range(rules)
            ],
        },
    }


async def test_an_object_larger_than_a_message_is_stored_aside_and_replaced_cleanly(
    manifests: Path, bus: Bus, reader: Reader
) -> None:
    big = huge_ccnp("big", 20_000)
    write(manifests / "big.yaml", big)
    assert (manifests / "big.yaml").stat().st_size > bus.max_payload
    write(manifests / "small.yaml", o.pod("web", "prod"))
    subject = k8s_subject("ciliumclusterwidenetworkpolicy", "", "big")
    stream = await reader()
    async with running(bus, manifest_source(manifests)) as run:
        await eventually(lambda: run.watcher.synced.is_set(), "synced", timeout=60)
        await eventually(lambda: subject in stream.last, "published", timeout=60)
        delta = stream.last[subject]
        assert delta.object_ref and not delta.object_json
        full = await run.watcher.large.resolve(delta)
        assert json.loads(full.object_json)["spec"] == big["spec"]
        assert not run.watcher.reconciler.errors() and run.watcher.publisher.pending == 0
        assert k8s_subject("pod", "prod", "web") in stream.current()

        # Replaced by a small object of the same name: published inline, the stored body deleted.
        write(manifests / "big.yaml", o.ccnp("big"))
        await eventually(lambda: not stream.last[subject].object_ref, "small version published", timeout=30)
        assert json.loads(stream.last[subject].object_json)["spec"] == o.ccnp("big")["spec"]
        store = await bus.js.object_store(BUCKET)
        await eventually_async(lambda: _stored_names(store), set(), "stored body deleted")

        # Large again, then the file removed: a tombstone and nothing left in the store.
        write(manifests / "big.yaml", big)
        await eventually(lambda: bool(stream.last[subject].object_ref), "large again", timeout=60)
        (manifests / "big.yaml").unlink()
        await eventually(lambda: subject in stream.tombstones(), "deleted", timeout=30)
        await eventually_async(lambda: _stored_names(store), set(), "stored body deleted with the object")


async def _stored_names(store: Any) -> set[str]:
    try:
        infos = await store.list(ignore_deletes=True)
    except Exception:  # an empty bucket lists as not found
        return set()
    return {i.name for i in infos if not i.deleted}


async def eventually_async(get: Callable[[], Awaitable[object]], wanted: object, what: str) -> None:
    for _ in range(500):
        if await get() == wanted:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


async def test_notifications_drive_the_scans_without_waiting_for_a_poll(
    manifests: Path, bus: Bus, reader: Reader
) -> None:
    # A poll every hour: whatever shows up within the test came through inotify.
    source = ManifestSource(manifests, poll_interval=3600, notified_poll_interval=3600)
    stream = await reader()
    async with running(bus, source):
        await eventually(lambda: bool(stream.markers), "synced marker")
        assert source.notified is True
        write(manifests / "a.yaml", o.netpol("a", "prod"))
        await eventually(lambda: k8s_subject("networkpolicy", "prod", "a") in stream.current(), "created")
        # A folder made after the start is watched too, and what lands in it is seen.
        (manifests / "team" / "deep").mkdir(parents=True)
        write(manifests / "team" / "deep" / "b.yaml", o.netpol("b", "prod"))
        await eventually(lambda: k8s_subject("networkpolicy", "prod", "b") in stream.current(), "in a new folder")
        # Edited in place, renamed into place (as editors and ConfigMaps do), deleted.
        write(manifests / "a.yaml", o.netpol("a", "prod", app="db"))
        await eventually(lambda: json.loads(stream.last[k8s_subject("networkpolicy", "prod", "a")].object_json)
                         ["spec"]["podSelector"]["matchLabels"] == {"app": "db"}, "edited")  # fmt: skip
        write(manifests / ".c.tmp", o.netpol("c", "prod"))
        (manifests / ".c.tmp").rename(manifests / "c.yaml")
        await eventually(lambda: k8s_subject("networkpolicy", "prod", "c") in stream.current(), "renamed in")
        (manifests / "team" / "deep" / "b.yaml").unlink()
        await eventually(lambda: k8s_subject("networkpolicy", "prod", "b") not in stream.current(), "deleted")


async def test_without_notifications_the_folder_is_polled(manifests: Path, bus: Bus, reader: Reader) -> None:
    source = ManifestSource(manifests, poll_interval=0.05, notify=False)
    stream = await reader()
    async with running(bus, source):
        await eventually(lambda: bool(stream.markers), "synced marker")
        assert source.notified is False
        write(manifests / "a.yaml", o.netpol("a", "prod"))
        await eventually(lambda: k8s_subject("networkpolicy", "prod", "a") in stream.current(), "created")
