"""A PolicyCore driven by hand, with every node's applied state, for pure tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from palisade.v1 import common_pb2, policy_pb2
from services.policy.engine.core import Commit, Outcome, PolicyCore
from services.policy.engine.orders import PersistedState, PlannedOrder, encode
from services.policy.engine.realized import Report
from services.policy.engine.sources import Source
from tests.policy_service import builders
from tests.policy_service.nodestate import IdentityState, NodeState, from_policies


class World:
    def __init__(self, persisted: PersistedState | None = None, *, max_bytes: int = 1 << 20) -> None:
        self.core = PolicyCore(persisted=persisted or PersistedState())
        self.now = 100.0
        self.max_bytes = max_bytes
        # Datapaths that applied everything up to the persisted sequences.
        self.nodes: dict[str, NodeState] = {
            node: NodeState(sequence=seq) for node, seq in (persisted.sequences if persisted else {}).items()
        }
        self.commits: list[Commit] = []

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    # --- inputs ---------------------------------------------------------------------------

    def identity(self, number: int, namespace: str = "default", **labels: str) -> None:
        self.core.apply_identity(
            f"palisade.identity.{number}", builders.identity_update(number, labels, namespace), self.tick()
        )

    def forget_identity(self, number: int) -> None:
        update = builders.identity_update(number, {}, deleted=True)
        self.core.apply_identity(f"palisade.identity.{number}", update, self.tick())

    def pod(self, ip: str, identity: int, node: str, name: str, **kw: Any) -> None:
        entry = builders.ipcache_entry(ip, identity, node, name, **kw)
        self.core.apply_ipcache(f"palisade.ipcache.{ip}", entry, self.tick())

    def unpod(self, ip: str) -> None:
        entry = builders.ipcache_entry(ip, 0, "", "", deleted=True)
        self.core.apply_ipcache(f"palisade.ipcache.{ip}", entry, self.tick())

    def policy(self, doc: Mapping[str, Any]) -> Outcome | None:
        return self.core.apply_policy_delta(builders.delta(doc), self.tick())

    def delete_policy(self, doc: Mapping[str, Any]) -> None:
        self.core.apply_policy_delta(builders.delta(doc, delete=True), self.tick())

    def import_policy(self, doc: Mapping[str, Any]) -> Outcome:
        return self.core.upsert(Source.API, doc, "", self.tick())

    def report(
        self, node: str, pod: str, identity: int, revision: int, endpoint_id: int = 1
    ) -> list[tuple[int, float]]:
        return self.core.report([Report(node, endpoint_id, identity, revision, pod)], self.tick())

    # --- outputs ------------------------------------------------------------------------------

    def sync(self) -> Commit:
        self.core.mark_synced(self.tick())
        return self.commit()

    def commit(self) -> Commit:
        commit = self.core.commit(self.tick())
        self.commits.append(commit)
        for order in commit.orders:
            self.apply(order)
        return commit

    def apply(self, order: PlannedOrder) -> None:
        state = self.nodes.setdefault(order.node, NodeState())
        for message in encode(order, max_bytes=self.max_bytes, max_chunks=1000):
            state.offer(message)

    def orders_by_node(self, commit: Commit) -> dict[str, PlannedOrder]:
        out = {o.node: o for o in commit.orders}
        assert len(out) == len(commit.orders), "one order per node per commit"
        return out

    def request(self, node: str, identity: int) -> None:
        """A datapath fetching one identity's policy by name (a pod the ipcache does not know)."""
        answer = self.core.resync(node, [identity])
        state = self.nodes.setdefault(node, NodeState())
        state.policies.update(from_policies(answer.policies))

    def resync(self, node: str) -> dict[int, IdentityState]:
        answer = self.core.resync(node)
        return from_policies(answer.policies)

    def resync_response(self, node: str) -> policy_pb2.ResyncResponse:
        answer = self.core.resync(node)
        return policy_pb2.ResyncResponse(revision=answer.revision, sequence=answer.sequence, policies=answer.policies)

    def assert_nodes_match_resync(self) -> None:
        for node, state in self.nodes.items():
            answer = self.core.resync(node)
            assert state.sequence == answer.sequence, node
            assert state.policies == from_policies(answer.policies), node


def ingress_key(remote: int, port: int) -> tuple[int, int, int, int, int]:
    return (common_pb2.DIRECTION_INGRESS, remote, common_pb2.PROTOCOL_TCP, port, port)
