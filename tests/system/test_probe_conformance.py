"""`palisade connectivity probe` equals `palisade analyze` on every conformance case, with real packets.

One stack with an empty manifest folder; the x/y/z, a/b/c model's nine pods are created once at
their status.podIP addresses (10.0.<ns>.<pod>, outside the node's pool, so the ipBlock cases
judge pod addresses), with servers on every probed port. Each case of the NetworkPolicy and
Cilium policy suites is imported, probed with real TCP, UDP and SCTP packets (raw-socket SCTP
where the kernel has none), compared cell by cell with the engine's matrix, and withdrawn.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from palisade.v1 import datapath_pb2_grpc, policy_pb2_grpc
from services.cli.connectivity import ProbeRun
from services.common.manifests import Document
from services.policy.engine.analyze import Probe
from tests.policy import cnp_cases, knp_cases
from tests.policy.model import compute_matrix, mismatches, model_documents
from tests.system.stack import running_stack

pytestmark = [pytest.mark.root, pytest.mark.bcc]

PROBES = sorted(set(knp_cases.PROBES) | set(cnp_cases.PROBES))
CASES: dict[str, list[Any]] = {
    **{f"knp/{name}": policies for name, (policies, _) in knp_cases.CASES.items()},
    **{f"cnp/{name}": policies for name, (policies, _) in cnp_cases.CASES.items()},
}


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeRun]:
    probes = [Probe.parse(p) for p in PROBES]
    with (
        running_stack(tmp_path_factory.mktemp("conformance"), None) as stack,
        stack.channel("datapath") as dp_ch,
        stack.channel("policy") as pol_ch,
    ):
        run = ProbeRun(
            datapath_pb2_grpc.DatapathServiceStub(dp_ch), policy_pb2_grpc.PolicyServiceStub(pol_ch), timeout=1.5
        )
        try:
            docs = [Document(f"model[{i}]", d) for i, d in enumerate(model_documents())]
            run.create_pods(docs, probes)
            with run.servers(probes):
                yield run
        finally:
            run.close()


def test_pods_sit_at_their_manifest_addresses(probe_run: ProbeRun) -> None:
    got = {key: list(ep.ips) for key, ep in probe_run.endpoints.items()}
    want = {f"{d['metadata']['namespace']}/{d['metadata']['name']}": [d["status"]["podIP"]] for d in model_documents()
            if d["kind"] == "Pod"}  # fmt: skip
    assert got == want


@pytest.mark.parametrize("case", sorted(CASES))
def test_probe_equals_analyze(probe_run: ProbeRun, case: str) -> None:
    policies = [yaml.safe_load(p) if isinstance(p, str) else p for p in CASES[case]]
    probe_run.enforce(policies, origin=f"conformance {case}")
    try:
        matrices = probe_run.probe([Probe.parse(p) for p in PROBES])
    finally:
        probe_run.withdraw()
    bad = []
    for probe, matrix in zip(PROBES, matrices, strict=True):
        bad += [f"{probe} {line}" for line in mismatches(matrix, compute_matrix(policies, probe))]
    assert not bad, "real packets disagree with analyze:\n" + "\n".join(bad)
