"""Names on flows: the proxy is asked only for a learned address its last answer did not hold,
on a flow newer than that answer; without the proxy, flows pass unnamed."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import datapath_pb2
from services.datapath.fqdnapi import MISS_INTERVAL, FlowNames
from services.datapath.fqdnview import LearnedAddress, NamesView
from services.datapath.namesapi import NamesUnavailable
from services.datapath.types import IDENTITY_WORLD, MIN_LOCAL_IDENTITY

LEARNED = MIN_LOCAL_IDENTITY + 1


class Proxy:
    """The proxy's answers as the test sets them, and how often it was asked."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.asked = 0
        self.down = False

    async def read(self) -> NamesView:
        self.asked += 1
        if self.down:
            raise NamesUnavailable("the node's DNS proxy does not answer")
        return NamesView(tuple(LearnedAddress(n, ip, LEARNED, 30, 0, (1,)) for ip, n in self.names.items()))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def flow(ip: str, at: float, identity: int = LEARNED) -> datapath_pb2.FlowEvent:
    return datapath_pb2.FlowEvent(
        time=Timestamp(seconds=int(at), nanos=int(at % 1 * 1e9)),
        source_ip="10.0.0.1",
        source_identity=300,
        destination_ip=ip,
        destination_identity=identity,
    )


async def test_the_proxy_is_asked_once_per_new_address() -> None:
    proxy, clock = Proxy(), Clock()
    names = FlowNames(proxy.read, clock)
    proxy.names["192.0.2.1"] = "api.example.test"
    assert list((await names.name(flow("192.0.2.1", clock.now))).destination_names) == ["api.example.test"]
    for _ in range(5):
        await names.name(flow("192.0.2.1", clock.now))
    assert proxy.asked == 1
    # Not a learned address (its identity is not node-local): never asked, never named.
    proxy.names["203.0.113.9"] = "other.test"
    plain = flow("203.0.113.9", clock.now, IDENTITY_WORLD)
    assert await names.name(plain) is plain and proxy.asked == 1
    # Learned after the last answer: the next flow to it asks again and is named.
    clock.now += 0.01
    proxy.names["192.0.2.3"] = "www.example.test"
    assert list((await names.name(flow("192.0.2.3", clock.now))).destination_names) == ["www.example.test"]
    assert proxy.asked == 2
    # An old flow (the ring's history) of an address the proxy no longer holds asks nothing.
    assert list((await names.name(flow("192.0.2.9", clock.now - 60))).destination_names) == []
    assert proxy.asked == 2


async def test_an_address_the_proxy_did_not_hold_is_asked_for_again_only_after_a_while() -> None:
    proxy, clock = Proxy(), Clock()
    names = FlowNames(proxy.read, clock)
    for _ in range(3):
        assert list((await names.name(flow("192.0.2.5", clock.now))).destination_names) == []
    assert proxy.asked == 1
    proxy.names["192.0.2.5"] = "late.example.test"
    clock.now += MISS_INTERVAL
    assert list((await names.name(flow("192.0.2.5", clock.now))).destination_names) == ["late.example.test"]
    assert proxy.asked == 2


async def test_without_the_proxy_flows_pass_unnamed_and_it_is_asked_again_later() -> None:
    proxy, clock = Proxy(), Clock()
    proxy.down = True
    names = FlowNames(proxy.read, clock)
    event = flow("192.0.2.1", clock.now)
    assert await names.name(event) is event
    assert await names.name(flow("192.0.2.1", clock.now)) is not None and proxy.asked == 1
    proxy.down = False
    proxy.names["192.0.2.1"] = "api.example.test"
    clock.now += MISS_INTERVAL
    assert list((await names.name(flow("192.0.2.1", clock.now))).destination_names) == ["api.example.test"]
