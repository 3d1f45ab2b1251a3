"""What a datapath holds after applying orders: identity -> (enforcement, entries), and its rules on
names (toFQDNs and DNS rules). Pure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from palisade.v1 import common_pb2, policy_pb2

EntryKey = tuple[int, int, int, int, int]
IdentityState = tuple[tuple[bool, bool], dict[EntryKey, int]]
#: (selector, protocol, port_low, port_high, verdict) of each FqdnRule, and
#: (remote identity, protocol, port, selectors, verdict) of each DnsRule, as received.
Names = tuple[
    tuple[tuple[str, int, int, int, int], ...],
    tuple[tuple[int, int, int, tuple[str, ...], int], ...],
]


def names_of(message: common_pb2.IdentityPolicy | common_pb2.IdentityPolicyDiff) -> Names:
    return (
        tuple((r.selector, r.protocol, r.port_low, r.port_high, r.verdict) for r in message.fqdn_rules),
        tuple((r.remote_identity, r.protocol, r.port, tuple(r.selectors), r.verdict) for r in message.dns_rules),
    )


def names_from_policies(policies: Iterable[common_pb2.IdentityPolicy]) -> dict[int, Names]:
    """Identities with rules on names only (as a node keeps them)."""
    return {p.identity: names_of(p) for p in policies if p.fqdn_rules or p.dns_rules}


def entry_key(key: common_pb2.PolicyKey) -> EntryKey:
    return (key.direction, key.remote_identity, key.protocol, key.port_low, key.port_high)


def from_policies(policies: Iterable[common_pb2.IdentityPolicy]) -> dict[int, IdentityState]:
    return {
        p.identity: (
            (p.enforcement.ingress, p.enforcement.egress),
            {entry_key(e.key): e.verdict for e in p.entries},
        )
        for p in policies
    }


class GapError(Exception):
    """The next order is not sequence + 1, or must be fetched: resync."""


@dataclass
class NodeState:
    """Applies complete orders in sequence; raises GapError when it cannot."""

    sequence: int = 0
    revision: int = 0
    policies: dict[int, IdentityState] = field(default_factory=dict)
    names: dict[int, Names] = field(default_factory=dict)
    chunks: dict[int, list[policy_pb2.RegenerationOrder]] = field(default_factory=dict)

    def reset(self, response: policy_pb2.ResyncResponse) -> None:
        self.sequence = response.sequence
        self.revision = response.revision
        self.policies = from_policies(response.policies)
        self.names = names_from_policies(response.policies)
        self.chunks = {s: c for s, c in self.chunks.items() if s > response.sequence}

    def offer(self, order: policy_pb2.RegenerationOrder) -> bool:
        """Apply (or buffer) one message; True when an order was applied."""
        if order.sequence <= self.sequence:
            return False
        if order.sequence != self.sequence + 1:
            raise GapError(f"expected sequence {self.sequence + 1}, got {order.sequence}")
        if order.fetch:
            raise GapError("fetch")
        parts = [order]
        if order.chunks > 1:
            buffered = self.chunks.setdefault(order.sequence, [])
            buffered.append(order)
            if len(buffered) < order.chunks:
                return False
            parts = sorted(self.chunks.pop(order.sequence), key=lambda o: o.chunk)
        if order.replace:
            self.policies = {}
            self.names = {}
        for part in parts:
            for identity in part.removed_identities:
                self.policies.pop(identity, None)
                self.names.pop(identity, None)
            for diff in part.diffs:
                self.apply_diff(diff)
        self.sequence = order.sequence
        self.revision = order.revision
        return True

    def apply_diff(self, diff: common_pb2.IdentityPolicyDiff) -> None:
        _, entries = self.policies.get(diff.identity, ((False, False), {}))
        entries = {} if diff.full else dict(entries)
        for e in diff.remove:
            entries.pop(entry_key(e.key), None)
        for e in diff.add:
            entries[entry_key(e.key)] = e.verdict
        self.policies[diff.identity] = ((diff.enforcement.ingress, diff.enforcement.egress), entries)
        if diff.full and not diff.names_changed:
            raise ValueError(f"identity {diff.identity}: a full diff must carry its rules on names")
        if diff.names_changed:
            names = names_of(diff)
            if names[0] or names[1]:
                self.names[diff.identity] = names
            else:
                self.names.pop(diff.identity, None)
