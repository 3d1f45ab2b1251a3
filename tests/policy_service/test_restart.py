"""kill -9 and restart: revisions and sequences continue; a datapath that missed orders catches up."""

from __future__ import annotations

import pytest
import yaml

from palisade.v1 import common_pb2, policy_pb2
from testkit import builders
from testkit.policycluster import Datapath, eventually, palisade, restart
from testkit.scenario import CACHE, DB, PODS, WEB, Env


async def test_killed_service_continues_revisions_and_sequences(env: Env) -> None:
    n1, n2 = env.datapaths["n1"], env.datapaths["n2"]
    await env.feed.policy(builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 80))
    first = await eventually(lambda: env.log.at_revision(max(o.revision for o in env.log.all())), "orders")
    await env.settled(max(o.revision for o in first.values()))

    # n2 goes away and misses an order for its own identity.
    await n2.pause()
    await env.feed.policy(builders.netpol("db-from-cache", {"app": "db"}, {"app": "cache"}, 5432))
    seen_by_n2 = n2.state.sequence
    missed = await eventually(
        lambda: [
            o
            for o in env.log.by_node.get("n2", [])
            if o.sequence > seen_by_n2 and any(d.identity == DB for d in o.diffs)
        ],
        "an order for db on n2",
    )
    highest_revision = max(o.revision for o in env.log.all())
    sequences = {node: env.log.last_sequence(node) for node in PODS}
    assert n2.state.sequence < missed[-1].sequence

    env.policy.kill()
    # Changes keep coming while the service is down.
    await env.feed.policy(builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 81))
    await restart(env.policy)
    for dp in env.datapaths.values():
        await dp.reconnect(env.policy.address)

    # The first order after the restart continues each node's sequence, above every revision seen.
    after = await eventually(
        lambda: (
            all(env.log.last_sequence(n) > sequences[n] for n in PODS)
            and {n: [o for o in env.log.by_node[n] if o.sequence == sequences[n] + 1] for n in PODS}
        ),
        "orders after the restart",
    )
    for node, (order,) in after.items():
        assert order.replace, node
        assert order.revision > highest_revision, node
    assert sorted(d.identity for d in after["n3"][0].diffs) == [WEB, CACHE]

    # n1 followed without a gap: no resync beyond its first one; its state is the service's.
    await eventually(lambda: n1.state.revision == after["n1"][0].revision, "n1 at the new revision")
    assert n1.resyncs == 1
    assert await n1.matches_resync()
    web = n1.state.policies[WEB][1]
    assert [k[3] for k in web] == [81]

    # n2 comes back: its next order shows a gap, it resyncs and ends up with the current state.
    await n2.resume()
    await env.feed.policy(builders.netpol("late", {"app": "cache"}, {"app": "db"}, 9000))
    await eventually(lambda: n2.resyncs == 2, "n2 to resync after the gap")
    latest = max(o.revision for o in env.log.all())
    await env.settled(latest)
    assert await env.all_match_resync()
    assert n2.state.policies[DB][1], "db's policy from the order n2 missed"

    # Everything the service said about revisions is monotonic across the restart.
    status = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())
    assert status.revision >= latest > highest_revision


def _denies_web(dp: Datapath) -> bool:
    """Whether the node's db policy denies web (the imported ingressDeny is in force there)."""
    _, entries = dp.state.policies.get(DB, ((False, False), {}))
    return any(key[1] == WEB and verdict == common_pb2.VERDICT_DENY for key, verdict in entries.items())


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_imported_policies_survive_a_restart(env: Env, stop: str) -> None:
    deny = builders.cnp("db-deny-web", {"app": "db"}, {"app": "web"}, 5432)
    deny["spec"]["ingressDeny"] = deny["spec"].pop("ingress")
    imported = await env.api.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(deny), origin="deny.yaml"), timeout=30
    )
    (status,) = imported.policies
    assert status.state != policy_pb2.POLICY_STATE_REJECTED, status.error
    n2 = env.datapaths["n2"]
    await eventually(lambda: _denies_web(n2), "the deny on n2")

    if stop == "sigterm":
        assert env.policy.terminate() == 0
    else:
        env.policy.kill()
    await restart(env.policy)
    for dp in env.datapaths.values():
        await dp.reconnect(env.policy.address)

    # The policy is back, from its source, and the first order after the restart still enforces it.
    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name="db-deny-web")
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API))
    assert status.source == policy_pb2.POLICY_SOURCE_API
    assert status.origin == "api deny.yaml"
    assert status.state in (policy_pb2.POLICY_STATE_REALIZING, policy_pb2.POLICY_STATE_REALIZED)
    assert "ingressDeny" in status.document
    await eventually(lambda: n2.state.revision > imported.revision, "n2 to apply the order after the restart")
    assert _denies_web(n2)
    assert await env.all_match_resync()
    listed = await palisade("policy", "get", f"--policy-address={env.policy.address}")
    assert listed.returncode == 0, listed
    rows = {line.split()[2]: line.split() for line in listed.stdout.splitlines()[1:] if line.strip()}
    assert rows["db-deny-web"][3] == "api" and rows["db-from-web"][3] == "kubernetes", listed.stdout

    # Deleted over the API, it stays deleted across the next restart.
    await env.api.DeletePolicy(policy_pb2.DeletePolicyRequest(ref=ref), timeout=30)
    await eventually(lambda: not _denies_web(n2), "the deny gone from n2")
    env.policy.kill()
    await restart(env.policy)
    for dp in env.datapaths.values():
        await dp.reconnect(env.policy.address)
    listing = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())
    assert [(p.ref.name, p.source) for p in listing.policies] == [("db-from-web", policy_pb2.POLICY_SOURCE_KUBERNETES)]
