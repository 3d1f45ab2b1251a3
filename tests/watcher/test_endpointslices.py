"""A dev cluster's EndpointSlices: what the controller would keep, derived from the folder and pod addresses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from services.common.k8sobjects import SERVICE_NAME_LABEL
from services.watcher.clusterips import assign_cluster_ips
from services.watcher.endpointslices import with_endpoint_slices
from services.watcher.kinds import Kind, lookup
from services.watcher.manifests import ManifestSource, synthetic_uid
from services.watcher.objects import KObject, ObjectKey, from_api
from services.watcher.source import Listed

Obj = dict[str, Any]


def pod(name: str, ports: list[Obj] | None = None, ns: str = "prod", deleting: bool = False, **labels: str) -> Obj:
    meta: Obj = {"name": name, "namespace": ns, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-25T00:00:00Z"
    container = {"name": "c", "image": "x", "ports": ports or []}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": "n1", "containers": [container]}}


def service(name: str = "web", ns: str = "prod", selector: Obj | None = None, ports: list[Obj] | None = None) -> Obj:
    spec: Obj = {"ports": ports or [{"name": "http", "port": 80, "targetPort": "http"}]}
    if selector is not None:
        spec["selector"] = selector
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def objects(*bodies: Obj) -> dict[ObjectKey, KObject]:
    out = {}
    for body in bodies:
        info = lookup(body["apiVersion"], body["kind"])
        assert info is not None
        obj = from_api(info, body)
        out[obj.key] = obj
    return out


def slices(result: dict[ObjectKey, KObject]) -> list[Any]:
    return [o.body for k, o in sorted(result.items(), key=lambda i: i[0].name) if k.kind is Kind.ENDPOINT_SLICE]


HTTP = [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]


def test_selected_pods_with_addresses_are_endpoints_grouped_by_their_resolved_ports() -> None:
    given = objects(
        service(selector={"app": "web"}),
        pod("a", HTTP, app="web"),
        pod("b", [{"name": "http", "containerPort": 9090}], app="web"),  # the name resolves to another port
        pod("c", HTTP, app="web"),  # no address yet: not running
        pod("d", HTTP, app="db"),  # not selected
        pod("e", HTTP, ns="dev", app="web"),  # another namespace
    )
    addresses = {("prod", "a"): ("10.0.0.1",), ("prod", "b"): ("10.0.0.2", "fd00::2"), ("prod", "d"): ("10.0.0.4",)}
    got = slices(with_endpoint_slices(given, addresses, synthetic_uid))
    summary = sorted(
        (s["addressType"], s["ports"][0]["port"], [e["addresses"][0] for e in s["endpoints"]]) for s in got
    )
    assert summary == [("IPv4", 8080, ["10.0.0.1"]), ("IPv4", 9090, ["10.0.0.2"]), ("IPv6", 9090, ["fd00::2"])]
    for s in got:
        assert s["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
        assert s["metadata"]["uid"] and s["metadata"]["namespace"] == "prod"
        assert all(e["conditions"]["ready"] and e["nodeName"] == "n1" for e in s["endpoints"])


def test_a_pod_without_the_named_port_is_left_out_and_numbers_pass_through() -> None:
    svc = service(
        selector={"app": "web"},
        ports=[{"name": "http", "port": 80, "targetPort": "http"}, {"name": "raw", "port": 81, "targetPort": 7000}],
    )
    given = objects(svc, pod("a", [], app="web"))
    (got,) = slices(with_endpoint_slices(given, {("prod", "a"): ("10.0.0.1",)}, synthetic_uid))
    assert got["ports"] == [{"name": "raw", "port": 7000, "protocol": "TCP"}]


def test_terminating_pods_are_not_ready_and_user_slices_or_no_selector_are_left_alone() -> None:
    given = objects(service(selector={"app": "web"}), pod("a", HTTP, deleting=True, app="web"))
    (got,) = slices(with_endpoint_slices(given, {("prod", "a"): ("10.0.0.1",)}, synthetic_uid))
    assert got["endpoints"][0]["conditions"] == {"ready": False, "serving": False, "terminating": True}

    mine = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "mine", "namespace": "prod", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "endpoints": [],
    }
    given = objects(service(selector={"app": "web"}), pod("a", HTTP, app="web"), mine)
    assert [
        s["metadata"]["name"]
        for s in slices(with_endpoint_slices(given, {("prod", "a"): ("10.0.0.1",)}, synthetic_uid))
    ] == ["mine"]
    given = objects(service(), pod("a", HTTP, app="web"))
    assert slices(with_endpoint_slices(given, {("prod", "a"): ("10.0.0.1",)}, synthetic_uid)) == []


def test_the_manifest_source_of_a_dev_cluster_lists_slices_when_addresses_arrive(tmp_path: Path) -> None:
    (tmp_path / "app.yaml").write_text(
        yaml.safe_dump_all([service(selector={"app": "web"}), pod("a", HTTP, app="web")])
    )
    source = ManifestSource(tmp_path, dev_nodes={"n1": "172.31.255.2"}, service_cidr="10.96.0.0/16")
    first = {e.kind: e.objects for e in source.scan() if isinstance(e, Listed)}
    assert first[Kind.ENDPOINT_SLICE] == ()
    (svc,) = first[Kind.SERVICE]
    assert svc.body["spec"]["clusterIP"].startswith("10.96.")  # the API server's allocator's part
    assert source.scan() == []  # nothing changed
    source.set_pod_addresses("prod", "a", ("10.0.0.1",))
    second = {e.kind: e.objects for e in source.scan({("prod", "a"): ("10.0.0.1",)}) if isinstance(e, Listed)}
    (sl,) = second[Kind.ENDPOINT_SLICE]
    assert sl.body["endpoints"][0]["addresses"] == ["10.0.0.1"]
    assert sl.resource_version  # versioned like every listed object
    gone = {e.kind: e.objects for e in source.scan({}) if isinstance(e, Listed)}
    assert gone[Kind.ENDPOINT_SLICE] == ()


def test_an_address_change_alone_lists_the_slices_again_and_nothing_else(tmp_path: Path) -> None:
    docs = [service(selector={"app": "web"}), service("db", selector={"app": "db"})]
    docs += [pod("a", HTTP, app="web"), pod("b", HTTP, app="db")]
    (tmp_path / "app.yaml").write_text(yaml.safe_dump_all(docs))
    source = ManifestSource(tmp_path, dev_nodes={"n1": "172.31.255.2"}, service_cidr="10.96.0.0/16")
    source.scan()
    (listing,) = source.scan({("prod", "a"): ("10.0.0.1",), ("prod", "b"): ("10.0.0.2",)})
    assert isinstance(listing, Listed) and listing.kind is Kind.ENDPOINT_SLICE
    first = {s.body["metadata"]["labels"][SERVICE_NAME_LABEL]: s for s in listing.objects}
    assert sorted(first) == ["db", "web"]
    # Pod a goes: web's slice changes (a new version), db's stays as it was (its version kept).
    (event,) = source.scan({("prod", "b"): ("10.0.0.2",)})
    assert isinstance(event, Listed) and event.kind is Kind.ENDPOINT_SLICE
    (db,) = event.objects
    assert db.resource_version == first["db"].resource_version and db.body == first["db"].body
    # A file change after it lists every kind again, with the addresses as they are now.
    (tmp_path / "more.yaml").write_text(yaml.safe_dump(pod("c", HTTP, app="web")))
    listed = {e.kind: e.objects for e in source.scan() if isinstance(e, Listed)}
    assert {Kind.POD, Kind.SERVICE, Kind.ENDPOINT_SLICE} <= listed.keys() and len(listed[Kind.POD]) == 3
    assert [s.resource_version for s in listed[Kind.ENDPOINT_SLICE]] == [db.resource_version]


def test_cluster_ips_are_stable_unique_and_never_taken_from_written_ones() -> None:
    given = objects(
        service("a"),
        service("b"),
        {**service("fixed"), "spec": {"clusterIP": "10.96.0.5", "ports": []}},
        {**service("ext"), "spec": {"type": "ExternalName", "externalName": "example.com"}},
    )
    first = assign_cluster_ips(given, "10.96.0.0/29")  # 6 usable addresses: collisions are likely
    again = assign_cluster_ips(given, "10.96.0.0/29")
    ips = {k.name: o.body["spec"].get("clusterIP") for k, o in first.items()}
    assert ips == {k.name: o.body["spec"].get("clusterIP") for k, o in again.items()}
    assert ips["fixed"] == "10.96.0.5" and ips["ext"] is None
    assert len({ips["a"], ips["b"], ips["fixed"]}) == 3
    assert all(ip in {f"10.96.0.{i}" for i in range(1, 7)} for ip in (ips["a"], ips["b"]))
