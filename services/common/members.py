"""The members of the clusters a service stands on, as it sees them, for `palisade status`.

A service cannot ask NATS or etcd for their members in the middle of answering a
status call without making that call slow when a member is gone, so a task refreshes
a cached view every few seconds and the status answer copies it. NATS members are
the replicas of one stream the service uses (the leader of its raft group and each
follower's state); etcd members are the cluster's, each asked for its own status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aetcd
from aetcd import rpc

from palisade.v1 import common_pb2
from services.common.bus import Bus
from services.common.grpcserver import open_channel
from services.common.log import get_logger
from services.common.trust import Credentials

log = get_logger("members")

Fetch = Callable[[], Awaitable[list[common_pb2.Member]]]


class MemberView:
    """The last members ``fetch`` returned, refreshed every ``interval`` seconds by :meth:`run`."""

    def __init__(self, fetch: Fetch, interval: float = 2.0) -> None:
        self._fetch = fetch
        self._interval = interval
        self.members: list[common_pb2.Member] = []

    def __call__(self) -> list[common_pb2.Member]:
        return list(self.members)

    async def run(self) -> None:
        while True:
            try:
                self.members = await asyncio.wait_for(self._fetch(), max(1.0, self._interval))
            except Exception as exc:  # the dependency is away: its own health check says so
                log.debug("members not refreshed", error=repr(exc))
            await asyncio.sleep(self._interval)


def nats_members(bus: Bus, stream: str) -> Fetch:
    """The NATS servers holding ``stream``: its raft leader, and each follower's state."""

    async def fetch() -> list[common_pb2.Member]:
        cluster = (await bus.js.stream_info(stream)).cluster
        if cluster is None or not cluster.leader:
            return []  # a single server: nothing replicated to report
        out = [common_pb2.Member(group="nats", name=cluster.leader, role="leader", health="ok")]
        for peer in cluster.replicas or ():
            if peer.offline:
                health = "offline"
            elif not peer.current:
                health = f"lagging by {peer.lag or 0} operations"
            else:
                health = "ok"
            out.append(common_pb2.Member(group="nats", name=peer.name or "", role="follower", health=health))
        return sorted(out, key=lambda m: m.name)

    return fetch


def etcd_members(client: aetcd.Client, tls: Credentials | None) -> Fetch:
    """Every etcd member, each asked at its own advertised client URL whether it answers and whom
    it follows (the client's own channel may go through a Service that picks any member)."""
    stubs: dict[str, rpc.MaintenanceStub] = {}

    async def ask(address: str) -> rpc.StatusResponse | None:
        if not address:
            return None
        stub = stubs.get(address)
        if stub is None:
            stub = stubs[address] = rpc.MaintenanceStub(open_channel(address, "etcd", tls))
        try:
            return await stub.Status(rpc.StatusRequest(), timeout=1.0)
        except Exception:
            return None

    async def fetch() -> list[common_pb2.Member]:
        known = [m async for m in client.members()]
        addresses = [next((u.rpartition("//")[2] for u in m.client_urls), "") for m in known]
        answers = await asyncio.gather(*(ask(a) for a in addresses))
        leaders = {a.leader for a in answers if a is not None}
        out = []
        for member, address, answer in zip(known, addresses, answers, strict=True):
            if answer is None:
                health = "unreachable"
            elif answer.errors:
                health = "; ".join(answer.errors)
            else:
                health = "ok"
            role = "leader" if leaders == {member.id} else "follower"
            out.append(common_pb2.Member(group="etcd", name=member.name, address=address, role=role, health=health))
        return sorted(out, key=lambda m: m.name)

    return fetch
