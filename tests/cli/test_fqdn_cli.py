"""`palisade fqdn cache list`, `fqdn names` and names in `observe`: flags, rows and JSON. Pure."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import common_pb2, datapath_pb2
from services.cli.client import CLIError
from services.cli.fqdn import cache_json, cache_request, cache_rows, selector_rows, selectors_json
from services.cli.main import build_parser
from services.cli.observe import flow_filter, line


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_cache_list_flags_become_the_request() -> None:
    assert cache_request(_args("fqdn", "cache", "list")) == datapath_pb2.ListFqdnCacheRequest()
    got = cache_request(_args("fqdn", "cache", "list", "--name", "*.Example.TEST.", "--pod", "x/a"))
    assert got.name == "*.example.test"
    assert (got.endpoint.namespace, got.endpoint.pod, got.endpoint.id) == ("x", "a", 0)
    assert cache_request(_args("fqdn", "cache", "list", "--endpoint", "12")).endpoint.id == 12
    assert cache_request(_args("fqdn", "cache", "list", "--endpoint", "x/b")).endpoint.pod == "b"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--name", "a..b"], "--name: pattern 'a..b' has an empty label"),
        (["--name", "a.**.b"], "--name: pattern 'a.**.b': '**' is only allowed as the whole first label"),
        (["--pod", "a"], "--pod 'a': give NAMESPACE/POD"),
        (["--pod", "x/a/b"], "--pod 'x/a/b': give NAMESPACE/POD"),
        (["--endpoint", "x/"], "--endpoint: endpoint 'x/': give its numeric id or NAMESPACE/POD"),
        (["--endpoint", "1", "--pod", "x/a"], "--endpoint and --pod both name an endpoint: give one"),
    ],
)
def test_bad_cache_list_flags_are_errors_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(CLIError) as err:
        cache_request(_args("fqdn", "cache", "list", *argv))
    assert str(err.value).startswith(message) and err.value.code == 2


def _cache() -> list[datapath_pb2.ListFqdnCacheResponse]:
    expires = Timestamp(seconds=1_800_000_000)
    a1 = datapath_pb2.FqdnAddress(
        ip="192.0.2.1", identity=33554432, ttl_seconds=30, expires=expires, endpoint_ids=[4, 7], pods=["x/a", "x/b"]
    )
    a2 = datapath_pb2.FqdnAddress(ip="192.0.2.2", identity=33554433, ttl_seconds=0, endpoint_ids=[9])  # pod gone
    return [
        datapath_pb2.ListFqdnCacheResponse(
            node="n1", names=[datapath_pb2.FqdnName(name="api.example.test", addresses=[a1, a2])]
        ),
        datapath_pb2.ListFqdnCacheResponse(node="n2"),
    ]


def test_cache_rows_one_per_node_name_and_address() -> None:
    assert cache_rows(_cache()) == [
        ("n1", "api.example.test", "192.0.2.1", 33554432, "30s", "x/a,x/b"),
        ("n1", "api.example.test", "192.0.2.2", 33554433, "0s", "9"),
    ]


def test_cache_json_names_each_node() -> None:
    names: list[dict[str, Any]] = cache_json(_cache())["names"]  # type: ignore[assignment]
    (entry,) = names
    assert entry["node"] == "n1" and entry["name"] == "api.example.test"
    first = entry["addresses"][0]
    assert first["ip"] == "192.0.2.1" and first["ttl_seconds"] == 30 and first["pods"] == ["x/a", "x/b"]
    assert first["expires"] == "2027-01-15T08:00:00Z" and first["endpoint_ids"] == ["4", "7"]


def test_selector_rows_and_json() -> None:
    answers = [
        datapath_pb2.ListFqdnSelectorsResponse(
            node="n1",
            selectors=[
                datapath_pb2.FqdnSelector(
                    selector="*.example.test",
                    selected=[datapath_pb2.FqdnSelected(identity=33554432, ip="192.0.2.1", names=["api.example.test"])],
                    endpoint_ids=[4],
                    pods=["x/a"],
                ),
                datapath_pb2.FqdnSelector(selector="**.none.test", endpoint_ids=[4], pods=["x/a"]),
            ],
        )
    ]
    assert selector_rows(answers) == [
        ("n1", "*.example.test", 33554432, "192.0.2.1", "api.example.test", "x/a"),
        ("n1", "**.none.test", "-", "-", "-", "x/a"),
    ]
    data = selectors_json(answers)["selectors"]
    assert [(s["node"], s["selector"]) for s in data] == [("n1", "*.example.test"), ("n1", "**.none.test")]  # type: ignore[attr-defined]


def test_observe_shows_a_learned_destination_by_its_names() -> None:
    ev = datapath_pb2.FlowEvent(
        node="n1",
        verdict=common_pb2.VERDICT_ALLOW,
        direction=common_pb2.DIRECTION_EGRESS,
        source_pod="x/a",
        source_ip="10.0.0.4",
        source_port=40000,
        destination_ip="192.0.2.1",
        destination_port=443,
        destination_identity=33554432,
        destination_names=["api.example.test", "www.example.test"],
        protocol=common_pb2.PROTOCOL_TCP,
    )
    assert "x/a:40000 (id 0) -> api.example.test,www.example.test (192.0.2.1):443 (id 33554432) TCP" in line(ev)
    del ev.destination_names[:]
    assert "-> 192.0.2.1:443 (id 33554432) TCP" in line(ev)


def test_observe_fqdn_filter() -> None:
    assert list(flow_filter(_args("observe", "--fqdn", "*.Example.test", "--fqdn", "a.test")).fqdns) == [
        "*.example.test",
        "a.test",
    ]
    with pytest.raises(CLIError) as err:
        flow_filter(_args("observe", "--fqdn", "bad name"))
    assert str(err.value).startswith("--fqdn: pattern 'bad name'")
    assert err.value.code == 2
