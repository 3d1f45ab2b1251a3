"""CIDR rules with the real ipam: the policy leader holds a CIDR identity per prefix policies name.

A toCIDR policy's endpoint gets an allow entry for the CIDR identity of the prefix (allocated in
ipam by the policy service, announced by ipam with its ipcache entry); deleting the policy
releases it. With ipam away, policy changes still commit and the failure shows in status until
ipam is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc

from palisade.v1 import common_pb2, common_pb2_grpc, identity_pb2, identity_pb2_grpc
from testkit.harness import EtcdServer, NatsServer, ServiceProcess, channel
from testkit.ipam import BusView
from testkit.policycluster import Datapath, Feed, eventually, start_policy
from tests.policy_service.test_end_to_end import apply, pod, resolve

NS = "shop"
EGRESS = common_pb2.DIRECTION_EGRESS


def to_outside(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "web"}},
            "egress": [
                {"toCIDR": ["198.51.100.10/32"], "toPorts": [{"ports": [{"port": "443", "protocol": "TCP"}]}]},
                {
                    "toCIDRSet": [{"cidr": "198.51.100.0/24", "except": ["198.51.100.11/32"]}],
                    "toPorts": [{"ports": [{"port": "8444", "protocol": "TCP"}]}],
                },
            ],
        },
    }


PREFIXES = {"198.51.100.10/32", "198.51.100.0/24", "198.51.100.11/32"}


async def cidr_identities(ipam: grpc.aio.Channel) -> dict[str, tuple[int, int]]:
    """Every CIDR identity ipam has: prefix -> (id, references)."""
    listed = await identity_pb2_grpc.IdentityServiceStub(ipam).ListIdentities(
        identity_pb2.ListIdentitiesRequest(), timeout=5
    )
    return {x.cidr: (x.id, x.references) for x in listed.identities if x.kind == identity_pb2.IDENTITY_KIND_CIDR}


async def held(ipam: grpc.aio.Channel) -> dict[str, int]:
    return {prefix: ident for prefix, (ident, refs) in (await cidr_identities(ipam)).items() if refs > 0}


async def details(policy: ServiceProcess) -> dict[str, str]:
    async with channel(policy.address, "policy") as ch:
        status = await common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=5)
    return dict(status.details)


def allowed(dp: Datapath, subject: int) -> set[tuple[int, int]]:
    """(remote identity, port) of the subject's egress allow entries on the node."""
    state = dp.state.policies.get(subject)
    if state is None:
        return set()
    return {(k[1], k[3]) for k, verdict in state[1].items() if k[0] == EGRESS and verdict == common_pb2.VERDICT_ALLOW}


def ipam_service(service: Callable[..., ServiceProcess], nats: NatsServer, etcd: EtcdServer) -> ServiceProcess:
    args = ["--nats-url", nats.url, "--etcd-endpoints", etcd.endpoint, "--identity-gc-grace", "1"]
    return service("ipam", *args, "--identity-gc-interval", "0.3", "--log-format", "text", wait=False)


async def ipam_policy_and_web(
    service: Callable[..., ServiceProcess], nats: NatsServer, etcd: EtcdServer, feed: Feed
) -> tuple[ServiceProcess, ServiceProcess, Datapath, int]:
    """ipam, the policy service using it, and node-a's datapath holding web-1 by its identity from ipam."""
    ipam = ipam_service(service, nats, etcd)
    await asyncio.to_thread(ipam.wait_serving)
    policy = await start_policy(service, nats, "--ipam-address", ipam.address)
    async with channel(ipam.address, "ipam", "datapath") as ipam_channel:
        web = (await eventually(partial(resolve, ipam_channel, "web-1"), "web-1's identity")).identity.id
    dp = Datapath(feed.bus, policy.address, "node-a", {f"{NS}/web-1": (1, web)})
    await dp.start()
    return ipam, policy, dp, web


async def test_a_to_cidr_policy_gets_cidr_identities_from_ipam_and_releases_them(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess]
) -> None:
    feed = await Feed.open(nats_server)
    view = await BusView.start(feed.bus)
    await apply(feed, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await apply(feed, pod("web-1", "web", "node-a", "10.244.0.10"))
    await feed.policy(to_outside("web-to-outside"))
    await feed.synced()
    ipam, policy, dp, web = await ipam_policy_and_web(service, nats_server, etcd_server, feed)
    async with channel(ipam.address, "ipam", "datapath") as ipam_channel:
        ids = await eventually(lambda: _all_held(ipam_channel), "a CIDR identity per prefix")
        for prefix in PREFIXES:
            entry = await eventually(partial(view.entry, prefix), f"the ipcache entry of {prefix}")
            assert entry.identity == ids[prefix]
        want = {(ids["198.51.100.10/32"], 443), (ids["198.51.100.10/32"], 8444), (ids["198.51.100.0/24"], 8444)}
        await eventually(lambda: allowed(dp, web) == want, "web's egress allows the CIDR identities")
        assert (await details(policy))["cidr_identities"] == "3 of 3 prefixes"

        # The policy goes: its prefixes' references are released, their entries tombstoned.
        await feed.policy(to_outside("web-to-outside"), delete=True)
        await eventually(lambda: _none_held(ipam_channel), "the CIDR identities released")
        await eventually(lambda: all(view.ipcache[p].deleted for p in PREFIXES), "the entries tombstoned")
        await eventually(lambda: allowed(dp, web) == set(), "web's egress entries gone")
        assert (await details(policy))["cidr_identities"] == "0 of 0 prefixes"
        await dp.stop()
    assert policy.terminate() == 0
    await feed.close()


async def test_with_ipam_away_changes_commit_and_the_failure_shows_until_ipam_is_back(
    nats_server: NatsServer, etcd_server: EtcdServer, service: Callable[..., ServiceProcess]
) -> None:
    feed = await Feed.open(nats_server)
    await apply(feed, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await apply(feed, pod("web-1", "web", "node-a", "10.244.0.10"))
    await feed.synced()
    ipam, policy, dp, web = await ipam_policy_and_web(service, nats_server, etcd_server, feed)
    ipam.kill()

    # The policy commits and reaches the node without its CIDR identities: egress is enforced at once.
    await feed.policy(to_outside("web-to-outside"))
    await eventually(lambda: (s := dp.state.policies.get(web)) is not None and s[0][1], "web's egress enforced")
    assert allowed(dp, web) == set()
    error = await eventually(
        lambda: _detail(policy, "cidr_identities_error"), "the failure in the policy service's status"
    )
    assert "ipam" in error and "--ipam-address" in error
    # An unrelated change commits meanwhile.
    await apply(feed, pod("web-2", "web", "node-a", "10.244.0.11"))

    ipam.start(wait=False)
    await asyncio.to_thread(ipam.wait_serving)
    async with channel(ipam.address, "ipam", "datapath") as ipam_channel:
        ids = await eventually(lambda: _all_held(ipam_channel), "the CIDR identities once ipam is back")
    await eventually(lambda: (ids["198.51.100.10/32"], 443) in allowed(dp, web), "the allow entry once ipam is back")
    assert "cidr_identities_error" not in await details(policy)
    await dp.stop()
    assert policy.terminate() == 0
    await feed.close()


async def _detail(policy: ServiceProcess, key: str) -> str:
    return (await details(policy)).get(key, "")


async def _all_held(ipam: grpc.aio.Channel) -> dict[str, int] | None:
    found = await held(ipam)
    return found if set(found) == PREFIXES else None


async def _none_held(ipam: grpc.aio.Channel) -> bool:
    return not await held(ipam)
