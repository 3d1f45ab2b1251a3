"""A typo in an enforced policy, through the watcher's path (NATS deltas) into a real policy service.

The valid version stays enforced (orders, datapath state and traces unchanged), the object shows
as rejected with the field's path, and nothing else is affected.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import grpc
import yaml

from palisade.v1 import common_pb2, policy_pb2
from testkit import builders
from testkit.policycluster import eventually
from testkit.scenario import CACHE, PODS, WEB, Env, next_orders
from tests.policy.typo_cases import CASES, doc_of
from tests.policy_service.test_api import rpc_error


def _ref(name: str) -> common_pb2.ObjectRef:
    return common_pb2.ObjectRef(kind="NetworkPolicy", namespace="default", name=name)


async def _cache_to_web(env: Env, port: int) -> int:
    answer = await env.api.Trace(
        policy_pb2.TraceRequest(
            source=policy_pb2.TracePeer(pod="default/cache-1"),
            destination=policy_pb2.TracePeer(pod="default/web-1"),
            port=port,
            protocol=common_pb2.PROTOCOL_TCP,
        )
    )
    verdict: int = answer.verdict
    return verdict


async def test_a_typo_in_an_enforced_policy_keeps_the_valid_version_enforced(env: Env) -> None:
    valid = builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 80)
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.policy(valid)
    orders = await next_orders(env, before, "orders for the valid policy")
    revision = max(o.revision for o in orders.values())
    await env.settled(revision)
    enforced = {node: copy.deepcopy(dp.state.policies) for node, dp in env.datapaths.items()}
    assert enforced["n1"][WEB]  # web has entries: only db may reach it
    assert await _cache_to_web(env, 80) == common_pb2.VERDICT_DENY
    accepted = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=_ref("web-from-db")))

    # The file gets a typo that, dropped, would open port 80 to every pod: `form` for `from`.
    typo = copy.deepcopy(valid)
    typo["spec"]["ingress"][0]["form"] = typo["spec"]["ingress"][0].pop("from")
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.policy(typo)
    await env.feed.policy(builders.netpol("later", {"app": "cache"}, {"app": "web"}, 11211))
    orders = await next_orders(env, before, "orders after the typo")
    # One order per node, for the other policy only: the typo changed nothing.
    assert all(o.sequence == before[n] + 1 for n, o in orders.items())
    assert {n: [d.identity for d in o.diffs] for n, o in orders.items()} == {"n1": [], "n2": [], "n3": [CACHE]}
    await env.settled(max(o.revision for o in orders.values()))
    assert {node: dp.state.policies[WEB] for node, dp in env.datapaths.items() if WEB in dp.state.policies} == {
        node: policies[WEB] for node, policies in enforced.items() if WEB in policies
    }
    assert await _cache_to_web(env, 80) == common_pb2.VERDICT_DENY
    assert await env.all_match_resync()

    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=_ref("web-from-db")))
    assert status.state == policy_pb2.POLICY_STATE_REJECTED
    assert "NetworkPolicy default/web-from-db: spec.ingress[0].form: unknown field; did you mean 'from'?" in (
        status.error
    )
    # The version enforced is still the valid one, at the revision it was accepted.
    assert status.revision == accepted.revision > 0
    listed = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest(namespace="default"))
    states = {p.ref.name: p.state for p in listed.policies}
    assert states["web-from-db"] == policy_pb2.POLICY_STATE_REJECTED
    assert states["later"] != policy_pb2.POLICY_STATE_REJECTED

    # Fixing the file enforces the fixed version and clears the error.
    fixed = builders.netpol("web-from-db", {"app": "web"}, {"app": "cache"}, 80)
    before = {node: env.log.last_sequence(node) for node in PODS}
    await env.feed.policy(fixed)
    orders = await next_orders(env, before, "orders for the fixed policy")
    await env.settled(max(o.revision for o in orders.values()))
    assert await _cache_to_web(env, 80) == common_pb2.VERDICT_ALLOW
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=_ref("web-from-db")))
    assert status.state != policy_pb2.POLICY_STATE_REJECTED and not status.error


def _case_doc(kind: str, where: Any, edit: Any, name: str) -> dict[str, Any]:
    doc = doc_of(kind)
    edit(where(doc))
    doc["metadata"]["name"] = name
    return doc


def _error_name(kind: str, name: str) -> str:
    return f"{kind} {name}" if kind == "CiliumClusterwideNetworkPolicy" else f"{kind} x/{name}"


async def test_every_typo_is_refused_by_import_and_shown_invalid_through_the_watchers_path(env: Env) -> None:
    """The table of typos at every depth, all three kinds, through ImportPolicies and the NATS deltas."""
    refs = []
    for n, (kind, case, where, edit, path, words) in enumerate(CASES):
        name = f"typo-{n}"
        doc = _case_doc(kind, where, edit, name)
        for dry_run in (True, False):
            err = await rpc_error(
                env.api.ImportPolicies(
                    policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(doc), dry_run=dry_run, origin="t.yaml")
                )
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            details = err.details() or ""
            assert f"{_error_name(kind, name)}: {path}: " in details and words in details, (case, details)
        await env.feed.policy(doc)
        refs.append((common_pb2.ObjectRef(kind=kind, namespace=doc["metadata"].get("namespace", ""), name=name), path))
    listed = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())
    assert not any(p.source == policy_pb2.POLICY_SOURCE_API for p in listed.policies)
    for ref, path in refs:
        status: policy_pb2.PolicyStatus = await eventually(partial(_status, env, ref), f"{ref.name} to arrive")
        assert status.state == policy_pb2.POLICY_STATE_REJECTED
        assert f": {path}: " in status.error, status.error
        assert status.revision == 0  # never enforced


async def _status(env: Env, ref: common_pb2.ObjectRef) -> policy_pb2.PolicyStatus | None:
    try:
        status: policy_pb2.PolicyStatus = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref))
        return status
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return None
