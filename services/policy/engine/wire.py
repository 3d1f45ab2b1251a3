"""Conversions between the engine's dataclasses and the protobuf contracts.

The only module of the service that knows both shapes; byte-for-byte what the
datapath receives is decided here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from palisade.v1 import common_pb2
from services.common.labels import Label, LabelSet
from services.policy.engine.model import Direction, EntryKey, PolicyRef, Verdict
from services.policy.engine.policyengine import PolicyDiff
from services.policy.engine.resolve import ResolvedPolicy

_DIRECTIONS = {Direction.INGRESS: common_pb2.DIRECTION_INGRESS, Direction.EGRESS: common_pb2.DIRECTION_EGRESS}
_VERDICTS = {Verdict.ALLOW: common_pb2.VERDICT_ALLOW, Verdict.DENY: common_pb2.VERDICT_DENY}


def direction_to_proto(direction: Direction) -> common_pb2.Direction.ValueType:
    return _DIRECTIONS[direction]


def verdict_to_proto(verdict: Verdict) -> common_pb2.Verdict.ValueType:
    return _VERDICTS[verdict]


def key_to_proto(key: EntryKey) -> common_pb2.PolicyKey:
    return common_pb2.PolicyKey(
        direction=_DIRECTIONS[key.direction],
        remote_identity=key.identity,
        protocol=int(key.protocol),  # type: ignore[arg-type]  # IP protocol numbers are the enum values
        port_low=key.port_low,
        port_high=key.port_high,
    )


def entries_to_proto(entries: Mapping[EntryKey, Verdict]) -> list[common_pb2.PolicyEntry]:
    """Entries sorted by key, so equal policies serialize identically."""
    return [common_pb2.PolicyEntry(key=key_to_proto(k), verdict=_VERDICTS[v]) for k, v in sorted(entries.items())]


def removals_to_proto(keys: Iterable[EntryKey]) -> list[common_pb2.PolicyEntry]:
    return [common_pb2.PolicyEntry(key=key_to_proto(k)) for k in sorted(keys)]


def enforcement(ingress: bool, egress: bool) -> common_pb2.Enforcement:
    return common_pb2.Enforcement(ingress=ingress, egress=egress)


def diff_to_proto(diff: PolicyDiff) -> common_pb2.IdentityPolicyDiff:
    """An incremental diff: remove first, then add (a key whose verdict changed is in both)."""
    return common_pb2.IdentityPolicyDiff(
        identity=diff.identity,
        enforcement=enforcement(diff.ingress_enforced, diff.egress_enforced),
        add=entries_to_proto(diff.added),
        remove=removals_to_proto(diff.removed),
    )


def full_diff_to_proto(policy: ResolvedPolicy) -> common_pb2.IdentityPolicyDiff:
    """The whole policy of an identity as a diff that replaces whatever the receiver had."""
    return common_pb2.IdentityPolicyDiff(
        identity=policy.identity,
        enforcement=enforcement(policy.ingress_enforced, policy.egress_enforced),
        add=entries_to_proto(policy.entries),
        full=True,
    )


def policy_to_proto(policy: ResolvedPolicy) -> common_pb2.IdentityPolicy:
    return common_pb2.IdentityPolicy(
        identity=policy.identity,
        enforcement=enforcement(policy.ingress_enforced, policy.egress_enforced),
        entries=entries_to_proto(policy.entries),
    )


def labels_from_proto(labels: Iterable[common_pb2.Label]) -> LabelSet:
    return LabelSet(tuple(Label(lb.source, lb.key, lb.value) for lb in labels))


def ref_to_proto(key: PolicyRef) -> common_pb2.ObjectRef:
    return common_pb2.ObjectRef(kind=key.kind.value, namespace=key.namespace, name=key.name)
