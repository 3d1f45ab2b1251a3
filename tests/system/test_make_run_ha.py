"""`make run --ha`: 3 NATS servers, 3 etcd members, 2 ipam replicas; losing one loses nothing.

Under counted traffic (an allowed and a denied peer), kill -9 one member of each; while it
is gone a policy edit is made and must be enforced, no denied connection gets in and no
allowed one fails. (The policy service is still one process: see the HA issue.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from services.common.bus import ALL_STREAMS, Bus
from services.common.trust import Credentials
from tests.harness import ROOT
from tests.system.stack import Stack, Traffic, running_stack

pytestmark = [pytest.mark.root, pytest.mark.bcc]

ALLOWED = [("shop/backend", 8080)]
DENIED = [("shop/db", 5432)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("ha"), ROOT / "examples", "--ha") as s:
        yield s


def nats_urls(stack: Stack) -> list[str]:
    conf = [line for line in stack.output if line.strip().startswith("nats-")]
    return ["nats://" + line.split()[1] for line in conf]


async def replicas(stack: Stack) -> dict[str, int]:
    # The policy service's bus user may read every stream's configuration.
    bus = await Bus.connect(nats_urls(stack), name="ha-check", tls=Credentials.load(stack.tls_dir, "policy"))
    try:
        return {s.name: (await bus.js.stream_info(s.name)).config.num_replicas or 1 for s in ALL_STREAMS}
    finally:
        await bus.close()


def test_every_stream_has_three_replicas_over_three_servers(stack: Stack) -> None:
    assert len(nats_urls(stack)) == 3
    assert asyncio.run(replicas(stack)) == {s.name: 3 for s in ALL_STREAMS}
    members = [line.split()[0] for line in stack.output if line.startswith("  ")]
    assert {"etcd-1", "etcd-2", "etcd-3", "ipam-1", "ipam-2"} <= set(members)


@pytest.mark.parametrize("member", ["nats-1", "etcd-2", "ipam"])
def test_losing_one_member_loses_nothing_and_an_edit_meanwhile_is_enforced(stack: Stack, member: str) -> None:
    with Traffic(stack, "shop/frontend", ALLOWED, DENIED) as traffic:
        time.sleep(0.5)
        old = stack.kill(member)
        stack.check_policy_edit()  # made and enforced while the member is gone
        stack.serving_again(member, old)
        time.sleep(0.5)
    counts = traffic.counts
    assert counts["denied_admitted"] == 0, counts
    assert counts["allowed_failed"] == 0, counts
    assert counts["allowed_ok"] > 0 and counts["denied_blocked"] > 0, counts
