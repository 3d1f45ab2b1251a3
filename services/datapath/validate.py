"""What a request to the datapath must satisfy: Kubernetes names and labels, addresses, namespaces.

Checked before anything is allocated, so a bad request costs nothing and fails with
INVALID_ARGUMENT naming the field (``services.common.validation`` has the Kubernetes
rules). Pure: whether an adopted namespace exists is the pod network's to say.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence

from services.common.errors import PalisadeError
from services.common.validation import (
    shown,
    validate_label_key,
    validate_label_value,
    validate_name,
    validate_namespace,
)
from services.datapath import netns
from services.datapath import types as dt
from services.datapath.endpoint import EndpointRef
from services.datapath.errors import InvalidRequest

#: A label's source (``k8s``, ``reserved``, ...).
_SOURCE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _checked(check: Callable[[str, str], object], value: str, field: str) -> None:
    try:
        check(value, field)
    except PalisadeError as exc:
        raise InvalidRequest(exc.message) from None


def validate_pod(namespace: str, pod: str, prefix: str = "") -> None:
    """A pod named as Kubernetes names it (namespace: DNS-1123 label; pod: DNS-1123 subdomain)."""
    _checked(validate_namespace, namespace, f"{prefix}namespace")
    _checked(validate_name, pod, f"{prefix}pod")


def validate_labels(labels: Sequence[dt.Label], field: str = "labels") -> None:
    for i, label in enumerate(labels):
        if label.source and not _SOURCE.fullmatch(label.source):
            raise InvalidRequest(
                f"{field}[{i}].source: {shown(label.source)} is not a label source such as k8s "
                "(lowercase letters, digits and '-', at most 63)"
            )
        _checked(validate_label_key, label.key, f"{field}[{i}].key")
        _checked(validate_label_value, label.value, f"{field}[{i}].value")


def validate_ref(ref: EndpointRef) -> None:
    if ref.namespace or ref.pod:
        validate_pod(ref.namespace, ref.pod)


def request_families(request: dt.EndpointRequest) -> tuple[tuple[int, str], ...]:
    """The families to allocate an address of (IPv4 only when none is given), each with the address asked for.

    An address in ``ips`` fixes its family's address; ``families``, when given too, must name the same ones.
    """
    asked: dict[int, str] = {}
    for i, text in enumerate(request.ips):
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            raise InvalidRequest(f"ips[{i}] {shown(text)} is invalid: not an IP address") from None
        if ip.is_unspecified or ip.is_multicast or ip.is_loopback:
            raise InvalidRequest(f"ips[{i}] {shown(text)} is invalid: cannot be a pod's address")
        if ip.version in asked:
            raise InvalidRequest(
                f"ips[{i}] {shown(text)} is invalid: a second IPv{ip.version} address after {asked[ip.version]}; "
                "give one per family"
            )
        asked[ip.version] = str(ip)
    if request.outside_pool and not asked:
        raise InvalidRequest("outside_pool: applies to the addresses of ips; give them or leave it unset")
    families = tuple(dict.fromkeys(request.families or tuple(asked) or (4,)))
    missing = [f"IPv{v}" for v in asked if v not in families]
    if missing:
        raise InvalidRequest(f"ips: an {', '.join(missing)} address is asked for but families does not include it")
    return tuple((family, asked.get(family, "")) for family in families)


def validate_request(request: dt.EndpointRequest) -> tuple[tuple[int, str], ...]:
    """Check a CreateEndpoint request; returns what :func:`request_families` returns."""
    validate_pod(request.namespace, request.pod)
    validate_labels(request.labels)
    if request.netns:
        try:
            netns.name_of(request.netns)
        except ValueError as exc:
            raise InvalidRequest(f"netns: {exc}") from None
    if request.container_id and not _CONTAINER_ID.fullmatch(request.container_id):
        raise InvalidRequest(
            f"container_id {shown(request.container_id)} is invalid: letters, digits, '_', '.' and '-' only "
            "(at most 256), as CNI requires"
        )
    for field in ("ifname", "adopt_host_ifname"):
        value = getattr(request, field)
        if (value and not _IFNAME.fullmatch(value)) or value in (".", ".."):
            raise InvalidRequest(
                f"{field} {shown(value)} is invalid: an interface name of 1-15 characters, no '/' or spaces"
            )
    if request.adopt_host_ifname and not (request.netns and request.ips):
        raise InvalidRequest("adopt_host_ifname: adopting another plugin's veth needs netns and the ips it configured")
    return request_families(request)


_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,255}")
_IFNAME = re.compile(r"[^/\s:]{1,15}")
