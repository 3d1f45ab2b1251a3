"""Kubernetes NetworkPolicy v1 semantics on the x/y/z model, judged offline by the engine.

The cases live in ``knp_cases``; tests/system probes the same cases with real packets.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.policy.knp_cases import CASES, PROBES


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_network_policy_matrix(case: str, probe: str, check_matrix: Any) -> None:
    policies, expect = CASES[case]
    port_text, proto = probe.split("/")
    check_matrix(policies, probe, lambda s, d: expect(int(port_text), proto, s, d))
