"""Kubernetes' name, label and CIDR rules: pure tables."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.common.errors import Code, PalisadeError
from services.common.validation import (
    validate_cidr,
    validate_label_key,
    validate_label_value,
    validate_name,
    validate_namespace,
)

Check = Callable[[str, str], object]


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (validate_namespace, "default"),
        (validate_namespace, "team-a"),
        (validate_namespace, "a" * 63),
        (validate_name, "web-0"),
        (validate_name, "p-1.v2"),
        (validate_name, "a" * 253),
        (validate_label_key, "app"),
        (validate_label_key, "app.kubernetes.io/name"),
        (validate_label_key, "io.kubernetes.pod.namespace"),
        (validate_label_key, "A_b-c.D"),
        (validate_label_value, ""),
        (validate_label_value, "a-b_c.D"),
        (validate_label_value, "v" * 63),
        (validate_cidr, "10.0.0.0/8"),
        (validate_cidr, "10.0.0.5/32"),
        (validate_cidr, "2001:db8::/64"),
    ],
)
def test_kubernetes_accepts(check: Check, value: str) -> None:
    check(value, "field")


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (validate_namespace, ""),
        (validate_namespace, "Shop_NS!"),
        (validate_namespace, "a.*.>"),
        (validate_namespace, "../../etc"),
        (validate_namespace, "a b c"),
        (validate_namespace, "a.b"),
        (validate_namespace, "-a"),
        (validate_namespace, "a\n"),
        (validate_namespace, "a" * 64),
        (validate_name, ""),
        (validate_name, "Web"),
        (validate_name, "a_b"),
        (validate_name, "web."),
        (validate_name, "web\n"),
        (validate_name, "a" * 254),
        (validate_name, "x" * 100_000),
        (validate_label_key, ""),
        (validate_label_key, "bad key"),
        (validate_label_key, "app\n"),
        (validate_label_key, "a\0b"),
        (validate_label_key, "-app"),
        (validate_label_key, "/app"),
        (validate_label_key, "Example.com/app"),
        (validate_label_key, "example.com/"),
        (validate_label_key, "a" * 64),
        (validate_label_value, "-v"),
        (validate_label_value, "a b"),
        (validate_label_value, "v" * 64),
        (validate_label_value, "x" * 1_000_000),
        (validate_cidr, "10.0.0.0"),
        (validate_cidr, "10.0.0.0/33"),
        (validate_cidr, "ten/8"),
    ],
)
def test_kubernetes_refuses_with_the_field_named_and_the_value_clipped(check: Check, value: str) -> None:
    with pytest.raises(PalisadeError) as err:
        check(value, "spec.thing")
    assert err.value.code is Code.INVALID_ARGUMENT
    assert err.value.message.startswith("spec.thing ")
    assert len(err.value.message) < 600
