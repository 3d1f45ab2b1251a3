"""Conformance, three nodes joined by the datapaths' VXLAN: real packets equal analyze (conformance.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.cli.connectivity import ProbeRun
from tests.system.conformance import cases_of, check_case, check_pods, probe_run

pytestmark = [pytest.mark.root, pytest.mark.bcc]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeRun]:
    yield from probe_run("tunnel", tmp_path_factory)


def test_pods_sit_at_their_manifest_addresses_spread_over_the_nodes(run: ProbeRun) -> None:
    check_pods(run)


@pytest.mark.parametrize("case", cases_of("tunnel"))
def test_probe_equals_analyze_through_the_tunnel(run: ProbeRun, case: str) -> None:
    check_case(run, case)
