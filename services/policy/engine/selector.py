"""Selectors: which identities a rule's subject or peers are.

Two kinds, both hashable so the selector cache can intern them:

* :class:`EndpointSelector` — Kubernetes label selector semantics over identity
  labels, source-aware like Cilium: a key may carry a source prefix (``k8s:app``,
  ``reserved:host``); a key without one (or ``any:``) matches any source.
* :class:`CIDRSelector` — selects by address. It matches CIDR identities whose
  prefix lies inside the CIDR and not inside an ``except`` (the ipcache does
  longest-prefix matching, so excepted prefixes carry their own identities),
  the world identity when the CIDR is ``/0``, and — as Kubernetes specifies for
  ``ipBlock`` — identities with endpoint IPs when *all* their known IPs of the
  CIDR's address family lie inside the CIDR and outside every except (at least
  one such IP needed). An identity with IPs partly outside is not selected:
  the conservative choice, since entries are keyed by identity, not address.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.labels import (
    LABEL_NAMESPACE_LABELS_PREFIX,
    LABEL_POD_NAMESPACE,
    LabelSet,
    LabelSource,
)
from services.policy.engine.model import IPAddress, IPNetwork, PolicyValidationError


class IdentityView(Protocol):
    """What a selector needs to know about an identity."""

    @property
    def labels(self) -> LabelSet: ...

    @property
    def prefixes(self) -> tuple[IPNetwork, ...]: ...

    @property
    def ips(self) -> frozenset[IPAddress]: ...


class Operator(enum.StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


@dataclass(frozen=True, slots=True, order=True)
class Requirement:
    """One label requirement; ``source`` is ``any`` unless the key had a prefix."""

    source: str
    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def matches(self, labels: LabelSet) -> bool:
        found = labels.lookup(self.source, self.key)
        if self.operator is Operator.IN:
            return any(label.value in self.values for label in found)
        if self.operator is Operator.NOT_IN:
            return not any(label.value in self.values for label in found)
        if self.operator is Operator.EXISTS:
            return bool(found)
        return not found

    def __str__(self) -> str:
        key = f"{self.source}:{self.key}"
        if self.operator is Operator.IN and len(self.values) == 1:
            return f"{key}={self.values[0]}"
        if self.operator in (Operator.EXISTS, Operator.DOES_NOT_EXIST):
            return f"{key} {self.operator.value}"
        return f"{key} {self.operator.value} ({','.join(self.values)})"


def split_key(key: str, *, default_source: str = LabelSource.ANY) -> tuple[str, str]:
    """``k8s:app`` -> (k8s, app); ``app`` -> (default_source, app)."""
    source, sep, rest = key.partition(":")
    if sep and source and rest:
        return source, rest
    return str(default_source), key


@dataclass(frozen=True, slots=True)
class EndpointSelector:
    """A conjunction of label requirements; no requirement selects everything."""

    requirements: tuple[Requirement, ...] = ()
    # Selectors key the selector cache and the engine's indexes: hash once.
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        requirements = tuple(sorted(set(self.requirements)))
        object.__setattr__(self, "requirements", requirements)
        object.__setattr__(self, "_hash", hash(requirements))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (EndpointSelector, (self.requirements,))  # the hash is per process: recompute it

    def matches(self, identity: IdentityView) -> bool:
        labels = identity.labels
        return all(r.matches(labels) for r in self.requirements)

    def matches_labels(self, labels: LabelSet) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    @property
    def is_wildcard(self) -> bool:
        return not self.requirements

    def has_key(self, key: str, *, sources: Sequence[str] = ("k8s", "any")) -> bool:
        return any(r.key == key and r.source in sources for r in self.requirements)

    def has_key_prefix(self, prefix: str, *, sources: Sequence[str] = ("k8s", "any")) -> bool:
        return any(r.key.startswith(prefix) and r.source in sources for r in self.requirements)

    def has_source(self, source: str) -> bool:
        return any(r.source == source for r in self.requirements)

    def with_requirements(self, *extra: Requirement) -> EndpointSelector:
        return EndpointSelector(self.requirements + extra)

    def anchors(self) -> list[tuple[str, tuple[str, ...]]]:
        """(key, values) of ``In`` requirements, usable to narrow candidates by index."""
        return [(r.key, r.values) for r in self.requirements if r.operator is Operator.IN]

    def __str__(self) -> str:
        return "{" + ", ".join(str(r) for r in self.requirements) + "}"


@dataclass(frozen=True, slots=True)
class CIDRSelector:
    """Selects by address: see the module docstring for the exact rule."""

    cidr: IPNetwork
    excepts: tuple[IPNetwork, ...] = ()
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.cidr, self.excepts)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (CIDRSelector, (self.cidr, self.excepts))

    def _prefix_inside(self, prefix: IPNetwork) -> bool:
        if prefix.version != self.cidr.version or not _subnet_of(prefix, self.cidr):
            return False
        return not any(_subnet_of(prefix, e) for e in self.excepts)

    def _ip_inside(self, ip: IPAddress) -> bool:
        return ip in self.cidr and not any(ip in e for e in self.excepts)

    def matches(self, identity: IdentityView) -> bool:
        if identity.prefixes:
            return any(self._prefix_inside(p) for p in identity.prefixes)
        same_family = [ip for ip in identity.ips if ip.version == self.cidr.version]
        return bool(same_family) and all(self._ip_inside(ip) for ip in same_family)

    def __str__(self) -> str:
        if self.excepts:
            return f"cidr {self.cidr} except {','.join(map(str, self.excepts))}"
        return f"cidr {self.cidr}"


Selector = EndpointSelector | CIDRSelector


def cidr_identity_prefixes(selectors: Iterable[Selector]) -> frozenset[str]:
    """The prefixes that need a CIDR identity (and an ipcache entry) for these selectors to select by
    address: each CIDR and each except, as canonical text; world prefixes (``/0``) excepted, which
    select the ``world`` identity already. Pure."""
    out: set[str] = set()
    for sel in selectors:
        if isinstance(sel, CIDRSelector):
            out.update(str(p) for p in (sel.cidr, *sel.excepts) if p.prefixlen > 0)
    return frozenset(out)


def _subnet_of(a: IPNetwork, b: IPNetwork) -> bool:
    return a.version == b.version and a.subnet_of(b)  # type: ignore[arg-type]


def namespace_requirement(namespace: str) -> Requirement:
    return Requirement(LabelSource.K8S, LABEL_POD_NAMESPACE, Operator.IN, (namespace,))


def namespace_exists_requirement() -> Requirement:
    return Requirement(LabelSource.K8S, LABEL_POD_NAMESPACE, Operator.EXISTS)


def parse_label_selector(
    data: Any,
    *,
    obj: str,
    path: str,
    default_source: str = LabelSource.ANY,
    key_prefix: str = "",
) -> EndpointSelector:
    """Parse a Kubernetes ``LabelSelector`` dict.

    ``key_prefix`` is prepended to every key (used to turn a namespaceSelector
    into ``io.cilium.k8s.namespace.labels.*`` requirements). Operators are
    matched case-insensitively, as Cilium accepts ``in``.
    """
    if data is None:
        return EndpointSelector()
    if not isinstance(data, Mapping):
        raise PolicyValidationError(obj, path, "label selector must be an object")
    reqs: list[Requirement] = []
    match_labels = data.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise PolicyValidationError(obj, f"{path}.matchLabels", "must be an object")
    for key, value in match_labels.items():
        source, k = split_key(str(key), default_source=default_source)
        if not k:
            raise PolicyValidationError(obj, f"{path}.matchLabels", f"empty key {key!r}")
        val = "" if value is None else str(value)
        reqs.append(Requirement(source, key_prefix + k, Operator.IN, (val,)))
    exprs = data.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise PolicyValidationError(obj, f"{path}.matchExpressions", "must be a list")
    for i, expr in enumerate(exprs):
        epath = f"{path}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping) or "key" not in expr:
            raise PolicyValidationError(obj, epath, "needs a key and an operator")
        source, k = split_key(str(expr["key"]), default_source=default_source)
        op_text = str(expr.get("operator", ""))
        op = next((o for o in Operator if o.value.lower() == op_text.lower()), None)
        if op is None:
            raise PolicyValidationError(obj, f"{epath}.operator", f"unknown operator {op_text!r}")
        values = tuple(sorted(str(v) for v in (expr.get("values") or [])))
        if op in (Operator.IN, Operator.NOT_IN) and not values:
            raise PolicyValidationError(obj, f"{epath}.values", f"{op.value} needs values")
        if op in (Operator.EXISTS, Operator.DOES_NOT_EXIST) and values:
            raise PolicyValidationError(obj, f"{epath}.values", f"{op.value} must not have values")
        reqs.append(Requirement(source, key_prefix + k, op, values))
    return EndpointSelector(tuple(reqs))


def namespace_selector(data: Any, *, obj: str, path: str) -> EndpointSelector:
    """A namespaceSelector as requirements on the pods' namespace-labels labels.

    Always requires a pod namespace label, so ``{}`` means every pod of the
    cluster but no reserved or CIDR identity.
    """
    sel = parse_label_selector(
        data,
        obj=obj,
        path=path,
        default_source=LabelSource.K8S,
        key_prefix=LABEL_NAMESPACE_LABELS_PREFIX,
    )
    return sel.with_requirements(namespace_exists_requirement())


def parse_cidr(text: Any, *, obj: str, path: str) -> IPNetwork:
    """A CIDR (or a bare address, taken as a host prefix), host bits tolerated."""
    try:
        return ipaddress.ip_network(str(text).strip(), strict=False)
    except ValueError:
        raise PolicyValidationError(obj, path, f"invalid CIDR {text!r}") from None
