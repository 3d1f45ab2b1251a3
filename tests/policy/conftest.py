"""Fixtures for the policy engine tests: the upstream x/y/z, a/b/c pod model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest

from tests.policy.model import (
    Expect,
    compute_matrix,
    expected_matrix,
    mismatches,
)


@pytest.fixture
def check_matrix() -> Callable[[Iterable[Mapping[str, Any] | str], str, Expect], None]:
    """check_matrix(policies, "80/TCP", expect(src, dst) -> bool); self traffic always allowed."""

    def check(policies: Iterable[Mapping[str, Any] | str], probe: str, expect: Expect) -> None:
        got = compute_matrix(policies, probe)
        bad = mismatches(got, expected_matrix(expect))
        assert not bad, "\n".join(bad)

    return check
