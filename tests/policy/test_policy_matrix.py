"""Kubernetes NetworkPolicy v1 and CiliumNetworkPolicy / CiliumClusterwideNetworkPolicy L3/L4 semantics
on the x/y/z model, judged offline by the engine.

The cases live in ``knp_cases`` and ``cnp_cases``; tests/system probes the same cases with real packets.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.policy import cnp_cases, knp_cases

#: (kinds, case, probe): every case of each suite on each of its probes.
MATRIX = [
    pytest.param(suite.CASES[case], probe, id=f"{kinds}-{case}-{probe}")
    for kinds, suite in (("knp", knp_cases), ("cnp", cnp_cases))
    for case in sorted(suite.CASES)
    for probe in suite.PROBES
]


@pytest.mark.parametrize(("case", "probe"), MATRIX)
def test_policy_matrix(case: tuple[list[str], Any], probe: str, check_matrix: Any) -> None:
    policies, expect = case
    port_text, proto = probe.split("/")
    check_matrix(policies, probe, lambda s, d: expect(int(port_text), proto, s, d))
