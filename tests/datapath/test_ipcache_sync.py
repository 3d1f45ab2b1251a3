"""The ipcache follower's mapping of entries onto the LPM map (no kernel: a recording map)."""

from __future__ import annotations

from collections.abc import Mapping

from palisade.v1 import identity_pb2
from services.common.labels import ReservedIdentity
from services.datapath.ipcachesync import IpcacheSync
from services.datapath.types import MIN_LOCAL_IDENTITY


class RecordingMap:
    def __init__(self) -> None:
        self.prefixes: dict[str, int] = {}

    def ipcache_upsert(self, prefix: str, identity: int) -> None:
        self.prefixes[prefix] = identity

    def ipcache_delete(self, prefix: str) -> object:
        return self.prefixes.pop(prefix, None)

    def ipcache_dump(self) -> Mapping[str, int]:
        return dict(self.prefixes)


class NoEndpoints:
    def local_prefixes(self) -> dict[str, int]:
        return {}

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
