"""A policy file of several MB through `palisade policy import`: the answer fits the work, and is true.

20,000 rules (about 5 MB of YAML) take the service seconds to read; the CLI's deadline grows
with the file, and when an answer does come too late the CLI finds out what happened instead
of printing a failure for an import that was applied.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from palisade.v1 import common_pb2, policy_pb2
from testkit.policycluster import eventually, palisade
from testkit.scenario import DB, WEB, Env

RULES = 20_000


def big_policy(name: str, rules: int = RULES) -> str:
    """A CiliumNetworkPolicy for db with an ingressDeny and ``rules`` ingress rules, as block YAML."""
    lines = [
        "apiVersion: cilium.io/v2",
        "kind: CiliumNetworkPolicy",
        "metadata:",
        f"  name: {name}",
        "  namespace: default",
        "spec:",
        "  endpointSelector:",
        "    matchLabels:",
        "      app: db",
        "  ingressDeny:",
        "  - fromEndpoints:",
        "    - matchLabels:",
        "        app: web",
        "  ingress:",
    ]
    for i in range(rules):
        lines += [
            "  - fromEndpoints:",
            "    - matchLabels:",
            f"        app: client-{i:05d}",
            f"        tier: frontend-{i % 7}",
            "    toPorts:",
            "    - ports:",
            f'      - port: "{1024 + i % 60000}"',
            "        protocol: TCP",
            f'      - port: "{2000 + i % 50000}"',
            "        protocol: UDP",
        ]
    return "\n".join(lines) + "\n"


async def _get(env: Env, name: str) -> policy_pb2.PolicyStatus | None:
    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name=name)
    try:
        status: policy_pb2.PolicyStatus = await env.api.GetPolicy(
            policy_pb2.GetPolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API), timeout=60
        )
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND, err
        return None
    return status


@pytest.mark.timeout(600)
async def test_a_large_import_is_answered_and_enforced(env: Env, tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(big_policy("big"))
    assert path.stat().st_size > 4_000_000

    result = await palisade("policy", "import", str(path), f"--policy-address={env.policy.address}")
    assert result.returncode == 0, result.stderr
    assert "DEADLINE_EXCEEDED" not in result.stderr and "error" not in result.stderr
    assert "big" in result.stdout and "revision" in result.stdout
    status = await _get(env, "big")
    assert status is not None and status.state != policy_pb2.POLICY_STATE_REJECTED, status
    assert status.revision > 0
    # Enforced: db's node got the deny the file starts with.
    n2 = env.datapaths["n2"]

    def denies_web() -> bool:
        _, entries = n2.state.policies.get(DB, ((False, False), {}))
        return any(key[1] == WEB and verdict == common_pb2.VERDICT_DENY for key, verdict in entries.items())

    await eventually(denies_web, "the deny on n2")


@pytest.mark.timeout(600)
async def test_an_import_answered_too_late_never_reports_a_failure_for_a_success(env: Env, tmp_path: Path) -> None:
    path = tmp_path / "late.yaml"
    path.write_text(big_policy("late", rules=5_000))
    address = f"--policy-address={env.policy.address}"

    # Far too little time for the service to read the file.
    result = await palisade("policy", "import", str(path), "--request-timeout", "0.2", address)
    present = await _get(env, "late")
    if result.returncode == 0:
        assert present is not None, "the CLI reported success for an import that is not in force"
    else:
        assert "not applied" in result.stderr, result.stderr
        assert present is None, "the CLI reported a failure for an import that was applied"

    # With the default deadline the same file goes in, and an abandoned attempt never lands later.
    result = await palisade("policy", "import", str(path), address)
    assert result.returncode == 0, result.stderr
    assert await _get(env, "late") is not None
