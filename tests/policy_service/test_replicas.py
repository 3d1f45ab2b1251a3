"""Two policy replicas on one bus: one leads, the other forwards and takes over when it dies.

The datapaths and clients talk to the follower throughout, so every answer here crossed
the follower: an import, WaitForRevision, Resync and the realized reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from nats.js.errors import KeyNotFoundError

from palisade.v1 import common_pb2, common_pb2_grpc, policy_pb2, policy_pb2_grpc
from testkit import builders
from testkit.harness import NatsServer, ServiceProcess, free_port
from testkit.harness import channel as open_channel
from testkit.policycluster import Datapath, Feed, OrderLog, eventually, palisade, start_policy
from testkit.scenario import DB, PODS, WEB, publish_world, seeded


@dataclass
class Replicas:
    feed: Feed
    log: OrderLog
    first: ServiceProcess
    second: ServiceProcess
    datapaths: dict[str, Datapath]
    #: The CLI's channel to the second replica (the follower at the start).
    channel: grpc.aio.Channel

    @property
    def api(self) -> policy_pb2_grpc.PolicyServiceStub:
        return policy_pb2_grpc.PolicyServiceStub(self.channel)


async def _status(address: str) -> common_pb2.ServiceStatus:
    channel = open_channel(address, "policy")
    try:
        status: common_pb2.ServiceStatus = await common_pb2_grpc.StatusServiceStub(channel).GetStatus(
            common_pb2.GetStatusRequest(), timeout=5
        )
        return status
    finally:
        await channel.close()


@pytest.fixture
async def replicas(nats_server: NatsServer, service: Callable[..., ServiceProcess]) -> AsyncIterator[Replicas]:
    feed, log = await seeded(nats_server)
    lease = ("--leader-lease", "1.5")
    first = await start_policy(service, nats_server, "--member", "one", *lease)
    assert (await _status(first.address)).details["role"] == "leader"
    second = await start_policy(service, nats_server, "--member", "two", *lease)
    datapaths = {node: Datapath(feed.bus, second.address, node, pods) for node, pods in PODS.items()}
    for dp in datapaths.values():
        await dp.start()
    channel = open_channel(second.address, "policy")
    yield Replicas(feed, log, first, second, datapaths, channel)
    await channel.close()
    for dp in datapaths.values():
        await dp.stop()
    await feed.close()


def _deny(port: int) -> str:
    deny = builders.cnp("db-deny-web", {"app": "db"}, {"app": "web"}, port)
    deny["spec"]["ingressDeny"] = deny["spec"].pop("ingress")
    return yaml.safe_dump(deny)


def _denies(dp: Datapath, port: int) -> bool:
    _, entries = dp.state.policies.get(DB, ((False, False), {}))
    return any(key[1] == WEB and key[3] == port and v == common_pb2.VERDICT_DENY for key, v in entries.items())


async def test_a_follower_forwards_and_takes_over_without_losing_anything(replicas: Replicas) -> None:
    r = replicas
    status = await _status(r.second.address)
    assert status.details["role"] == "follower" and status.details["leader"] == "one"
    assert {m.name: m.role for m in status.members if m.group == "policy"} == {"one": "leader", "two": "follower"}

    # Through the follower: the import lands on the leader, its revision is the leader's, and
    # WaitForRevision sees the datapaths' reports (which they also send to the follower).
    imported = await r.api.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=_deny(5432), origin="deny.yaml"), timeout=30
    )
    assert imported.policies[0].state != policy_pb2.POLICY_STATE_REJECTED
    assert (await _status(r.first.address)).revision == imported.revision
    waited = await r.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=imported.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized, waited
    assert _denies(r.datapaths["n2"], 5432)
    sequences = {node: r.log.last_sequence(node) for node in PODS}

    # The leader dies without a word; a Kubernetes change made meanwhile is not lost.
    r.first.kill()
    await r.feed.policy(builders.netpol("web-from-db", {"app": "web"}, {"app": "db"}, 81))
    await eventually(lambda: _role(r.second.address, "leader"), "the follower to lead", 10)

    # The new leader sends every node its whole state at a revision above anything handed out,
    # each node's next sequence (no gap to resync across), with the imported policy kept.
    after = await eventually(
        lambda: (
            {n: [o for o in r.log.by_node.get(n, []) if o.sequence == sequences[n] + 1] for n in PODS}
            if all(r.log.last_sequence(n) > sequences[n] for n in PODS)
            else None
        ),
        "orders from the new leader",
    )
    for node, orders in after.items():
        assert len(orders) == 1 and orders[0].replace and orders[0].revision > imported.revision, node
    current = (await _status(r.second.address)).revision
    assert current >= after["n1"][0].revision
    await eventually(lambda: all(dp.state.revision >= current for dp in r.datapaths.values()), "every node caught up")
    assert _denies(r.datapaths["n2"], 5432)
    ref = common_pb2.ObjectRef(kind="CiliumNetworkPolicy", namespace="default", name="db-deny-web")
    kept = await r.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API))
    assert kept.origin == "api deny.yaml"
    assert all([await dp.matches_resync() for dp in r.datapaths.values()])

    # And it serves changes itself: a new import is enforced and realized.
    again = await r.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=_deny(6379)), timeout=30)
    assert again.revision > current
    waited = await r.api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=again.revision, timeout_seconds=20), timeout=30
    )
    assert waited.realized, waited
    assert _denies(r.datapaths["n2"], 6379)


async def test_a_dry_run_reports_the_revision_the_import_would_make(replicas: Replicas, tmp_path: Path) -> None:
    """Asked through the follower, whose own counter means nothing: the answer is the leader's revision,
    one more when the import would change something, and says that nothing was applied."""
    r = replicas
    current = (await _status(r.first.address)).revision
    path = tmp_path / "deny.yaml"
    path.write_text(_deny(5432))
    address = f"--policy-address={r.second.address}"
    dry = await palisade("policy", "import", "--dry-run", str(path), address)
    assert dry.returncode == 0, dry.stderr
    assert (
        dry.stdout.rstrip().splitlines()[-1]
        == f"dry run: nothing applied; the import would make revision {current + 1}"
    )
    assert (await _status(r.first.address)).revision == current
    as_json = await palisade("policy", "import", "--dry-run", str(path), address, "-o", "json")
    assert json.loads(as_json.stdout)["revision"] == current + 1 and json.loads(as_json.stdout)["dry_run"] is True
    # Once imported, the same file changes nothing: a dry run of it keeps the revision.
    imported = await palisade("policy", "import", str(path), address, "-o", "json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["revision"] == current + 1
    again = await palisade("policy", "import", "--dry-run", str(path), address)
    assert (
        again.stdout.rstrip().splitlines()[-1]
        == f"dry run: nothing applied; the import would make revision {current + 1}"
    )


async def test_status_shows_a_frozen_leader_unreachable_and_not_a_stopped_system(replicas: Replicas) -> None:
    """SIGSTOP: the leader's port still accepts, nothing answers, its heartbeat expires. It stays in
    the member table, unhealthy, and the CLI does not tell to start a system that runs."""
    r = replicas
    assert r.first.proc is not None
    os.kill(r.first.proc.pid, signal.SIGSTOP)
    try:
        await eventually(lambda: _role(r.second.address, "leader"), "the follower to lead", 20)
        await eventually(lambda: _heartbeat_expired(r.feed, "one"), "one's heartbeat to expire", 20)
        others = [f"--{name}-address=127.0.0.1:{free_port()}" for name in ("watcher", "ipam", "datapath")]
        policy = f"--policy-address={r.first.address},{r.second.address}"
        as_json = await palisade("status", policy, *others, "-o", "json")
        assert as_json.returncode == 1, as_json.stderr
        members = {m["name"]: m for m in json.loads(as_json.stdout)["members"] if m["group"] == "policy"}
        assert set(members) == {"one", "two"}, members
        assert members["one"]["health"].startswith("unreachable: no answer within 1.5s"), members
        assert members["two"]["health"] == "ok" and members["two"]["role"] == "leader"
        text = await palisade("status", policy, *others)
        assert "start the system" not in text.stdout, text.stdout
        (hint,) = [line for line in text.stdout.splitlines() if line.startswith("no answer within 1.5s from")]
        assert f"policy at {r.first.address}" in hint and f"policy at {r.second.address}" not in hint
    finally:
        os.kill(r.first.proc.pid, signal.SIGCONT)


async def _heartbeat_expired(feed: Feed, name: str) -> bool:
    """Whether ``name``'s heartbeat is gone from the lease bucket (expired: it wrote none for a lease)."""
    kv = await feed.bus.js.key_value("PALISADE_POLICY_LEADER")
    try:
        await kv.get(f"member.{name}")
    except KeyNotFoundError:
        return True
    return False


