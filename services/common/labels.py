"""Pure label model shared by every service.

An identity is a set of labels. Labels carry a *source* (``k8s``, ``reserved``,
``cidr``...) so that a Kubernetes pod label ``app=x`` never collides with a
reserved label of the same key. The textual form is Cilium's
``source:key=value``; this module parses and formats it, filters out labels
that would explode the identity space (``pod-template-hash``...), and computes
the identity labels of a pod or of a CIDR prefix.

Nothing here does I/O; everything is deterministic and hashable so that
identities can be keyed by their label set.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

__all__ = [
    "CIDR_HOLDER_NODE",
    "CLUSTER_NAME_DEFAULT",
    "LABEL_NAMESPACE_LABELS_PREFIX",
    "LABEL_NAMESPACE_NAME",
    "LABEL_POD_NAMESPACE",
    "LABEL_POLICY_CLUSTER",
    "LABEL_SERVICE_ACCOUNT",
    "Label",
    "LabelSet",
    "LabelSource",
    "ReservedIdentity",
    "cidr_identity_labels",
    "cidr_label",
    "cidr_owner",
    "filter_identity_labels",
    "is_identity_label",
    "labels_from_wire",
    "parse_label",
    "pod_identity_labels",
    "reserved_labels",
]


class LabelSource(enum.StrEnum):
    """Where a label comes from. ``any`` only appears in selectors."""

    K8S = "k8s"
    RESERVED = "reserved"
    CIDR = "cidr"
    UNSPEC = "unspec"
    ANY = "any"
    CONTAINER = "container"
    NODE = "node"
    FQDN = "fqdn"
    CILIUM_GENERATED = "cilium-generated"


LABEL_POD_NAMESPACE = "io.kubernetes.pod.namespace"
LABEL_NAMESPACE_LABELS_PREFIX = "io.cilium.k8s.namespace.labels."
LABEL_SERVICE_ACCOUNT = "io.cilium.k8s.policy.serviceaccount"
LABEL_POLICY_CLUSTER = "io.cilium.k8s.policy.cluster"
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
CLUSTER_NAME_DEFAULT = "default"


class ReservedIdentity(enum.IntEnum):
    """Reserved numeric identities, numbered exactly as Cilium numbers them."""

    UNKNOWN = 0
    HOST = 1
    WORLD = 2
    UNMANAGED = 3
    HEALTH = 4
    INIT = 5
    REMOTE_NODE = 6
    KUBE_APISERVER = 7
    INGRESS = 8
    WORLD_IPV4 = 9
    WORLD_IPV6 = 10

    @property
    def label_key(self) -> str:
        """The key of the ``reserved:`` label carried by this identity."""
        return self.name.lower().replace("_", "-")


#: The reserved identities a cluster uses (Cilium's 1-7); ingress and the split
#: world-ipv4/ipv6 identities are not used in single-world mode.
CLUSTER_RESERVED_IDENTITIES = (
    ReservedIdentity.HOST,
    ReservedIdentity.WORLD,
    ReservedIdentity.UNMANAGED,
    ReservedIdentity.HEALTH,
    ReservedIdentity.INIT,
    ReservedIdentity.REMOTE_NODE,
    ReservedIdentity.KUBE_APISERVER,
)


@dataclass(frozen=True, slots=True, order=True)
class Label:
    """One label. Ordering is (source, key, value) so label sets sort stably."""

    source: str
    key: str
    value: str = ""

    def __str__(self) -> str:
        if self.value == "":
            return f"{self.source}:{self.key}"
        return f"{self.source}:{self.key}={self.value}"

    def matches_key(self, source: str, key: str) -> bool:
        """Whether this label answers a selector key; ``any`` matches every source."""
        return self.key == key and (source == LabelSource.ANY or source == self.source)


def parse_label(text: str, *, default_source: str = LabelSource.UNSPEC) -> Label:
    """Parse ``source:key=value`` (source and value optional).

    Like Cilium, a leading ``$`` means the reserved source (``$host``), and a
    missing source gives ``default_source``. The source is the text before the
    first ``:`` only if that ``:`` comes before any ``=``, so ``a=b:c`` is key
    ``a`` with value ``b:c``.
    """
    if text.startswith("$"):
        source, rest = LabelSource.RESERVED.value, text[1:]
    else:
        colon = text.find(":")
        equals = text.find("=")
        if colon > 0 and (equals < 0 or colon < equals):
            source, rest = text[:colon], text[colon + 1 :]
        else:
            source, rest = str(default_source), text
    key, _, value = rest.partition("=")
    if not key:
        raise ValueError(f"invalid label {text!r}: empty key")
    return Label(source, key, value)


@dataclass(frozen=True)
class LabelSet:
    """An immutable, sorted, duplicate-free set of labels (one value per source+key).

    Hashable and comparable, so it can key identity allocations. ``str()`` is
    the canonical form: labels sorted, joined by ``;``.
    """

    labels: tuple[Label, ...] = ()

    def __post_init__(self) -> None:
        unique: dict[tuple[str, str], Label] = {}
        for label in self.labels:
            unique[(label.source, label.key)] = label
        object.__setattr__(self, "labels", tuple(sorted(unique.values())))

    @classmethod
    def of(cls, labels: Iterable[Label | str]) -> LabelSet:
        """Build from labels or their ``source:key=value`` strings."""
        return cls(tuple(parse_label(x) if isinstance(x, str) else x for x in labels))

    @classmethod
    def parse(cls, text: str) -> LabelSet:
        """Inverse of ``str()``: ``;``-separated labels (empty string = empty set)."""
        return cls.of(part for part in text.split(";") if part)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str], *, source: str) -> LabelSet:
        """Labels from a plain ``key: value`` mapping, all with one source."""
        return cls(tuple(Label(source, str(k), str(v)) for k, v in mapping.items()))

    def __str__(self) -> str:
        return ";".join(str(label) for label in self.labels)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(self.labels)

    def __iter__(self) -> Iterator[Label]:
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __contains__(self, item: object) -> bool:
        return item in self._as_set

    @cached_property
    def _as_set(self) -> frozenset[Label]:
        return frozenset(self.labels)

    @cached_property
    def by_key(self) -> Mapping[str, tuple[Label, ...]]:
        """Labels grouped by key (across sources), for selector matching."""
        out: dict[str, list[Label]] = {}
        for label in self.labels:
            out.setdefault(label.key, []).append(label)
        return {k: tuple(v) for k, v in out.items()}

    def lookup(self, source: str, key: str) -> tuple[Label, ...]:
        """Labels with this key, from this source (``any`` = all sources)."""
        found = self.by_key.get(key, ())
        if source == LabelSource.ANY:
            return found
        return tuple(label for label in found if label.source == source)

    def has_source(self, source: str) -> bool:
        return any(label.source == source for label in self.labels)

    def union(self, other: Iterable[Label]) -> LabelSet:
        return LabelSet(self.labels + tuple(other))

    def to_strings(self) -> list[str]:
        return [str(label) for label in self.labels]


class WireLabel(Protocol):
    """A label as the wire carries it (``palisade.v1.Label``), without importing the generated code."""

    @property
    def source(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def value(self) -> str: ...


def labels_from_wire(labels: Iterable[WireLabel]) -> LabelSet:
    """Labels received from another service. A label sent without a source is ``unspec``, as
    :func:`parse_label` makes a label written without one: the source is never left empty."""
    return LabelSet(tuple(Label(x.source or LabelSource.UNSPEC, x.key, x.value) for x in labels))


# --- identity-relevant label filter -------------------------------------------------

_INCLUDE = (
    re.compile(re.escape(LABEL_POD_NAMESPACE)),
    re.compile(re.escape(LABEL_NAMESPACE_LABELS_PREFIX.rstrip("."))),
    re.compile(re.escape("app.kubernetes.io")),
    re.compile(re.escape(LABEL_POLICY_CLUSTER)),
)
_IGNORE = tuple(
    re.compile(p)
    for p in (
        r"io\.kubernetes",
        r"kubernetes\.io",
        re.escape("statefulset.kubernetes.io/pod-name"),
        re.escape("apps.kubernetes.io/pod-index"),
        re.escape("batch.kubernetes.io/job-completion-index"),
        re.escape("batch.kubernetes.io/job-name"),
        re.escape("batch.kubernetes.io/controller-uid"),
        r".*beta\.kubernetes\.io",
        r"k8s\.io",
        r"pod-template-generation",
        r"pod-template-hash",
        r"controller-revision-hash",
        r"controller-uid",
        r"job-name",
        r"annotation.*",
        r"etcd_node",
    )
)


def _match_len(pattern: re.Pattern[str], key: str) -> int:
    m = pattern.match(key)
    return m.end() if m else -1


def is_identity_label(label: Label) -> bool:
    """Cilium's default label filter.

    Reserved labels are always kept. Otherwise a label is dropped when an
    ignore prefix matches its key, unless an include prefix matches a longer
    part of it (so ``io.kubernetes.pod.namespace`` survives ``!io.kubernetes``).
    """
    if label.source == LabelSource.RESERVED:
        return True
    included = max((_match_len(p, label.key) for p in _INCLUDE), default=-1)
    ignored = min((n for n in (_match_len(p, label.key) for p in _IGNORE) if n >= 0), default=-1)
    if ignored < 0:
        return True
    return included > ignored


def filter_identity_labels(labels: Iterable[Label]) -> LabelSet:
    """Keep only identity-relevant labels (see :func:`is_identity_label`)."""
    return LabelSet(tuple(label for label in labels if is_identity_label(label)))


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata") or {}
    return meta if isinstance(meta, Mapping) else {}


def pod_identity_labels(
    pod: Mapping[str, Any],
    namespace: Mapping[str, Any] | None,
    *,
    cluster: str = CLUSTER_NAME_DEFAULT,
) -> LabelSet:
    """Identity labels of a pod, given its Pod and Namespace objects as dicts.

    Pod labels get the ``k8s`` source; the namespace name, the namespace's
    labels (``io.cilium.k8s.namespace.labels.<key>``), the service account
    (default ``default``) and the cluster name are added as Cilium does. The
    API server puts ``kubernetes.io/metadata.name=<ns>`` on every namespace, so
    it is added even when the given Namespace object lacks it.
    """
    meta = _metadata(pod)
    ns_name = str(meta.get("namespace") or "default")
    out: list[Label] = [Label(LabelSource.K8S, str(k), str(v)) for k, v in (meta.get("labels") or {}).items()]
    out.append(Label(LabelSource.K8S, LABEL_POD_NAMESPACE, ns_name))
    ns_labels: dict[str, str] = {LABEL_NAMESPACE_NAME: ns_name}
    if namespace is not None:
        ns_labels.update({str(k): str(v) for k, v in (_metadata(namespace).get("labels") or {}).items()})
    out.extend(Label(LabelSource.K8S, LABEL_NAMESPACE_LABELS_PREFIX + k, v) for k, v in ns_labels.items())
    spec = pod.get("spec") or {}
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    out.append(Label(LabelSource.K8S, LABEL_SERVICE_ACCOUNT, str(sa)))
    out.append(Label(LabelSource.K8S, LABEL_POLICY_CLUSTER, cluster))
    return filter_identity_labels(out)


def cidr_label(prefix: ipaddress.IPv4Network | ipaddress.IPv6Network | str) -> Label:
    """The ``cidr:`` label of a prefix. IPv6 ``:`` become ``-`` as in Cilium."""
    net = ipaddress.ip_network(prefix, strict=False)
    text = str(net)
    if net.version == 6:
        text = text.replace(":", "-")
    return Label(LabelSource.CIDR, text)


def cidr_identity_labels(prefix: ipaddress.IPv4Network | ipaddress.IPv6Network | str) -> LabelSet:
    """Labels of the identity of a CIDR prefix: ``cidr:<prefix>`` and ``reserved:world``.

    Like current Cilium, only the prefix itself is a label; CIDR selectors
    select such identities by prefix containment rather than by label.
    """
    return LabelSet((cidr_label(prefix), Label(LabelSource.RESERVED, "world")))


#: The holder (ipam's pseudo-node) under which the policy service keeps a reference on the CIDR
#: identity of every prefix accepted policies name; ipam keeps this node's lease alive itself.
CIDR_HOLDER_NODE = "palisade-policy-cidrs"


def cidr_owner(prefix: ipaddress.IPv4Network | ipaddress.IPv6Network | str) -> str:
    """The owner of the policy service's reference on a prefix's CIDR identity: ``cidr/<prefix>``."""
    return f"cidr/{ipaddress.ip_network(prefix, strict=False)}"


def reserved_labels(identity: ReservedIdentity) -> LabelSet:
    """The label set of a reserved identity (``reserved:host``...)."""
    return LabelSet((Label(LabelSource.RESERVED, identity.label_key),))
