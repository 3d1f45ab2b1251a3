"""What of an object matters to policy, and the noise stripped before publishing.

Cilium's watchers drop an update when the old and new objects are DeepEqual after
conversion to their "slim" types, which keep only what the agent uses. Here the
same idea is a per-kind *relevant view*: an update whose view equals the previous
one (only resourceVersion, managedFields, heartbeats, conditions... moved) is
skipped. A pod's IPs and phase are part of its view: they decide the ipcache.

Pure functions over plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.watcher.kinds import Kind

#: Metadata that identifies or labels an object; everything else there is bookkeeping.
_META_KEYS = ("name", "namespace", "uid", "labels", "annotations", "deletionTimestamp", "ownerReferences")

#: Annotations that repeat the object itself or change without meaning anything to policy.
_NOISY_ANNOTATIONS = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})

#: Per kind: (top-level field, sub-fields or None for the whole field) that matter beyond metadata.
_RELEVANT: dict[Kind, tuple[tuple[str, tuple[str, ...] | None], ...]] = {
    Kind.NAMESPACE: (("status", ("phase",)),),
    Kind.POD: (
        ("spec", None),
        ("status", ("podIP", "podIPs", "phase", "hostIP", "hostIPs")),
    ),
    Kind.NODE: (
        ("spec", ("podCIDR", "podCIDRs")),
        ("status", ("addresses",)),
    ),
    # Policies: every top-level field but status (see _POLICY_KINDS).
    Kind.NETWORK_POLICY: (),
    Kind.CILIUM_NETWORK_POLICY: (),
    Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY: (),
    # What the datapath load-balances and toServices names; a Service's status (load balancer) is not.
    Kind.SERVICE: (("spec", None),),
    Kind.ENDPOINT_SLICE: (("addressType", None), ("endpoints", None), ("ports", None)),
}


#: Kinds whose every top-level field matters (status aside: Cilium agents write per-node
#: enforcement there): a field the policy service does not know is an error it must see,
#: so a change to a misspelled top-level field is published too.
_POLICY_KINDS = frozenset({Kind.NETWORK_POLICY, Kind.CILIUM_NETWORK_POLICY, Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY})
_NOT_POLICY_INPUT = frozenset({"apiVersion", "kind", "metadata", "status"})


def strip_noise(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``obj`` without ``metadata.managedFields`` (the input is not modified)."""
    out = dict(obj)
    meta = out.get("metadata")
    if isinstance(meta, Mapping) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def relevant_view(kind: Kind, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``obj`` that policy, identities and the ipcache depend on."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    view_meta = {k: meta[k] for k in _META_KEYS if k in meta}
    annotations = view_meta.get("annotations")
    if isinstance(annotations, Mapping) and _NOISY_ANNOTATIONS.intersection(annotations):
        view_meta["annotations"] = {k: v for k, v in annotations.items() if k not in _NOISY_ANNOTATIONS}
    # No labels and empty labels are the same thing.
    for key in ("labels", "annotations"):
        if not view_meta.get(key):
            view_meta.pop(key, None)
    view: dict[str, Any] = {"apiVersion": obj.get("apiVersion"), "metadata": view_meta}
    if kind in _POLICY_KINDS:
        view.update((k, v) for k, v in obj.items() if k not in _NOT_POLICY_INPUT)
    for field, subfields in _RELEVANT[kind]:
        value = obj.get(field)
        if value is None:
            continue
        if subfields is None or not isinstance(value, Mapping):
            view[field] = value
        else:
            view[field] = {k: value[k] for k in subfields if k in value}
    return view


def is_relevant_change(kind: Kind, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether going from ``old`` to ``new`` changes anything policy-relevant (a DeepEqual of the views)."""
    return relevant_view(kind, old) != relevant_view(kind, new)
