"""The object cache turns source events into the deltas that keep the bus equal to the source (pure)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.watcher import cache as cache_module
from services.watcher.cache import Change, ObjectCache, Op
from services.watcher.kinds import BY_KIND, Kind
from services.watcher.objects import KObject, from_api
from tests.watcher import objects as o


def pod(name: str, rv: int = 1, **labels: str) -> KObject:
    body: dict[str, Any] = o.pod(name, "prod", **labels)
    body["metadata"]["uid"] = f"uid-{name}"
    body["metadata"]["resourceVersion"] = str(rv)
    return from_api(BY_KIND[Kind.POD], body)


def summary(changes: list[Change]) -> list[tuple[str, str]]:
    return [(c.op.value, c.obj.key.name) for c in changes]


def test_upsert_publishes_new_and_changed_objects_and_skips_noise() -> None:
    cache = ObjectCache()
    assert summary(cache.upsert(pod("a")).changes) == [("upsert", "a")]
    noisy = pod("a", rv=2)
    diff = cache.upsert(noisy)
    assert diff.changes == [] and diff.skipped == 1
    assert summary(cache.upsert(pod("a", rv=3, tier="x")).changes) == [("upsert", "a")]
    assert cache.count(Kind.POD) == 1


def test_delete_publishes_a_tombstone_with_the_last_state_once() -> None:
    cache = ObjectCache()
    cache.upsert(pod("a"))
    last = pod("a", rv=5, tier="x")
    diff = cache.delete(last)
    assert diff.changes == [Change(Op.DELETE, last)]
    assert cache.delete(last).changes == []  # unknown objects have nothing to tombstone
    assert cache.count(Kind.POD) == 0


def test_replace_diffs_a_full_list_against_the_store() -> None:
    cache = ObjectCache()
    for name in ("a", "b", "c", "d"):
        cache.upsert(pod(name))
    cache.upsert(from_api(BY_KIND[Kind.NAMESPACE], o.namespace("prod")))
    diff = cache.replace(Kind.POD, [pod("a", rv=9), pod("b", rv=9, changed="1"), pod("e")])
    assert summary(diff.changes) == [("upsert", "b"), ("upsert", "e"), ("delete", "c"), ("delete", "d")]
    assert diff.skipped == 1
    # Other kinds are not touched by a list of pods.
    assert cache.count(Kind.NAMESPACE) == 1


def test_a_listing_repeating_the_stored_objects_costs_no_view_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ObjectCache()
    stored = [pod(f"p{i}") for i in range(50)]
    cache.replace(Kind.POD, stored)
    viewed: list[str] = []
    real = cache_module._view

    def counting(obj: KObject) -> dict[str, object]:
        viewed.append(obj.key.name)
        return real(obj)

    monkeypatch.setattr(cache_module, "_view", counting)
    changed = pod("p7", rv=2, tier="x")
    diff = cache.replace(Kind.POD, [*stored[:7], changed, *stored[8:], pod("new")])
    assert summary(diff.changes) == [("upsert", "p7"), ("upsert", "new")] and diff.skipped == 49
    assert sorted(viewed) == ["new", "p7"]  # the 49 objects stored as they are: not looked at again


def test_seeded_objects_are_compared_not_republished() -> None:
    cache = ObjectCache()
    cache.seed(pod("kept"))
    cache.seed(pod("gone"))
    diff = cache.replace(Kind.POD, [pod("kept", rv=100)])
    assert summary(diff.changes) == [("delete", "gone")]


def test_a_recreated_object_is_an_upsert_with_its_new_uid() -> None:
    cache = ObjectCache()
    cache.upsert(pod("a"))
    recreated = pod("a", rv=7)
    recreated = KObject(
        recreated.info,
        recreated.key,
        "uid-new",
        "7",
        {**recreated.body, "metadata": {**recreated.body["metadata"], "uid": "uid-new"}},
    )
    assert summary(cache.replace(Kind.POD, [recreated]).changes) == [("upsert", "a")]


@pytest.mark.parametrize("n", [0, 1, 50])
def test_replace_with_nothing_tombstones_everything(n: int) -> None:
    cache = ObjectCache()
    for i in range(n):
        cache.seed(pod(f"p{i}"))
    assert [c.op for c in cache.replace(Kind.POD, []).changes] == [Op.DELETE] * n


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.booleans(), st.sampled_from(["x", "y"])),
        max_size=30,
    )
)
def test_applying_the_deltas_reproduces_the_source(events: list[tuple[str, bool, str]]) -> None:
    """Whatever the event sequence, a consumer applying the deltas ends with the source's relevant state."""
    cache = ObjectCache()
    source: dict[str, KObject] = {}
    consumer: dict[str, dict[str, Any]] = {}
    rv = 0
    for name, present, label in events:
        rv += 1
        if present:
            obj = pod(name, rv=rv, v=label)
            source[name] = obj
            changes = cache.upsert(obj).changes
        elif name in source:
            changes = cache.delete(source.pop(name)).changes
        else:
            continue
        for change in changes:
            if change.op is Op.UPSERT:
                consumer[name] = copy.deepcopy(dict(change.obj.body))
            else:
                consumer.pop(name)
    # A final relist changes nothing once the events are applied.
    assert cache.replace(Kind.POD, list(source.values())).changes == []
    assert {n: b["metadata"]["labels"] for n, b in consumer.items()} == {
        n: dict(obj.body["metadata"]["labels"]) for n, obj in source.items()
    }
