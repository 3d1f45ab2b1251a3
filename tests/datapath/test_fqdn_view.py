"""The DNS proxy's view of what it learned: built from the cache, filtered, carried as JSON. Pure."""

from __future__ import annotations

import pytest

from services.common.fqdn import FqdnError
from services.datapath.fqdncache import CacheLimits, NameCache
from services.datapath.fqdnmaps import NameEndpoint
from services.datapath.fqdnview import NamesView, name_filter, view
from services.datapath.types import MIN_LOCAL_IDENTITY, FqdnRule, NameRules


def _endpoint(ep_id: int, *selectors: str) -> NameEndpoint:
    return NameEndpoint(
        ep_id, 1000 + ep_id, (f"10.0.0.{ep_id}",), NameRules(fqdn=tuple(FqdnRule(s) for s in selectors))
    )


@pytest.fixture
def names() -> NamesView:
    cache = NameCache(CacheLimits(min_ttl=5))
    cache.learn(1, "api.example.test", [("192.0.2.1", 30), ("192.0.2.2", 2)], now=100.0)
    cache.learn(2, "api.example.test", [("192.0.2.1", 60)], now=110.0)
    cache.learn(2, "cdn.other.test", [("198.51.100.7", 300), ("2001:db8::7", 300)], now=110.0)
    endpoints = [_endpoint(1, "*.example.test"), _endpoint(2, "*.example.test", "cdn.other.test", "**.none.test")]
    return view(cache, endpoints, now=120.0, wall=1_000_000.0)


def test_every_pair_with_its_identity_ttl_left_and_endpoints(names: NamesView) -> None:
    got = [(a.name, a.ip, a.ttl_left, a.expires, a.endpoints) for a in names.addresses]
    assert got == [
        # re-answered at 110 with 60 s: the later expiry holds; the 2 s answer was raised to 5 s
        ("api.example.test", "192.0.2.1", 50.0, 1_000_050.0, (1, 2)),
        ("api.example.test", "192.0.2.2", -15.0, 999_985.0, (1,)),
        ("cdn.other.test", "198.51.100.7", 290.0, 1_000_290.0, (2,)),
        ("cdn.other.test", "2001:db8::7", 290.0, 1_000_290.0, (2,)),
    ]
    assert len({a.identity for a in names.addresses}) == 4
    assert all(a.identity >= MIN_LOCAL_IDENTITY for a in names.addresses)


@pytest.mark.parametrize(
    ("selector", "endpoint", "expected"),
    [
        ("", None, ["192.0.2.1", "192.0.2.2", "198.51.100.7", "2001:db8::7"]),
        ("api.example.test", None, ["192.0.2.1", "192.0.2.2"]),
        ("*.example.test", None, ["192.0.2.1", "192.0.2.2"]),
        ("**.test", None, ["192.0.2.1", "192.0.2.2", "198.51.100.7", "2001:db8::7"]),
        ("*.test", None, []),
        ("", 1, ["192.0.2.1", "192.0.2.2"]),
        ("", 2, ["192.0.2.1", "198.51.100.7", "2001:db8::7"]),
        ("cdn.other.test", 1, []),
        ("", 3, []),
    ],
)
def test_select_by_name_or_pattern_and_endpoint(
    names: NamesView, selector: str, endpoint: int | None, expected: list[str]
) -> None:
    assert [a.ip for a in names.select(selector, endpoint)] == expected


def test_selections_hold_the_learned_identities_their_names_select(names: NamesView) -> None:
    ident = {a.ip: a.identity for a in names.addresses}
    got = [(s.selector, s.endpoints, s.selected) for s in names.selections()]
    assert got == [
        ("**.none.test", (2,), ()),
        (
            "*.example.test",
            (1, 2),
            (
                (ident["192.0.2.1"], "192.0.2.1", ("api.example.test",)),
                (ident["192.0.2.2"], "192.0.2.2", ("api.example.test",)),
            ),
        ),
        (
            "cdn.other.test",
            (2,),
            (
                (ident["198.51.100.7"], "198.51.100.7", ("cdn.other.test",)),
                (ident["2001:db8::7"], "2001:db8::7", ("cdn.other.test",)),
            ),
        ),
    ]


def test_names_of_an_address_in_any_spelling(names: NamesView) -> None:
    assert names.names_of("2001:0db8::0007") == ["cdn.other.test"]
    assert names.names_of("192.0.2.1") == ["api.example.test"]
    assert names.names_of("192.0.2.99") == [] and names.names_of("not an address") == []
    assert names.names_by_ip()["198.51.100.7"] == ["cdn.other.test"]


def test_the_view_survives_its_json(names: NamesView) -> None:
    assert NamesView.from_json(names.to_json()) == names
    with pytest.raises(ValueError, match="learned names format 9 is not 1"):
        NamesView.from_json({**names.to_json(), "format": 9})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("API.Example.test.", "api.example.test"), ("*.example.test", "*.example.test"), ("**.test", "**.test")],
)
def test_name_filters_take_names_and_patterns(text: str, expected: str) -> None:
    assert name_filter(text) == expected


@pytest.mark.parametrize("bad", ["exa mple.test", "a..b", "**", "a.**.b"])
def test_a_malformed_name_filter_is_an_error_naming_it(bad: str) -> None:
    with pytest.raises(FqdnError, match=repr(bad).replace("*", r"\*").replace(".", r"\.")):
        name_filter(bad)
