"""Endpoint state directories survive a round trip and never leave half a file."""

from __future__ import annotations

import json
from pathlib import Path

from services.datapath.state import EndpointRecord, EndpointStore
from services.datapath.types import Address, Label, PortRecord


def record(ep_id: int = 7) -> EndpointRecord:
    return EndpointRecord(
        id=ep_id,
        namespace="x",
        pod="a",
        netns="/run/netns/pal_x_a",
        netns_owned=True,
        host_ifname="lxc0123456789ab",
        host_ifindex=42,
        addresses=(Address(ip="10.244.0.5", cidr="10.244.0.0/24", gateway="10.244.0.1", family=4),),
        labels=(Label("k8s", "app", "web"), Label("k8s", "io.kubernetes.pod.namespace", "x")),
        identity_owned=True,
        identity=256,
        ports=(PortRecord(name="http", port=80, protocol=6),),
        created_at=1.5,
    )


def test_round_trip(tmp_path: Path) -> None:
    store = EndpointStore(tmp_path)
    store.prepare()
    store.save(record(7))
    store.save(record(3))
    loaded, errors = store.load_all()
    assert errors == []
    assert [r.id for r in loaded] == [3, 7]
    assert loaded[1] == record(7)
    assert loaded[1].owner == "pod/x/a"


def test_unreadable_and_incomplete_state_is_reported_not_restored(tmp_path: Path) -> None:
    store = EndpointStore(tmp_path)
    store.save(record(1))
    (tmp_path / "2").mkdir()  # created, never completed
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "endpoint.json").write_text("{not json")
    bad = record(4).to_json()
    bad["version"] = 99
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "endpoint.json").write_text(json.dumps(bad))
    loaded, errors = store.load_all()
    assert [r.id for r in loaded] == [1]
    messages = " ".join(str(e) for e in errors)
    assert "never completed" in messages and "unreadable" in messages and "version 99" in messages


def test_remove(tmp_path: Path) -> None:
    store = EndpointStore(tmp_path)
    store.save(record(5))
    store.remove(5)
    assert store.load_all() == ([], [])
    assert not (tmp_path / "5").exists()
