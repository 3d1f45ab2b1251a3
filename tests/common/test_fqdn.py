"""The one matcher of DNS names: validation, normal form and matching (Cilium's matchpattern)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.fqdn import FqdnError, matches, normalize, selects_any, validate_name, validate_pattern


@pytest.mark.parametrize(
    ("selector", "name", "expected"),
    [
        # matchName: exactly that name, any case, with or without the trailing dot
        ("api.example.test", "api.example.test", True),
        ("api.example.test", "API.Example.Test.", True),
        ("api.example.test", "example.test", False),
        ("api.example.test", "x.api.example.test", False),
        ("api.example.test", "api.example.test.evil", False),
        # "*" alone: every name
        ("*", "example.test", True),
        ("*", "a.b.c.example.test", True),
        ("*", "localhost", True),
        # "*." : exactly one label, never the bare domain nor deeper names
        ("*.example.test", "api.example.test", True),
        ("*.example.test", "API.example.test.", True),
        ("*.example.test", "example.test", False),
        ("*.example.test", "a.b.example.test", False),
        ("*.example.test", "api.example.test.other", False),
        ("*.example.test", "apiexample.test", False),
        # "*" inside a label: any run of label characters, never a dot
        ("api-*.example.test", "api-1.example.test", True),
        ("api-*.example.test", "api-.example.test", True),
        ("api-*.example.test", "api-1.x.example.test", False),
        ("special*service.api.test", "special-b-service.api.test", True),
        ("special*service.api.test", "special.service.api.test", False),
        ("*.*.example.test", "a.b.example.test", True),
        ("*.*.example.test", "a.example.test", False),
        ("sub.*.example.test", "sub.eu.example.test", True),
        # "**." (Cilium 1.18): one or more whole labels
        ("**.example.test", "a.example.test", True),
        ("**.example.test", "a.b.c.example.test", True),
        ("**.example.test", "example.test", False),
        ("**.example.test", "a.example.other", False),
        # names that are not DNS names are selected by nothing
        ("*", "a..b", False),
        ("*", "", False),
        ("*.example.test", "a b.example.test", False),
    ],
)
def test_matches(selector: str, name: str, expected: bool) -> None:
    assert matches(selector, name) is expected


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("API.Example.Test.", "api.example.test"),
        ("  api.example.test  ", "api.example.test"),
        ("under_score.example.test", "under_score.example.test"),
    ],
)
def test_names_are_normalized(text: str, normal: str) -> None:
    assert validate_name(text) == normal
    assert validate_pattern(text) == normal


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        (".", "empty"),
        ("a..b", "empty label"),
        (".a.b", "empty label"),
        ("a/b.test", "'/'"),
        ("*.example.test", "'*'"),  # a wildcard is a matchPattern, not a matchName
        ("a b.test", "' '"),
        ("x" * 64 + ".test", "longer than 63"),
        ("a." * 127 + "test", "longer than 253"),
    ],
)
def test_invalid_names(text: str, message: str) -> None:
    with pytest.raises(FqdnError, match=re.escape(message)):
        validate_name(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("*..example.test", "empty label"),
        ("[a-z].example.test", "'[]'"),
        ("a+.example.test", "'+'"),
        ("{a,b}.example.test", "',{}'"),
        ("a.**.example.test", "only allowed as the whole first label"),
        ("**", "must be followed by a domain"),
        ("x**.example.test", "only allowed as the whole first label"),
    ],
)
def test_invalid_patterns(text: str, message: str) -> None:
    with pytest.raises(FqdnError, match=re.escape(message)):
        validate_pattern(text)


@pytest.mark.parametrize("text", ["*", "*.example.test", "**.example.test", "api-*.example.test", "*.*.test"])
def test_valid_patterns(text: str) -> None:
    assert validate_pattern(text) == text


def test_selects_any_names_the_first_matching_selector() -> None:
    assert selects_any(("a.test", "*.example.test", "*"), "api.example.test") == "*.example.test"
    assert selects_any(("a.test",), "b.test") is None


_LABEL = st.from_regex(r"[a-z0-9_][-a-z0-9_]{0,10}", fullmatch=True)
_NAME = st.lists(_LABEL, min_size=1, max_size=5).map(".".join)


@given(_NAME)
def test_a_name_selects_itself_in_every_spelling(name: str) -> None:
    selector = validate_name(name)
    assert matches(selector, name)
    assert matches(selector, name.upper() + ".")
    assert matches("*", name)


@given(_NAME, _NAME)
def test_a_name_selects_no_other_name(name: str, other: str) -> None:
    assert matches(validate_name(name), other) is (normalize(name) == normalize(other))


@given(_LABEL, _NAME, _NAME)
def test_star_dot_selects_exactly_one_more_label(label: str, domain: str, deeper: str) -> None:
    pattern = validate_pattern(f"*.{domain}")
    assert matches(pattern, f"{label}.{domain}")
    assert not matches(pattern, domain)
    assert not matches(pattern, f"{deeper}.{label}.{domain}")


@given(st.lists(_LABEL, min_size=1, max_size=4), _NAME)
def test_double_star_selects_every_deeper_name(labels: list[str], domain: str) -> None:
    pattern = validate_pattern(f"**.{domain}")
    assert matches(pattern, ".".join([*labels, domain]))
    assert not matches(pattern, domain)


@given(_NAME, st.text(alphabet="-a*z0.", max_size=12))
def test_a_pattern_matches_like_its_regular_expression(name: str, tail: str) -> None:
    """Against the regular expression Cilium builds (ToAnchoredRegexp), for patterns that validate."""
    try:
        pattern = validate_pattern(f"{tail}x.{name}" if tail else name)
    except FqdnError:
        return
    if "**" in pattern:
        return  # Cilium 1.18's multi-label form, tested above
    body = pattern.replace(".", "[.]").replace("*", "[-a-zA-Z0-9_]*")
    for candidate in (name, f"x.{name}", f"ax.{name}", f"a-x.{name}", f"a.x.{name}"):
        assert matches(pattern, candidate) is (re.fullmatch(body, candidate) is not None)
