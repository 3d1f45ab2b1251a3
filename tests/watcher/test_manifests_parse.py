"""Parsing manifest files into watched objects (pure), and the scan of a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.common.manifests import Document
from services.watcher.kinds import KINDS, Kind, lookup
from services.watcher.manifests import (
    DEV_CLUSTER_ORIGIN,
    ManifestError,
    ManifestSource,
    parse_file,
    schedule,
    to_objects,
)
from services.watcher.source import Listed, Problem
from tests.watcher import objects as o


@pytest.mark.parametrize(
    ("api_version", "kind", "expected"),
    [
        ("v1", "Pod", Kind.POD),
        ("v1", "Namespace", Kind.NAMESPACE),
        ("v1", "Node", Kind.NODE),
        ("networking.k8s.io/v1", "NetworkPolicy", Kind.NETWORK_POLICY),
        ("cilium.io/v2", "CiliumNetworkPolicy", Kind.CILIUM_NETWORK_POLICY),
        ("cilium.io/v2alpha1", "CiliumNetworkPolicy", Kind.CILIUM_NETWORK_POLICY),
        ("cilium.io/v2", "CiliumClusterwideNetworkPolicy", Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY),
        ("apps/v1", "Deployment", None),
        ("v1", "Service", Kind.SERVICE),
        ("discovery.k8s.io/v1", "EndpointSlice", Kind.ENDPOINT_SLICE),
        ("v1", "ConfigMap", None),
        ("extensions/v1beta1", "NetworkPolicy", None),
    ],
)
def test_kind_lookup(api_version: str, kind: str, expected: Kind | None) -> None:
    info = lookup(api_version, kind)
    assert (info.kind if info else None) == expected


def test_multi_document_yaml_with_defaults() -> None:
    pod = o.pod("web", app="web")
    del pod["metadata"]["namespace"]
    ns = o.namespace("prod")
    ns["metadata"]["namespace"] = "ignored"
    text = "---\n" + yaml.safe_dump(pod) + "---\n# only a comment\n---\n" + yaml.safe_dump(ns)
    parsed = parse_file("dir/web.yaml", text.encode())
    assert [(obj.key.kind, obj.key.namespace, obj.key.name) for obj in parsed.objects] == [
        (Kind.POD, "default", "web"),
        (Kind.NAMESPACE, "", "prod"),
    ]
    first = parsed.objects[0]
    assert first.origin == "dir/web.yaml"
    assert first.body["metadata"]["namespace"] == "default"
    assert first.uid and first.body["metadata"]["uid"] == first.uid
    assert "namespace" not in parsed.objects[1].body["metadata"]
    # The synthetic uid is stable: the same object in another run gets the same one.
    assert parse_file("other.yaml", text.encode()).objects[0].uid == first.uid


def test_lists_json_and_unwatched_kinds() -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [o.netpol("a"), {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}],
    }
    parsed = parse_file("all.json", json.dumps(doc).encode())
    assert [obj.key.name for obj in parsed.objects] == ["a"]
    assert parsed.ignored == ("apps/v1 Deployment d",)
    parsed = parse_file("arr.json", json.dumps([o.pod("x"), o.pod("y")]).encode())
    assert [obj.key.name for obj in parsed.objects] == ["x", "y"]


def test_the_manifest_uid_is_kept() -> None:
    pod = o.pod("web")
    pod["metadata"]["uid"] = "given"
    assert parse_file("p.yaml", yaml.safe_dump(pod).encode()).objects[0].uid == "given"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad.yaml",
            "kind: Pod\nmetadata: [oops\n",
            "^bad.yaml: not valid YAML or JSON at line 3.*at line 2, column 11",
        ),
        ("bad.json", '{"kind": "Pod",', "^bad.json: not valid JSON at line 1"),
        ("scalar.yaml", "just a string\n", "^scalar.yaml: expected an object .* got str"),
        (
            "noname.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {}\n",
            r"^noname.yaml \(Pod\): metadata.name is required",
        ),
        ("nokind.yaml", "apiVersion: v1\nmetadata: {name: x}\n", "apiVersion and kind are required"),
        ("ns.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: [a]}\n", "metadata.namespace"),
        (
            "second.yaml",
            yaml.safe_dump(o.pod("ok")) + "---\n- 1\n",
            r"^second.yaml\[1\]\[0\]: expected an object .* got int",
        ),
        ("list.yaml", "kind: List\nitems: [{apiVersion: v1}]\n", r"^list.yaml.items\[0\]: apiVersion and kind"),
    ],
)
def test_bad_files_say_where_and_why(name: str, text: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_file(name, text.encode())


def test_not_utf8() -> None:
    with pytest.raises(ManifestError, match="UTF-8"):
        parse_file("bin.yaml", b"\xff\xfe\x00")


def test_scan_emits_only_on_change_and_versions_move_only_with_content(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(o.pod("a", "prod")))
    source = ManifestSource(tmp_path)
    first = source.scan()
    assert [type(e) for e in first] == [Listed] * len(KINDS)
    pods = next(e for e in first if isinstance(e, Listed) and e.kind is Kind.POD).objects
    rv = pods[0].resource_version
    assert source.scan() == []  # nothing changed

    (tmp_path / "b.yaml").write_text(yaml.safe_dump(o.pod("b", "prod")))
    listed = {e.kind: e for e in source.scan() if isinstance(e, Listed)}
    by_name = {obj.key.name: obj for obj in listed[Kind.POD].objects}
    assert by_name["a"].resource_version == rv
    assert int(by_name["b"].resource_version) > int(rv)

    (tmp_path / "b.yaml").write_text("metadata: [\n")
    events = source.scan()
    assert [type(e) for e in events] == [Problem]
    assert isinstance(events[0], Problem) and events[0].origin == "b.yaml"
    (tmp_path / "b.yaml").unlink()
    events = source.scan()
    assert isinstance(events[0], Problem) and events[0].message == ""  # cleared
    pods = next(e for e in events if isinstance(e, Listed) and e.kind is Kind.POD).objects
    assert [obj.key.name for obj in pods] == ["a"]


def test_a_file_change_serializes_only_the_objects_it_brought(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cluster of many pods in many files: one file written must not cost a pass of every object.
    for i in range(5):
        (tmp_path / f"f{i}.yaml").write_text(yaml.safe_dump_all([o.pod(f"p{i}-{j}", "prod") for j in range(20)]))
    source = ManifestSource(tmp_path)
    source.scan()
    dumped: list[object] = []
    real = json.dumps

    def counting(obj: object, **kw: object) -> str:
        dumped.append(obj)
        return real(obj, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr("services.watcher.manifests.json.dumps", counting)
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(o.pod("late", "prod")))
    listed = {e.kind: e for e in source.scan() if isinstance(e, Listed)}
    assert len(listed[Kind.POD].objects) == 101
    assert [d["metadata"]["name"] for d in dumped if isinstance(d, dict)] == ["late"]


def test_a_vanished_folder_is_reported_and_keeps_the_objects(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "a.yaml").write_text(yaml.safe_dump(o.pod("a")))
    source = ManifestSource(folder)
    assert source.scan()
    (folder / "a.yaml").unlink()
    folder.rmdir()
    events = source.scan()
    assert len(events) == 1 and isinstance(events[0], Problem) and "does not exist" in events[0].message
    assert source.scan() == []


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a.*.>"}}, "metadata.name"),
        ({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x" * 100_000}}, "metadata.name"),
        (
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "../../etc"}},
            "metadata.namespace",
        ),
        ({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "Shop_NS!"}}, "metadata.name"),
        (
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "labels": {"a b": "x"}}},
            "metadata.labels key",
        ),
        (
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "labels": {"app": "x\n"}}},
            "metadata.labels[app]",
        ),
        (
            {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "a b c"}, "spec": {}},
            "metadata.name",
        ),
    ],
)
def test_names_kubernetes_refuses_reject_the_file_naming_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_file("bad.yaml", yaml.safe_dump(doc).encode())
    assert err.value.message.startswith("bad.yaml") and field in err.value.message
    assert len(err.value.message) < 1000


def test_a_dev_cluster_source_binds_pods_and_registers_its_nodes() -> None:
    """With dev nodes the source plays scheduler and kubelet: pods naming none of them get one
    (stable, spread by name), pods naming one keep it, and each node gets a Node object with
    its address unless the folder defines it."""
    docs = [o.pod(f"p{i}", "prod") for i in range(12)]
    docs[0]["spec"]["nodeName"] = "dev-node-2"
    docs[1]["spec"]["nodeName"] = "elsewhere"
    defined = o.node("dev-node-3")
    parsed = to_objects([Document(f"f[{i}]", d) for i, d in enumerate([*docs, defined])], "f.yaml")
    objects = {obj.key: obj for obj in parsed.objects}
    nodes = {"dev-node-1": "172.31.255.10", "dev-node-2": "172.31.255.11", "dev-node-3": "172.31.255.12"}
    out = schedule(objects, nodes)
    placed = {k.name: v.body["spec"]["nodeName"] for k, v in out.items() if k.kind is Kind.POD}
    assert placed["p0"] == "dev-node-2"
    assert set(placed.values()) == set(nodes), "spread over every node"
    assert schedule(objects, nodes) == out, "stable"
    registered = {k.name: v for k, v in out.items() if k.kind is Kind.NODE}
    assert set(registered) == set(nodes)
    assert registered["dev-node-3"] is objects[next(k for k in objects if k.kind is Kind.NODE)]
    assert registered["dev-node-1"].body["status"]["addresses"] == [{"type": "InternalIP", "address": "172.31.255.10"}]
    assert registered["dev-node-1"].origin == DEV_CLUSTER_ORIGIN
