"""The conformance run: `palisade connectivity probe` equals `palisade analyze` on every case, with real packets.

One stack per topology, with an empty manifest folder: three nodes routed directly
(`--routing direct`: each datapath routes the other nodes' pod CIDRs via their addresses); three
nodes on networks of their own joined by the datapaths' VXLAN (`--routing tunnel`). The x/y/z,
a/b/c model's nine pods are created once at their status.podIP addresses (10.0.<ns>.<pod>,
outside every node's pool, so the ipBlock cases judge pod addresses), spread over the nodes in
turn (pod i on node i mod 3: two pairs in three cross nodes, the third stays on its node, so
local delivery is judged in the same run), with servers on every probed port.
Each case of the NetworkPolicy and Cilium policy suites is imported, probed with real TCP, UDP
and SCTP packets (raw-socket SCTP where the kernel has none), compared cell by cell with the
engine's matrix, and withdrawn.

Each case runs in one of the two topologies, in turn (sorted, alternating), so both carry
cases of every kind and ``make test`` stays within its time; ``PALISADE_CONFORMANCE=all`` runs
every case in both. The tests are test_conformance_direct.py and test_conformance_tunnel.py (a module
each, so one topology's stack is gone before the other's starts: they share the pods' names).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import yaml

from palisade.v1 import datapath_pb2_grpc, policy_pb2_grpc
from services.cli.connectivity import ProbeRun
from services.common.manifests import Document
from services.policy.engine.analyze import Probe
from testkit.stack import running_stack
from tests.policy import cnp_cases, knp_cases
from tests.policy.model import compute_matrix, mismatches, model_documents

PROBES = sorted(set(knp_cases.PROBES) | set(cnp_cases.PROBES))
CASES: dict[str, list[Any]] = {
    **{f"knp/{name}": policies for name, (policies, _) in knp_cases.CASES.items()},
    **{f"cnp/{name}": policies for name, (policies, _) in cnp_cases.CASES.items()},
}
#: Topology -> the stack's extra arguments (each multi-node one on a node subnet of its own).
TOPOLOGIES: dict[str, tuple[str, ...]] = {
    "direct": ("--nodes", "3", "--node-subnet", "172.31.244.0/24", "--routing", "direct"),
    "tunnel": ("--nodes", "3", "--node-subnet", "172.31.240.0/24", "--routing", "tunnel"),
}
ALL = os.environ.get("PALISADE_CONFORMANCE") == "all"


def cases_of(topology: str) -> list[str]:
    """The cases ``topology`` runs: every other one (or all of them, with PALISADE_CONFORMANCE=all)."""
    i = sorted(TOPOLOGIES).index(topology)
    return sorted(CASES) if ALL else sorted(CASES)[i :: len(TOPOLOGIES)]


def probe_run(topology: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeRun]:
    probes = [Probe.parse(p) for p in PROBES]
    with (
        running_stack(tmp_path_factory.mktemp(f"conformance-{topology}"), None, *TOPOLOGIES[topology]) as stack,
        ExitStack() as channels,
        stack.channel("policy") as pol_ch,
    ):
        datapaths = {
            node: datapath_pb2_grpc.DatapathServiceStub(ch)
            for node, ch in channels.enter_context(stack.node_channels()).items()
        }
        run = ProbeRun(datapaths, policy_pb2_grpc.PolicyServiceStub(pol_ch), timeout=1.5)
        try:
            docs = [Document(f"model[{i}]", d) for i, d in enumerate(model_documents())]
            run.create_pods(docs, probes)
            with run.servers(probes):
                yield run
        finally:
            run.close()


def check_case(probe_run: ProbeRun, case: str) -> None:
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


def check_pods(probe_run: ProbeRun) -> None:
    """The model's pods sit at their manifest addresses, spread so two pairs in three cross nodes."""
    got = {key: list(ep.ips) for key, ep in probe_run.endpoints.items()}
    want = {f"{d['metadata']['namespace']}/{d['metadata']['name']}": [d["status"]["podIP"]] for d in model_documents()
            if d["kind"] == "Pod"}  # fmt: skip
    assert got == want
    nodes = {key: ep.node for key, ep in probe_run.endpoints.items()}
    pairs = [(s, d) for s in nodes for d in nodes if s != d]
    crossing = [p for p in pairs if nodes[p[0]] != nodes[p[1]]]
    assert len(crossing) * 3 >= 2 * len(pairs) or len(set(nodes.values())) == len(probe_run.datapaths) == 1
