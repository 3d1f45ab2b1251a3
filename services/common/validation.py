"""Kubernetes' rules for names, labels and CIDRs, checked at every API edge. Pure.

The rules are Kubernetes' own (``k8s.io/apimachinery/pkg/util/validation``): a
namespace is a DNS-1123 label, an object name (a pod) a DNS-1123 subdomain, a label
key a qualified name with an optional DNS-1123 subdomain prefix, a label value at
most 63 characters of ``[A-Za-z0-9._-]`` starting and ending with an alphanumeric.
Lengths are checked before patterns, so a megabyte of input fails at once. Each
validator raises :class:`PalisadeError` with ``INVALID_ARGUMENT`` and a message that
names the field, shows the value (clipped) and says what is allowed.
"""

from __future__ import annotations

import ipaddress
import re

from services.common.errors import Code, PalisadeError

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")

#: How much of a bad value a message shows.
SHOWN = 64


def shown(value: str) -> str:
    """``value`` quoted for a message, cut to :data:`SHOWN` characters."""
    if len(value) <= SHOWN:
        return repr(value)
    return f"{value[:SHOWN]!r}… ({len(value)} characters)"


def _invalid(field: str, message: str) -> PalisadeError:
    return PalisadeError(f"{field}: {message}", Code.INVALID_ARGUMENT)


def validate_namespace(value: str, field: str = "namespace") -> None:
    """A namespace name: a DNS-1123 label."""
    _dns1123_label(value, field, "a namespace")


def validate_name(value: str, field: str = "name") -> None:
    """An object name such as a pod's: a DNS-1123 subdomain."""
    if not value:
        raise _invalid(field, "is empty; give the object's name")
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        raise _invalid(field, f"{shown(value)} is longer than {DNS1123_SUBDOMAIN_MAX} characters")
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        raise _invalid(
            field,
            f"{shown(value)} is not a valid name: use lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit (a DNS-1123 subdomain)",
        )


def validate_label_key(value: str, field: str = "label key") -> None:
    """A label key: ``[prefix/]name``, the prefix a DNS-1123 subdomain, the name a qualified name."""
    if not value:
        raise _invalid(field, "is empty; labels are key=value")
    if len(value) > DNS1123_SUBDOMAIN_MAX + 1 + QUALIFIED_NAME_MAX:
        raise _invalid(field, f"{shown(value)} is too long for a label key")
    prefix, slash, name = value.rpartition("/")
    bad_prefix = not prefix or len(prefix) > DNS1123_SUBDOMAIN_MAX or not _DNS1123_SUBDOMAIN.fullmatch(prefix)
    if slash and bad_prefix:
        raise _invalid(
            field,
            f"{shown(value)} has a bad prefix: it must be a DNS-1123 subdomain "
            "(lowercase letters, digits, '-' and '.') of at most 253 characters, like example.com/",
        )
    if not name or len(name) > QUALIFIED_NAME_MAX or not _QUALIFIED_NAME.fullmatch(name):
        raise _invalid(
            field,
            f"{shown(value)} is not a valid label key: the name part must be at most {QUALIFIED_NAME_MAX} "
            "characters of letters, digits, '-', '_' and '.', starting and ending with a letter or digit",
        )


def validate_label_value(value: str, field: str = "label value") -> None:
    """A label value: empty, or at most 63 characters of ``[A-Za-z0-9._-]`` with alphanumeric ends."""
    if not value:
        return
    if len(value) > LABEL_VALUE_MAX or not _QUALIFIED_NAME.fullmatch(value):
        raise _invalid(
            field,
            f"{shown(value)} is not a valid label value: at most {LABEL_VALUE_MAX} characters of letters, "
            "digits, '-', '_' and '.', starting and ending with a letter or digit",
        )


def validate_cidr(value: str, field: str = "cidr") -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR with its mask (``10.0.0.0/8``, ``2001:db8::/64``); host bits may be set, as Kubernetes allows."""
    if "/" not in value:
        raise _invalid(field, f"{shown(value)} has no mask; write a CIDR such as 10.0.0.0/8 or 10.0.0.5/32")
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError as exc:
        raise _invalid(field, f"{shown(value)} is not a CIDR ({exc}); write one such as 10.0.0.0/8") from None


def _dns1123_label(value: str, field: str, what: str) -> None:
    if not value:
        raise _invalid(field, f"is empty; give {what}")
    if len(value) > DNS1123_LABEL_MAX:
        raise _invalid(field, f"{shown(value)} is longer than {DNS1123_LABEL_MAX} characters")
    if not _DNS1123_LABEL.fullmatch(value):
        raise _invalid(
            field,
            f"{shown(value)} is not a valid {what.removeprefix('a ')} name: use lowercase letters, digits "
            "and '-', starting and ending with a letter or digit (a DNS-1123 label)",
        )
