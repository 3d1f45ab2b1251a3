"""The highly available control plane: policy leader failover, and what R3 JetStream costs.

    .venv/bin/python -m bench.bench_ha [--kills 10] [--edits 40] [--quick]

Real nats-servers and policy service processes (mutual TLS, as deployed), with three
played datapaths (tests/policy_service: they follow their node's orders on the bus,
apply them in memory and report realized revisions over gRPC, as the datapath does;
no BPF, whose cost is the same in both topologies).

1. **Failover** (a 3-server NATS cluster, two policy replicas with the default 3 s
   lease): ``--kills`` times, kill -9 the leader and at once import a policy change
   through a channel to both replicas (retrying while no leader answers), then wait
   for WaitForRevision to say realized on every node. One sample is the time from the
   kill to realized; the time until the survivor reports itself leader is given too.
   The killed replica is restarted and left to become a warm follower before the next
   kill, so each kill is of a leader with a follower ready.
2. **R3 cost** (both topologies up at once, edits interleaved between them): policy
   edit (ImportPolicies) -> realized on every node (WaitForRevision), on one NATS
   server with one policy service, and on the 3-server cluster (every stream and bucket
   R3) through the leader; the ratio HA / single of p50 and p99. Edits sent to the
   follower (forwarded to the leader) are timed too.
3. **Edit while a member is down** (``make run --ha``, real BPF and packets; needs
   root, skipped otherwise): ``--rounds`` times for each of one NATS server, one etcd
   member, one ipam replica and the policy leader: kill -9 it, write a policy file, and
   time until a connection the edit allows gets through; the target is 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench.output import logger
from bench.stats import stats_ms
from palisade.v1 import common_pb2, common_pb2_grpc, policy_pb2, policy_pb2_grpc
from services.common.grpcserver import grpc_target, parse_addresses
from testkit import builders
from testkit.harness import NatsCluster, NatsServer, ServiceProcess, pki
from testkit.harness import channel as cli_channel
from testkit.policycluster import Datapath, Feed
from testkit.scenario import PODS, publish_world

log = logger("ha")


def _edit(port: int) -> str:
    return yaml.safe_dump(builders.cnp("bench-edit", {"app": "db"}, {"app": "web"}, port))


@dataclass
class Topology:
    name: str
    nats_url: str
    feed: Feed
    replicas: list[ServiceProcess]
    datapaths: list[Datapath]
    #: The CLI's channel to every replica (pick-first: moves to a survivor by itself).
    channel: grpc.aio.Channel

    @property
    def api(self) -> policy_pb2_grpc.PolicyServiceStub:
        return policy_pb2_grpc.PolicyServiceStub(self.channel)


async def status(address: str) -> common_pb2.ServiceStatus | None:
    channel = cli_channel(address, "policy")
    try:
        answer: common_pb2.ServiceStatus = await common_pb2_grpc.StatusServiceStub(channel).GetStatus(
            common_pb2.GetStatusRequest(), timeout=2
        )
        return answer
    except grpc.aio.AioRpcError:
        return None
    finally:
        await channel.close()


async def role(proc: ServiceProcess) -> str:
    answer = await status(proc.address)
    if answer is None:
        return ""
    return answer.details.get("role", "") if answer.synced or answer.details.get("role") == "follower" else ""


@contextlib.asynccontextmanager
async def topology(
    name: str, nats_url: str, feed_server: NatsServer, replicas: int, work: Path
) -> AsyncIterator[Topology]:
    feed = await Feed.open(feed_server)
    await publish_world(feed)
    await feed.synced()
    procs = []
    datapaths: list[Datapath] = []
    channel = None
    try:
        for i in range(replicas):
            proc = ServiceProcess("policy", work, ["--nats-url", nats_url, "--member", f"{name}-{i + 1}"])
            procs.append(proc)
            await asyncio.to_thread(proc.start)
        target = grpc_target(parse_addresses(",".join(p.address for p in procs)))
        channel = cli_channel(target, "policy")
        top = Topology(name, nats_url, feed, procs, [], channel)
        for node, pods in PODS.items():
            dp = Datapath(feed.bus, target, node, pods)
            await dp.start()
            datapaths.append(dp)
        top.datapaths = datapaths
        yield top
    finally:
        for dp in datapaths:
            await dp.stop()
        if channel is not None:
            await channel.close()
        for proc in procs:
            proc.kill()
        await feed.close()


async def edit_to_realized(api: policy_pb2_grpc.PolicyServiceStub, port: int) -> float:
    started = time.perf_counter()
    answer = await api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=_edit(port)), timeout=30)
    waited = await api.WaitForRevision(
        policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=30), timeout=35
    )
    if not waited.realized:
        raise RuntimeError(f"revision {answer.revision} not realized: {waited}")
    return time.perf_counter() - started


async def failover(top: Topology, kills: int) -> dict[str, Any]:
    to_realized: list[float] = []
    to_leader: list[float] = []
    port = 20000
    for k in range(kills):
        roles = {p.address: await role(p) for p in top.replicas}
        leader = next(p for p in top.replicas if roles[p.address] == "leader")
        survivor = next(p for p in top.replicas if p is not leader)
        if roles[survivor.address] != "follower":
            raise RuntimeError(f"no warm follower before kill {k + 1}: {roles}")
        killed = time.perf_counter()
        leader.kill()
        port += 1
        lead_seen: float | None = None
        realized: float | None = None
        while realized is None:
            if lead_seen is None and await role(survivor) == "leader":
                lead_seen = time.perf_counter() - killed
            try:
                answer = await top.api.ImportPolicies(
                    policy_pb2.ImportPoliciesRequest(documents=_edit(port)), timeout=5
                )
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                await asyncio.sleep(0.05)
                continue
            waited = await top.api.WaitForRevision(
                policy_pb2.WaitForRevisionRequest(revision=answer.revision, timeout_seconds=30), timeout=35
            )
            if waited.realized:
                realized = time.perf_counter() - killed
        if lead_seen is None:
            lead_seen = realized
        to_realized.append(realized * 1000)
        to_leader.append(lead_seen * 1000)
        log(f"kill {k + 1}/{kills}: leader after {lead_seen:.2f}s, edit realized after {realized:.2f}s")
        # Back as a follower, warm, before the next kill.
        leader.start(wait=False)
        deadline = time.monotonic() + 60
        while await role(leader) != "follower":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the killed replica did not come back as follower:\n{leader.logs()[-2000:]}")
            await asyncio.sleep(0.1)
    return {"kill_to_edit_realized_ms": stats_ms(to_realized), "kill_to_new_leader_ms": stats_ms(to_leader)}


async def r3_cost(single: Topology, ha: Topology, edits: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"single": [], "ha_leader": [], "ha_follower": []}
    roles = {p.address: await role(p) for p in ha.replicas}
    leader = next(p for p in ha.replicas if roles[p.address] == "leader")
    follower = next(p for p in ha.replicas if p is not leader)
    leader_channel = cli_channel(leader.address, "policy")
    follower_channel = cli_channel(follower.address, "policy")
    apis = {
        "single": single.api,
        "ha_leader": policy_pb2_grpc.PolicyServiceStub(leader_channel),
        "ha_follower": policy_pb2_grpc.PolicyServiceStub(follower_channel),
    }
    try:
        port = 30000
        for api in apis.values():  # warm-up: channels, first orders
            port += 1
            await edit_to_realized(api, port)
        for _ in range(edits):
            for name, api in apis.items():  # interleaved: each round times all three
                port += 1  # every edit changes the policy (the HA replicas share one state)
                samples[name].append(await edit_to_realized(api, port) * 1000)
    finally:
        await leader_channel.close()
        await follower_channel.close()
    out: dict[str, Any] = {name: stats_ms(values) for name, values in samples.items()}
    for q in ("p50", "p99"):
        out[f"ratio_ha_over_single_{q}"] = round(out["ha_leader"][q] / out["single"][q], 2)
        out[f"ratio_follower_over_leader_{q}"] = round(out["ha_follower"][q] / out["ha_leader"][q], 2)
    return out


def members_down(rounds: int) -> dict[str, Any]:
    """Part 3: kill -9 each kind of member of a `make run --ha` stack, edit, time to enforced."""
    from testkit.harness import ROOT
    from testkit.stack import running_stack

    took: dict[str, list[float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="palisade-bench-ha-stack-") as tmp,
        running_stack(Path(tmp), ROOT / "examples", "--ha") as stack,
    ):
        for r in range(rounds):
            for kind in ("nats-1", "etcd-2", "ipam-1", "policy leader"):
                member = stack.policy_leader() if kind == "policy leader" else kind
                old = stack.kill(member)
                seconds = stack.check_policy_edit()
                took.setdefault(kind, []).append(seconds * 1000)
                log(f"round {r + 1}: {member} killed, edit enforced after {seconds:.2f}s")
                stack.serving_again(member, old)
    out: dict[str, Any] = {kind: stats_ms(values) for kind, values in took.items()}
    out["all_within_5s"] = all(v <= 5000 for values in took.values() for v in values)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="palisade-bench-ha-"))
    os.environ.setdefault("PALISADE_TLS_DIR", str(pki()))
    single_server = NatsServer(work / "single")
    cluster = NatsCluster(work / "cluster")
    try:
        single_server.start()
        cluster.start()
        async with (
            topology("single", single_server.url, single_server, 1, work) as single,
            topology("ha", cluster.url, cluster.members[0], 2, work) as ha,
        ):
            log("both topologies up")
            cost = await r3_cost(single, ha, args.edits)
            log(f"R3 cost: {cost}")
            fail = await failover(ha, args.kills)
    finally:
        cluster.stop()
        single_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = [
        {"metric": "policy leader kill -> edit realized p50", "value": fail["kill_to_edit_realized_ms"]["p50"],
         "unit": "ms"},
        {"metric": "policy leader kill -> edit realized p99", "value": fail["kill_to_edit_realized_ms"]["p99"],
         "unit": "ms"},
        {"metric": "policy leader kill -> new leader p50", "value": fail["kill_to_new_leader_ms"]["p50"], "unit": "ms"},
        {"metric": "edit -> realized, single server p50", "value": cost["single"]["p50"], "unit": "ms"},
        {"metric": "edit -> realized, R3 cluster p50", "value": cost["ha_leader"]["p50"], "unit": "ms"},
        {"metric": "R3 / single p50", "value": cost["ratio_ha_over_single_p50"], "unit": "x"},
        {"metric": "R3 / single p99", "value": cost["ratio_ha_over_single_p99"], "unit": "x"},
        {"metric": "via follower / via leader p50", "value": cost["ratio_follower_over_leader_p50"], "unit": "x"},
    ]  # fmt: skip
    down: dict[str, Any] = {"skipped": "needs root (make bench runs as root)"}
    if os.geteuid() == 0 and args.rounds > 0:
        down = await asyncio.to_thread(members_down, args.rounds)
        for kind in ("nats-1", "etcd-2", "ipam-1", "policy leader"):
            summary.append({"metric": f"{kind} killed: edit -> enforced max", "value": down[kind]["max"], "unit": "ms"})
        summary.append({"metric": "every edit enforced within 5 s", "value": int(down["all_within_5s"]), "unit": ""})
    return {
        "failover": fail,
        "r3_cost": cost,
        "members_down": down,
        "kills": args.kills,
        "edits": args.edits,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--edits", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="kills of each member kind on the --ha stack (0: skip)")
    p.add_argument("--quick", action="store_true", help="3 kills, 10 edits, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.kills, args.edits, args.rounds = 3, 10, 1
    print(json.dumps(asyncio.run(main_async(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