async def test_the_old_leader_back_is_a_follower(replicas: Replicas) -> None:
    r = replicas
    r.first.kill()
    await eventually(lambda: _role(r.second.address, "leader"), "the follower to lead", 10)
    revision = (await _status(r.second.address)).revision
    r.first.start(wait=False)
    await eventually(lambda: _role(r.first.address, "follower"), "the old leader back, following", 30)
    # Calls to it reach the leader: the revision it answers with is the leader's, not one of its own.
    channel = open_channel(r.first.address, "policy")
    try:
        listed = await policy_pb2_grpc.PolicyServiceStub(channel).ListPolicies(policy_pb2.ListPoliciesRequest())
    finally:
        await channel.close()
    assert listed.revision == revision == (await _status(r.second.address)).revision


async def _role(address: str, role: str) -> bool:
    try:
        status = await _status(address)
    except grpc.aio.AioRpcError:
        return False
    return status.details.get("role") == role and (role != "leader" or status.synced)


async def test_a_leader_that_loses_its_lease_steps_down_without_exiting(
    nats_server: NatsServer, service: Callable[..., ServiceProcess]
) -> None:
    """Its lease taken (a NATS outage that outlived it, a partition): it follows, then leads again
    once the lease is free, in the same process, and what it plans then is published."""
    feed, log = await seeded(nats_server)
    try:
        leader = await start_policy(service, nats_server, "--member", "one", "--leader-lease", "1.5")
        await eventually(lambda: _role(leader.address, "leader"), "one to lead")
        before = (await _status(leader.address)).revision
        kv = await feed.bus.js.key_value("PALISADE_POLICY_LEADER")
        await kv.put("leader", json.dumps({"member": "ghost", "address": "127.0.0.1:1"}).encode())
        await eventually(lambda: "stepped down to follower" in leader.logs(), "one to step down")
        # The ghost never renews: its lease expires and one takes it again, still the same process.
        await eventually(lambda: _role(leader.address, "leader"), "one to lead again", 30)
        assert leader.proc is not None and leader.proc.poll() is None
        again = await _status(leader.address)
        assert again.revision > before
        channel = open_channel(leader.address, "policy")
        try:
            api = policy_pb2_grpc.PolicyServiceStub(channel)
            imported = await api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=_deny(5432)), timeout=30)
        finally:
            await channel.close()
        assert imported.revision > again.revision
        await eventually(lambda: log.at_revision(imported.revision), "the import's orders")
        assert leader.proc.poll() is None
    finally:
        await feed.close()


