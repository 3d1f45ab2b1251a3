"""A PolicyCore driven by hand, with every node's applied state, for pure tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from palisade.v1 import common_pb2, identity_pb2, k8s_pb2, policy_pb2
from services.common.subjects import identity_subject, ipcache_subject
from services.policy.engine.core import Commit, Outcome, PolicyCore
from services.policy.engine.orders import PlannedOrder, PolicyEpoch
from services.policy.engine.realized import Report
from services.policy.engine.sources import Source
from services.policy.wire import delta_from_proto, encode, identity_from_proto, policy_to_proto, record_from_proto
from testkit import builders
from testkit.nodestate import IdentityState, NodeState, from_policies


class World:
    def __init__(
        self, persisted: PolicyEpoch | None = None, *, max_bytes: int = 1 << 20, bump_interval: float = 0.0
    ) -> None:
        self.core = PolicyCore(persisted=persisted or PolicyEpoch(), bump_interval=bump_interval)
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
        self.apply_identity(builders.identity_update(number, labels, namespace))

    def forget_identity(self, number: int) -> None:
        self.apply_identity(builders.identity_update(number, {}, deleted=True))

    def apply_identity(self, update: identity_pb2.IdentityUpdate) -> None:
        """An identity update as the service's edge decodes it."""
        change = identity_from_proto(identity_subject(update.identity.id), update)
        assert change is not None
        self.core.apply_identity(change, self.tick())

    def pod(self, ip: str, identity: int, node: str, name: str, **kw: Any) -> None:
        entry = builders.ipcache_entry(ip, identity, node, name, **kw)
        self.core.apply_ipcache(ipcache_subject(ip), record_from_proto(entry), self.tick())

    def unpod(self, ip: str) -> None:
        self.core.apply_ipcache(ipcache_subject(ip), None, self.tick())

    def policy(self, doc: Mapping[str, Any]) -> Outcome | None:
        return self.delta(builders.delta(doc))

    def delete_policy(self, doc: Mapping[str, Any]) -> None:
        self.delta(builders.delta(doc, delete=True))

    def delta(self, delta: k8s_pb2.K8sDelta) -> Outcome | None:
        """A watcher's delta as the service's edge decodes it."""
        return self.core.apply_policy_delta(delta_from_proto(delta), self.tick())

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
        state.policies.update(from_policies(map(policy_to_proto, answer.policies)))

    def resync(self, node: str) -> dict[int, IdentityState]:
        answer = self.core.resync(node)
        return from_policies(map(policy_to_proto, answer.policies))

    def resync_response(self, node: str) -> policy_pb2.ResyncResponse:
        answer = self.core.resync(node)
        return policy_pb2.ResyncResponse(
            revision=answer.revision, sequence=answer.sequence, policies=list(map(policy_to_proto, answer.policies))
        )

    def assert_nodes_match_resync(self) -> None:
        for node, state in self.nodes.items():
            answer = self.core.resync(node)
            assert state.sequence == answer.sequence, node
            assert state.policies == from_policies(map(policy_to_proto, answer.policies)), node


def ingress_key(remote: int, port: int) -> tuple[int, int, int, int, int]:
    return (common_pb2.DIRECTION_INGRESS, remote, common_pb2.PROTOCOL_TCP, port, port)
