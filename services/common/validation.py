"""Names, namespaces, labels and CIDRs checked as Kubernetes checks them. Pure.

Every API edge validates what it is given with these before using it, so that a
name Kubernetes would refuse (a 100,000-character name, ``../../etc``, ``a.*.>``,
``Shop_NS!``, a label key with a space, a newline or a NUL) is answered with
INVALID_ARGUMENT naming the field, never stored, published or echoed in full.

The rules are Kubernetes' own (``k8s.io/apimachinery/pkg/util/validation``):
namespaces are DNS-1123 labels, object names DNS-1123 subdomains, label keys
qualified names with an optional DNS-1123 subdomain prefix, label values at most
63 characters of ``[A-Za-z0-9._-]`` starting and ending alphanumeric.
"""

from __future__ import annotations

import ipaddress
import re

from services.common.errors import Code, PalisadeError, clip

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def shown(value: str) -> str:
    """The value as it can be shown in a message: quoted, escaped, cut."""
    return clip(repr(value), 120)


def _invalid(field: str, value: str, rule: str) -> PalisadeError:
    return PalisadeError(f"{field} {shown(value)} is invalid: {rule}", Code.INVALID_ARGUMENT)


def _valid(value: str, field: str, problem: str | None) -> str:
    """``value`` when ``problem`` (what a rule found wrong with it) is None; else PalisadeError naming both."""
    if problem is not None:
        raise _invalid(field, value, problem)
    return value


def dns1123_label_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    if len(value) > DNS1123_LABEL_MAX:
        return f"must be at most {DNS1123_LABEL_MAX} characters (it has {len(value)})"
    if not _DNS1123_LABEL.fullmatch(value):
        return "must consist of lower case letters, digits and '-', and start and end with a letter or digit"
    return None


def dns1123_subdomain_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        return f"must be at most {DNS1123_SUBDOMAIN_MAX} characters (it has {len(value)})"
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        return (
            "must consist of lower case letters, digits, '-' and '.', and start and end with a letter or digit "
            "(a DNS-1123 subdomain)"
        )
    return None


def label_key_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    prefix, slash, name = value.rpartition("/")
    if slash:
        if not prefix:
            return "has an empty prefix before '/'"
        problem = dns1123_subdomain_problem(prefix)
        if problem is not None:
            return f"prefix {shown(prefix)} {problem}"
    if not name:
        return "has an empty name"
    if len(name) > QUALIFIED_NAME_MAX:
        return f"name part must be at most {QUALIFIED_NAME_MAX} characters (it has {len(name)})"
    if not _QUALIFIED_NAME.fullmatch(name):
        return (
            "must be a qualified name: letters, digits, '-', '_' and '.', starting and ending with a letter or "
            "digit, with an optional DNS subdomain prefix and '/' (e.g. 'app' or 'example.com/tier')"
        )
    return None


def label_value_problem(value: str) -> str | None:
    if len(value) > LABEL_VALUE_MAX:
        return f"must be at most {LABEL_VALUE_MAX} characters (it has {len(value)})"
    if value and not _QUALIFIED_NAME.fullmatch(value):
        return "must be empty or letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
    return None


def cidr_problem(value: str) -> str | None:
    if "/" not in value:
        return "must be an address with a prefix length, e.g. 10.0.0.0/24 or fd00::/64"
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError as exc:
        return f"is not a CIDR ({exc})"
    return None


def validate_namespace(value: str, field: str) -> str:
    """``value`` if it is a valid namespace (a DNS-1123 label); else PalisadeError(INVALID_ARGUMENT)."""
    return _valid(value, field, dns1123_label_problem(value))


def validate_name(value: str, field: str) -> str:
    """``value`` if it is a valid object name (a DNS-1123 subdomain); else PalisadeError(INVALID_ARGUMENT)."""
    return _valid(value, field, dns1123_subdomain_problem(value))


def validate_label_key(value: str, field: str) -> str:
    """``value`` if it is a valid label key (a qualified name); else PalisadeError(INVALID_ARGUMENT)."""
    return _valid(value, field, label_key_problem(value))


def validate_label_value(value: str, field: str) -> str:
    """``value`` if it is a valid label value; else PalisadeError(INVALID_ARGUMENT)."""
    return _valid(value, field, label_value_problem(value))


def validate_cidr(value: str, field: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """The network ``value`` names (a prefix length is required); else PalisadeError(INVALID_ARGUMENT)."""
    return ipaddress.ip_network(_valid(value, field, cidr_problem(value)), strict=False)


#: Cilium's key prefix for a namespace's labels carried by its pods' identities.
NAMESPACE_LABELS_PREFIX = "io.cilium.k8s.namespace.labels."


def validate_identity_label(source: str, key: str, value: str, field: str) -> None:
    """One label of an identity (``source:key=value``): CIDR labels name a prefix, others are Kubernetes labels.

    A namespace label lifted onto a pod (``io.cilium.k8s.namespace.labels.<key>``) is checked
    as the namespace's own key.
    """
    if len(source) > QUALIFIED_NAME_MAX or (source and not _QUALIFIED_NAME.fullmatch(source)):
        raise _invalid(f"{field}.source", source, "must be a label source such as k8s, reserved or cidr")
    if source == "cidr":
        # IPv6 prefixes carry '-' for ':' in labels, as in Cilium.
        validate_cidr(key if "." in key else key.replace("-", ":"), f"{field}.key")
    else:
        validate_label_key(key.removeprefix(NAMESPACE_LABELS_PREFIX) or key, f"{field}.key")
    validate_label_value(value, f"{field}.value")