async def test_a_deposed_leader_cannot_publish(nats_server: NatsServer, service: Callable[..., ServiceProcess]) -> None:
    """The state's compare-and-set is the fence: once another writer saved the state, the old
    leader's next change fails before any order is published, and the process exits."""
    feed = await Feed.open(nats_server)
    log = OrderLog()
    await log.start(feed.bus)
    try:
        await publish_world(feed)
        await feed.synced()
        leader = await start_policy(service, nats_server, "--member", "one")
        channel = open_channel(leader.address, "policy")
        api = policy_pb2_grpc.PolicyServiceStub(channel)
        first = await api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=_deny(5432)), timeout=30)
        # A new leader (here: a write as one would make it) saves the state under the old one's feet.
        kv = await feed.bus.js.key_value("PALISADE_POLICY")
        await kv.put("state", json.dumps({"revision": first.revision + 100, "sequences": {}}).encode())
        published = len(log.all())
        with pytest.raises(grpc.aio.AioRpcError):
            await api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=_deny(6379)), timeout=30)
        await channel.close()
        assert leader.proc is not None
        assert await asyncio.to_thread(leader.proc.wait, 30) == 1
        assert "changed by another writer" in leader.logs()
        assert all(o.revision <= first.revision for o in log.all()[published:])
    finally:
        await feed.close()


async def test_a_leader_stopped_cleanly_hands_over_without_waiting_for_its_lease(
    nats_server: NatsServer, service: Callable[..., ServiceProcess]
) -> None:
    """SIGTERM: the leader gives its lease up. With a 60 s lease, a follower leading within the
    wait below can only have found it released, not expired."""
    feed, _ = await seeded(nats_server)
    try:
        lease = ("--leader-lease", "60")
        first = await start_policy(service, nats_server, "--member", "one", *lease)
        await eventually(lambda: _role(first.address, "leader"), "one to lead")
        second = await start_policy(service, nats_server, "--member", "two", *lease)
        await eventually(lambda: _role(second.address, "follower"), "two to follow")
        assert first.terminate() == 0
        await eventually(lambda: _role(second.address, "leader"), "two to lead", 20)
    finally:
        await feed.close()
