"""Realized revisions over the real API: WaitForRevision, status roll-up, lagging endpoints named."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import grpc
import pytest
import yaml

from palisade.v1 import common_pb2, policy_pb2
from testkit import builders
from testkit.policycluster import eventually, palisade
from testkit.scenario import CACHE, DB, WEB, Env


async def import_policy(env: Env, doc: dict[str, object]) -> policy_pb2.ImportPoliciesResponse:
    response: policy_pb2.ImportPoliciesResponse = await env.api.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(doc), origin="test.yaml"), timeout=10
    )
    return response


async def test_wait_returns_once_reported_and_times_out_naming_who_is_behind(env: Env) -> None:
    answer = await import_policy(env, builders.cnp("web-in", {"app": "web"}, {"app": "db"}, 8443))
    (status,) = answer.policies
    assert status.state in (policy_pb2.POLICY_STATE_REALIZING, policy_pb2.POLICY_STATE_REALIZED)
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized and not waited.behind
    assert waited.current_revision >= answer.revision
    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name="web-in")
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API))
    assert status.state == policy_pb2.POLICY_STATE_REALIZED
    assert list(status.subjects) == [WEB]
    assert (status.nodes_total, status.nodes_realized) == (2, 2)
    assert [(n.node, n.endpoints, n.endpoints_realized) for n in status.nodes] == [("n1", 1, 1), ("n3", 1, 1)]

    # n2's datapath stops reporting; a change for db is then never realized there.
    env.datapaths["n2"].reporting = False
    answer = await import_policy(env, builders.cnp("db-in", {"app": "db"}, {"app": "web"}, 6000))
    await env.settled(answer.revision)
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=0.3), timeout=30
    )
    assert not waited.realized
    assert [(b.node, b.pod, b.endpoint_id, b.identity) for b in waited.behind] == [("n2", "default/db-1", 21, DB)]
    assert waited.behind[0].realized_revision < answer.revision
    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name="db-in")
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref))
    assert status.state == policy_pb2.POLICY_STATE_REALIZING
    assert [(n.node, n.endpoints, n.endpoints_realized) for n in status.nodes] == [("n2", 1, 0)]

    # It reports again: a waiter that is already waiting returns.
    pending = env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=20), timeout=30
    )
    env.datapaths["n2"].reporting = True
    await env.datapaths["n2"].resync()
    waited = await pending
    assert waited.realized
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref))
    assert status.state == policy_pb2.POLICY_STATE_REALIZED


async def test_implementation_delay_is_measured(env: Env) -> None:
    import urllib.request

    def histogram_count() -> float:
        url = f"http://127.0.0.1:{env.policy.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("palisade_policy_implementation_delay_seconds_count"):
                return float(line.split()[-1])
        return 0.0

    before = histogram_count()
    answer = await import_policy(env, builders.cnp("web-in", {"app": "web"}, {"app": "db"}, 8443))
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized
    await eventually(lambda: histogram_count() > before, "an implementation delay observation")


async def test_endpoint_unknown_to_the_ipcache_gets_diffs_and_counts_until_deleted(env: Env) -> None:
    """A pod created on n1 directly (no ipcache entry), of identity cache: the datapath names it."""
    n1 = env.datapaths["n1"]
    answer = await n1.stub.Resync(policy_pb2.ResyncRequest(node="n1", identities=[CACHE]))
    assert [p.identity for p in answer.policies] == [CACHE]
    n1.endpoints["dev/cache-x"] = (99, CACHE)
    await n1.resync()  # what the datapath holds now includes cache; it reports the new endpoint

    imported = await import_policy(env, builders.cnp("cache-in", {"app": "cache"}, {"app": "web"}, 11211))
    orders = await eventually(lambda: env.log.at_revision(imported.revision), "orders of the import")
    assert CACHE in [d.identity for d in orders["n1"].diffs]
    await env.settled(imported.revision)
    assert [k[3] for k in n1.state.policies[CACHE][1]] == [11211]
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=imported.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized

    # It stops reporting: the next change for cache waits on it, until the datapath says it is gone.
    n1.reporting = False
    changed = await import_policy(env, builders.cnp("cache-in", {"app": "cache"}, {"app": "web"}, 11212))
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=changed.revision, timeout_seconds=0.3), timeout=30
    )
    assert [(b.node, b.pod) for b in waited.behind] == [("n1", "dev/cache-x")]
    await n1.stub.ReportRealized(
        policy_pb2.ReportRealizedRequest(
            reports=[
                policy_pb2.RealizedReport(node="n1", endpoint_id=99, identity=CACHE, pod="dev/cache-x", deleted=True)
            ]
        )
    )
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=changed.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized


async def test_a_failed_realization_is_reported_and_ends_waits_at_once(env: Env) -> None:
    n2 = env.datapaths["n2"]
    n2.reporting = False
    answer = await import_policy(env, builders.cnp("db-in", {"app": "db"}, {"app": "web"}, 6000))
    await env.settled(answer.revision)
    # A wait that would otherwise run for ten minutes.
    pending = env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=600), timeout=60
    )
    await asyncio.sleep(0)

    # n2's datapath could not write db-1's maps and says so.
    failure = policy_pb2.RealizedReport(
        node="n2", endpoint_id=21, identity=DB, revision=answer.revision, pod="default/db-1", error="policy map full"
    )
    await n2.stub.ReportRealized(policy_pb2.ReportRealizedRequest(reports=[failure]), timeout=10)

    waited = await pending
    assert waited.failed and not waited.realized
    (lag,) = waited.behind
    assert (lag.node, lag.pod, lag.error, lag.failed_revision) == (
        "n2",
        "default/db-1",
        "policy map full",
        answer.revision,
    )

    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name="db-in")
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref))
    assert status.state == policy_pb2.POLICY_STATE_FAILED
    assert "n2/default/db-1" in status.error and "policy map full" in status.error
    assert [(n.node, n.endpoints, n.endpoints_realized, n.endpoints_failed) for n in status.nodes] == [("n2", 1, 0, 1)]
    # A policy the failing endpoint does not enforce is unaffected.
    other = await env.api.GetPolicy(
        policy_pb2.GetPolicyRequest(
            ref=common_pb2.ObjectRef(kind="NetworkPolicy", namespace="default", name="db-from-web")
        )
    )
    assert other.state != policy_pb2.POLICY_STATE_FAILED

    # The CLI: `policy wait` fails at once with the reason; `policy get` shows the state and message.
    address = f"--policy-address={env.policy.address}"
    waited_cli = await palisade("policy", "wait", str(answer.revision), "--timeout", "600", address)
    assert waited_cli.returncode == 1, waited_cli
    assert "failed" in waited_cli.stderr and "n2/default/db-1" in waited_cli.stderr
    assert "policy map full" in waited_cli.stderr
    got = await palisade("policy", "get", "cnp", "db-in", "--source", "api", address)
    assert got.returncode == 0, got
    assert "failed" in got.stdout and "policy map full" in got.stdout

    # The datapath retries and succeeds: the failure is gone.
    n2.reporting = True
    await n2.resync()
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized and not waited.failed
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref))
    assert status.state == policy_pb2.POLICY_STATE_REALIZED and not status.error


async def test_a_heartbeat_is_a_report_with_only_the_node(env: Env) -> None:
    stub = env.api_for("ReportRealized")
    await stub.ReportRealized(policy_pb2.ReportRealizedRequest(node="n1"), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReportRealized(policy_pb2.ReportRealizedRequest(node="Not_A_Node"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "node" in (err.value.details() or "")


async def test_an_import_in_audit_mode_is_realized_though_a_pod_never_reported(env: Env) -> None:
    """`policy import --wait` of a policy in audit mode: a pod that appeared on n1 after its
    datapath's last report (an identity n1 already holds, so no order brings it anything) reports
    nothing, and the held-back bumps give it nothing to report; the wait does not wait for it."""
    ready = await import_policy(env, builders.cnp("web-in", {"app": "web"}, {"app": "db"}, 8443))
    await env.settled(ready.revision)
    await env.feed.pod("10.0.1.9", WEB, "n1", "web-9")  # the played n1 never reports it
    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name="web-in")

    async def n1_endpoints() -> int:
        status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API))
        return sum(n.endpoints for n in status.nodes if n.node == "n1")

    await eventually(lambda: _equals(n1_endpoints(), 2), "the policy service knowing the new pod")
    audited = builders.netpol("db-audit", {"app": "db"}, {"app": "web"}, 5433)
    audited["metadata"]["annotations"] = {"policy.palisade.io/mode": "audit"}
    answer = await import_policy(env, audited)
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized and not waited.behind

    # A change of the pod's identity does wait for it, named, until its datapath reports it.
    changed = await import_policy(env, builders.cnp("web-in", {"app": "web"}, {"app": "db"}, 8444))
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=changed.revision, timeout_seconds=0.5), timeout=30
    )
    assert not waited.realized
    assert [(b.node, b.pod, b.realized_revision) for b in waited.behind] == [("n1", "default/web-9", 0)]
    env.datapaths["n1"].endpoints["default/web-9"] = (19, WEB)
    await env.datapaths["n1"].resync()
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=changed.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized


async def test_a_pod_of_an_identity_new_to_its_node_is_waited_for_until_it_reports(env: Env) -> None:
    """Its first policy (the order that brings the identity to the node) is a change it must realize."""
    await env.feed.pod("10.0.2.9", WEB, "n2", "web-9")  # web is new on n2
    orders = await eventually(
        lambda: next((o for o in env.log.all() if o.node == "n2" and WEB in [d.identity for d in o.diffs]), None),
        "the order bringing web's policy to n2",
    )
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=orders.revision, timeout_seconds=0.5), timeout=30
    )
    assert [(b.node, b.pod) for b in waited.behind] == [("n2", "default/web-9")]
    env.datapaths["n2"].endpoints["default/web-9"] = (29, WEB)
    await env.datapaths["n2"].resync()
    waited = await env.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=orders.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected
