"""The ipcache follower's mapping of entries onto the LPM map (no kernel: a recording map)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from palisade.v1 import identity_pb2
from services.common.labels import ReservedIdentity
from services.datapath.ipcachesync import IpcacheSync
from services.datapath.types import MIN_CIDR_IDENTITY, MIN_LOCAL_IDENTITY


class RecordingMap:
    def __init__(self) -> None:
        self.prefixes: dict[str, int] = {}

    def ipcache_upsert(self, prefix: str, identity: int) -> None:
        self.prefixes[prefix] = identity

    def ipcache_delete(self, prefix: str) -> object:
        return self.prefixes.pop(prefix, None)

    def ipcache_dump(self) -> Mapping[str, int]:
        return dict(self.prefixes)

    def ipcache_lookup(self, ip: str) -> int | None:
        address = ipaddress.ip_address(ip)
        held = [(n.prefixlen, i) for p, i in self.prefixes.items() if address in (n := ipaddress.ip_network(p))]
        return max(held)[1] if held else None


class NoEndpoints:
    def local_prefixes(self) -> dict[str, int]:
        return {}

    def local_identity(self, prefix: str) -> int | None:
        return None

    async def ipcache_identity(self, prefix: str, identity: int, namespace: str, pod: str) -> None:
        raise AssertionError("no local endpoint here")


def _node_entry(prefix: str, node: str, deleted: bool = False) -> identity_pb2.IpcacheEntry:
    return identity_pb2.IpcacheEntry(
        prefix=prefix, identity=int(ReservedIdentity.REMOTE_NODE), node=node, deleted=deleted
    )


async def test_node_addresses_are_host_on_their_own_node_and_remote_node_elsewhere() -> None:
    bpf = RecordingMap()
    sync = IpcacheSync(bpf, NoEndpoints(), "node-a")
    await sync._on_entry("palisade.ipcache.a", _node_entry("192.168.7.10/32", "node-a"))
    await sync._on_entry("palisade.ipcache.b", _node_entry("192.168.7.11/32", "node-b"))
    pod = identity_pb2.IpcacheEntry(prefix="10.244.1.5/32", identity=300, node="node-a", namespace="x", pod="a")
    await sync._on_entry("palisade.ipcache.c", pod)
    assert bpf.prefixes == {
        "192.168.7.10/32": ReservedIdentity.HOST,
        "192.168.7.11/32": ReservedIdentity.REMOTE_NODE,
        "10.244.1.5/32": 300,
    }
    await sync._on_entry("palisade.ipcache.a", _node_entry("192.168.7.10/32", "node-a", deleted=True))
    assert "192.168.7.10/32" not in bpf.prefixes


async def test_prune_keeps_the_dns_proxys_learned_addresses() -> None:
    """After the replay, prefixes the stream no longer has are removed, but not learned ones
    (node-local identities): they are the DNS proxy's, not the stream's."""
    bpf = RecordingMap()
    bpf.prefixes = {"198.51.100.7/32": MIN_LOCAL_IDENTITY + 3, "203.0.113.0/24": (1 << 24) + 5}
    sync = IpcacheSync(bpf, NoEndpoints(), "node-a")
    assert await sync._prune() == 1
    assert bpf.prefixes == {"198.51.100.7/32": MIN_LOCAL_IDENTITY + 3}


def _cidr_entry(prefix: str, identity: int = MIN_CIDR_IDENTITY + 5, deleted: bool = False) -> identity_pb2.IpcacheEntry:
    return identity_pb2.IpcacheEntry(prefix=prefix, identity=0 if deleted else identity, deleted=deleted)


async def test_cidr_prefixes_are_told_once_loaded_and_on_every_change() -> None:
    """The DNS proxy's learned addresses keep what the CIDR prefix holding them allowed: it is
    told the CIDR prefixes (ipam's CIDR identities only) after the replay and at each change."""
    told: list[dict[str, int]] = []
    sync = IpcacheSync(RecordingMap(), NoEndpoints(), "node-a", on_cidrs=lambda p: told.append(dict(p)))
    await sync._on_entry("palisade.ipcache.a", _cidr_entry("203.0.113.0/24"))
    pod = identity_pb2.IpcacheEntry(prefix="10.244.1.5/32", identity=300, node="node-b", namespace="x", pod="a")
    await sync._on_entry("palisade.ipcache.b", pod)
    assert told == [], "not during the replay"
    sync.loaded.set()
    sync._tell_cidrs()
    assert told == [{"203.0.113.0/24": MIN_CIDR_IDENTITY + 5}]
    await sync._on_entry("palisade.ipcache.c", _cidr_entry("198.51.100.0/25", MIN_CIDR_IDENTITY + 6))
    await sync._on_entry("palisade.ipcache.b", pod)  # not a CIDR: nothing told
    await sync._on_entry("palisade.ipcache.a", _cidr_entry("203.0.113.0/24", deleted=True))
    assert told[1:] == [
        {"203.0.113.0/24": MIN_CIDR_IDENTITY + 5, "198.51.100.0/25": MIN_CIDR_IDENTITY + 6},
        {"198.51.100.0/25": MIN_CIDR_IDENTITY + 6},
    ]


async def test_a_cidr_host_prefix_leaves_a_learned_address_in_place() -> None:
    """A CIDR /32 that a pod also resolved: the proxy's learned entry stays in the map (the proxy
    puts the CIDR's back when the address expires); other CIDR prefixes are written as usual."""
    bpf = RecordingMap()
    learned = MIN_LOCAL_IDENTITY + 3
    bpf.prefixes = {"198.51.100.7/32": learned}
    sync = IpcacheSync(bpf, NoEndpoints(), "node-a")
    await sync._on_entry("palisade.ipcache.a", _cidr_entry("198.51.100.7/32"))
    await sync._on_entry("palisade.ipcache.b", _cidr_entry("198.51.100.0/24", MIN_CIDR_IDENTITY + 6))
    assert bpf.prefixes == {"198.51.100.7/32": learned, "198.51.100.0/24": MIN_CIDR_IDENTITY + 6}
    await sync._on_entry("palisade.ipcache.a", _cidr_entry("198.51.100.7/32", deleted=True))
    assert bpf.prefixes == {"198.51.100.7/32": learned, "198.51.100.0/24": MIN_CIDR_IDENTITY + 6}
    assert sync.cidrs == {"198.51.100.0/24": MIN_CIDR_IDENTITY + 6}
