"""The field model of the three policy kinds: every field Kubernetes and Cilium accept, with its type.

Pure. One description of NetworkPolicy (``networking.k8s.io/v1``) and
Cilium(Clusterwide)NetworkPolicy (``cilium.io/v2``, after Cilium's ``pkg/policy/api``
types) serves two ends, so they cannot drift:

* :func:`check_document` walks a document before it is parsed: an unknown field at any
  depth, or a value of the wrong type or outside its enumeration, is a
  :class:`PolicyValidationError` naming the object, the field's path
  (``spec.ingress[0].fromEndpoint``) and, where one is close, the field probably meant.
  A typo is never dropped: dropping ``fromEndpoints`` would leave a rule open to every peer.
* :func:`openapi_schema` gives the structural OpenAPI v3 schema of the CRDs in
  ``deploy/kubernetes/crds`` (written by ``scripts/gen_crds.py``, compared by a test), so an
  API server under strict field validation rejects the same typos.

Fields that are valid but not enforced (L7 rules other than DNS, ``toGroups``, ...) are in the
model like the others: their typos are errors too; ``parse`` reports them as unsupported.
A few legacy spellings found in Cilium's own examples are accepted with a warning (see
``legacy`` on :class:`Node`).
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.policy.engine.identity import ENTITIES
from services.policy.engine.model import PolicyKind, PolicyValidationError

__all__ = [
    "ICMP4_TYPES",
    "ICMP6_TYPES",
    "Checked",
    "Node",
    "NodeType",
    "check_document",
    "document_model",
    "openapi_schema",
]


class NodeType(enum.StrEnum):
    OBJECT = "object"
    ARRAY = "array"
    STRING = "string"
    INTEGER = "integer"
    BOOLEAN = "boolean"
    INT_OR_STRING = "int-or-string"
    #: An object of string values under any keys (``matchLabels``).
    STRING_MAP = "string-map"
    #: Anything; kept as written and not checked here (``metadata``, ``status``).
    FREE = "free"


@dataclass(frozen=True, slots=True)
class Node:
    """One field's type. Objects list their fields; arrays their item type."""

    type: NodeType
    description: str = ""
    properties: Mapping[str, Node] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    #: Exactly one of these field groups must be present (a Cilium rule: endpoint or node selector).
    one_of_required: tuple[tuple[str, ...], ...] = ()
    #: Fields accepted for compatibility, each with the warning shown when present.
    legacy: Mapping[str, str] = field(default_factory=dict)
    items: Node | None = None
    enum: tuple[str, ...] = ()
    #: The engine also accepts the enumeration in any letter case, with a warning (Cilium does).
    enum_any_case: bool = False
    #: A regular expression string values must match (ICMP type names).
    pattern: str = ""
    minimum: int | None = None
    maximum: int | None = None
    #: A Kubernetes label selector (see the indentation slip in :func:`_check_object`).
    selector: bool = False


def _obj(
    description: str = "",
    /,
    *,
    required: tuple[str, ...] = (),
    one_of_required: tuple[tuple[str, ...], ...] = (),
    legacy: Mapping[str, str] | None = None,
    is_selector: bool = False,
    props: Mapping[str, Node] | None = None,
    **properties: Node,
) -> Node:
    """An object of the fields ``properties`` (``props`` for names that are Python keywords)."""
    return Node(
        NodeType.OBJECT,
        description,
        properties={**(props or {}), **properties},
        required=required,
        one_of_required=one_of_required,
        legacy=legacy or {},
        selector=is_selector,
    )


def _arr(item: Node, description: str = "") -> Node:
    return Node(NodeType.ARRAY, description, items=item)


def _str(description: str = "", *, enum: tuple[str, ...] = (), any_case: bool = False, pattern: str = "") -> Node:
    return Node(NodeType.STRING, description, enum=enum, enum_any_case=any_case, pattern=pattern)


def _int(description: str = "", *, minimum: int | None = None, maximum: int | None = None) -> Node:
    return Node(NodeType.INTEGER, description, minimum=minimum, maximum=maximum)


_BOOL = Node(NodeType.BOOLEAN)
_STRING = _str()
_STRINGS = _arr(_STRING)
_FREE = Node(NodeType.FREE)

# ICMP type names accepted by Cilium (pkg/policy/api/icmp.go), IPv4 and IPv6.
ICMP4_TYPES = {
    "EchoReply": 0,
    "DestinationUnreachable": 3,
    "Redirect": 5,
    "Echo": 8,
    "EchoRequest": 8,
    "RouterAdvertisement": 9,
    "RouterSelection": 10,
    "TimeExceeded": 11,
    "ParameterProblem": 12,
    "Timestamp": 13,
    "TimestampReply": 14,
    "Photuris": 40,
    "ExtendedEchoRequest": 42,
    "ExtendedEchoReply": 43,
}
ICMP6_TYPES = {
    "DestinationUnreachable": 1,
    "PacketTooBig": 2,
    "TimeExceeded": 3,
    "ParameterProblem": 4,
    "EchoRequest": 128,
    "EchoReply": 129,
    "MulticastListenerQuery": 130,
    "MulticastListenerReport": 131,
    "MulticastListenerDone": 132,
    "RouterSolicitation": 133,
    "RouterAdvertisement": 134,
    "NeighborSolicitation": 135,
    "NeighborAdvertisement": 136,
    "RedirectMessage": 137,
    "RouterRenumbering": 138,
    "ICMPNodeInformationQuery": 139,
    "ICMPNodeInformationResponse": 140,
    "InverseNeighborDiscoverySolicitation": 141,
    "InverseNeighborDiscoveryAdvertisement": 142,
    "HomeAgentAddressDiscoveryRequest": 144,
    "HomeAgentAddressDiscoveryReply": 145,
    "MobilePrefixSolicitation": 146,
    "MobilePrefixAdvertisement": 147,
    "DuplicateAddressRequestCodeSuffix": 157,
    "DuplicateAddressConfirmationCodeSuffix": 158,
    "ExtendedEchoRequest": 160,
    "ExtendedEchoReply": 161,
}

OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
KNP_PROTOCOLS = ("TCP", "UDP", "SCTP")
#: Cilium's L4 protocols that a ``toPorts`` port may name (ICMP goes in ``icmps``).
CILIUM_PROTOCOLS = ("TCP", "UDP", "SCTP", "ANY", "VRRP", "IGMP")


def _selector(description: str = "A label selector; keys may carry a source prefix such as k8s: or any:.") -> Node:
    return _obj(
        description,
        is_selector=True,
        matchLabels=Node(NodeType.STRING_MAP, "Labels the selected objects carry, key: value."),
        matchExpressions=_arr(
            _obj(
                required=("key", "operator"),
                key=_STRING,
                operator=_str(enum=OPERATORS, any_case=True),
                values=_STRINGS,
            )
        ),
    )


def _port_range(protocols: tuple[str, ...], port_doc: str) -> Node:
    return _obj(
        port=Node(NodeType.INT_OR_STRING, port_doc),
        endPort=_int("Last port of a range starting at port.", minimum=0, maximum=65535),
        protocol=_str(enum=protocols),
    )


# --- NetworkPolicy (networking.k8s.io/v1) ----------------------------------------------------

_KNP_SELECTOR = _selector("A Kubernetes label selector.")
_KNP_PEER = _obj(
    podSelector=_KNP_SELECTOR,
    namespaceSelector=_KNP_SELECTOR,
    ipBlock=_obj(required=("cidr",), cidr=_STRING, props={"except": _STRINGS}),
)
_KNP_PORT = _port_range(KNP_PROTOCOLS, "A port number or a named container port.")
_KNP_SPEC = _obj(
    podSelector=_KNP_SELECTOR,
    ingress=_arr(_obj(ports=_arr(_KNP_PORT), props={"from": _arr(_KNP_PEER)})),
    egress=_arr(_obj(to=_arr(_KNP_PEER), ports=_arr(_KNP_PORT))),
    policyTypes=_arr(_str(enum=("Ingress", "Egress"))),
)

# --- Cilium(Clusterwide)NetworkPolicy (cilium.io/v2) -----------------------------------------

_SELECTOR = _selector()
_SELECTORS = _arr(_SELECTOR)
_CIDR_RULE = _obj(
    "A CIDR with exceptions, or a CiliumCIDRGroup.",
    cidr=_STRING,
    cidrGroupRef=_STRING,
    cidrGroupSelector=_SELECTOR,
    props={"except": _STRINGS},
)
_ENTITY = _str(enum=tuple(ENTITIES))
_GROUPS = _obj(
    aws=_obj(
        labels=Node(NodeType.STRING_MAP),
        securityGroupsIds=_STRINGS,
        securityGroupsNames=_STRINGS,
        region=_STRING,
    )
)
_SECRET = _obj(required=("name",), name=_STRING, namespace=_STRING)
_TLS = _obj(secret=_SECRET, trustedCA=_STRING, certificate=_STRING, privateKey=_STRING)
_L7_RULES = _obj(
    "L7 rules: parsed, not enforced (the L3/L4 part is).",
    http=_arr(
        _obj(
            path=_STRING,
            method=_STRING,
            host=_STRING,
            headers=_STRINGS,
            headerMatches=_arr(
                _obj(
                    required=("name",),
                    mismatch=_str(enum=("LOG", "ADD", "DELETE", "REPLACE")),
                    name=_STRING,
                    secret=_SECRET,
                    value=_STRING,
                )
            ),
        )
    ),
    kafka=_arr(_obj(role=_STRING, apiKey=_STRING, apiVersion=_STRING, clientID=_STRING, topic=_STRING)),
    dns=_arr(_obj(matchName=_STRING, matchPattern=_STRING)),
    l7proto=_STRING,
    l7=_arr(Node(NodeType.STRING_MAP)),
)
_PORT = _port_range(CILIUM_PROTOCOLS, "A port number or a named port.")
_PORT_RULE = _obj(
    ports=_arr(_PORT),
    rules=_L7_RULES,
    serverNames=_STRINGS,
    terminatingTLS=_TLS,
    originatingTLS=_TLS,
    listener=_obj(
        required=("envoyConfig", "name"),
        envoyConfig=_obj(
            required=("kind", "name"),
            kind=_str(enum=("CiliumEnvoyConfig", "CiliumClusterwideEnvoyConfig")),
            name=_STRING,
        ),
        name=_STRING,
        priority=_int(minimum=1, maximum=100),
    ),
)
_PORT_DENY_RULE = _obj(ports=_arr(_PORT))
_ICMP_NAMES = sorted(set(ICMP4_TYPES) | set(ICMP6_TYPES))
_ICMPS = _arr(
    _obj(
        fields=_arr(
            _obj(
                required=("type",),
                family=_str(enum=("IPv4", "IPv6")),
                type=Node(
                    NodeType.INT_OR_STRING,
                    "An ICMP type number or name.",
                    pattern="^([0-9]+|" + "|".join(_ICMP_NAMES) + ")$",
                ),
            )
        )
    )
)
_AUTHENTICATION = _obj(required=("mode",), mode=_str(enum=("disabled", "required", "test-always-fail")))
_LEGACY_AUTH = _obj("Cilium 1.13's name of authentication.", type=_STRING)
_LEGACY_AUTH_NOTE = {"auth": "auth is the old name of authentication"}


def _ingress_common() -> dict[str, Node]:
    return {
        "fromEndpoints": _SELECTORS,
        "fromRequires": _SELECTORS,
        "fromCIDR": _STRINGS,
        "fromCIDRSet": _arr(_CIDR_RULE),
        "fromEntities": _arr(_ENTITY),
        "fromGroups": _arr(_GROUPS),
        "fromNodes": _SELECTORS,
    }


def _egress_common() -> dict[str, Node]:
    return {
        "toEndpoints": _SELECTORS,
        "toRequires": _SELECTORS,
        "toCIDR": _STRINGS,
        "toCIDRSet": _arr(_CIDR_RULE),
        "toEntities": _arr(_ENTITY),
        "toServices": _arr(
            _obj(
                k8sService=_obj(serviceName=_STRING, namespace=_STRING),
                k8sServiceSelector=_obj(required=("selector",), selector=_SELECTOR, namespace=_STRING),
            )
        ),
        "toGroups": _arr(_GROUPS),
        "toNodes": _SELECTORS,
    }


_RULE = _obj(
    one_of_required=(("endpointSelector",), ("nodeSelector",)),
    endpointSelector=_SELECTOR,
    nodeSelector=_SELECTOR,
    ingress=_arr(
        _obj(
            legacy=_LEGACY_AUTH_NOTE,
            toPorts=_arr(_PORT_RULE),
            icmps=_ICMPS,
            authentication=_AUTHENTICATION,
            auth=_LEGACY_AUTH,
            props=_ingress_common(),
        )
    ),
    ingressDeny=_arr(_obj(toPorts=_arr(_PORT_DENY_RULE), icmps=_ICMPS, props=_ingress_common())),
    egress=_arr(
        _obj(
            legacy=_LEGACY_AUTH_NOTE,
            toPorts=_arr(_PORT_RULE),
            toFQDNs=_arr(_obj(matchName=_STRING, matchPattern=_STRING)),
            icmps=_ICMPS,
            authentication=_AUTHENTICATION,
            auth=_LEGACY_AUTH,
            props=_egress_common(),
        )
    ),
    egressDeny=_arr(_obj(toPorts=_arr(_PORT_DENY_RULE), icmps=_ICMPS, props=_egress_common())),
    labels=_arr(_obj(required=("key",), key=_STRING, value=_STRING, source=_STRING)),
    enableDefaultDeny=_obj(ingress=_BOOL, egress=_BOOL),
    description=_STRING,
    log=_obj(value=_STRING),
)

_STATUS = Node(NodeType.FREE, "Written by the Cilium operator or agents, when they run.")
_APIVERSION_NOTE = {"apiversion": "apiversion: should be spelled apiVersion"}


def document_model(kind: PolicyKind) -> Node:
    """The model of a whole document of ``kind``."""
    top: dict[str, Node] = {
        "apiVersion": _STRING,
        "apiversion": _str("Legacy spelling of apiVersion."),
        "kind": _STRING,
        "metadata": _FREE,
        "status": _STATUS,
    }
    if kind is PolicyKind.NETWORK_POLICY:
        return _obj("A Kubernetes NetworkPolicy.", legacy=_APIVERSION_NOTE, spec=_KNP_SPEC, props=top)
    description = (
        "A cluster-wide Cilium network policy: L3/L4 rules for endpoints or nodes in any namespace."
        if kind is PolicyKind.CILIUM_CLUSTERWIDE_NETWORK_POLICY
        else "A namespaced Cilium network policy: L3/L4 rules for the endpoints it selects in its namespace."
    )
    return _obj(
        description,
        legacy={
            **_APIVERSION_NOTE,
            "description": "description: outside spec (an old form); it belongs in spec.description",
        },
        spec=_RULE,
        specs=_arr(_RULE),
        description=_str("Old place of spec.description."),
        props=top,
    )


# --- checking documents ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Checked:
    """A document that matches the model: its value (legacy forms normalized) and the warnings."""

    value: dict[str, Any]
    warnings: tuple[str, ...]


def check_document(doc: Mapping[str, Any], kind: PolicyKind, obj: str) -> Checked:
    """Check ``doc`` against the model of ``kind``; raises :class:`PolicyValidationError`."""
    warnings: list[str] = []
    value = _check(document_model(kind), doc, "", obj, warnings)
    assert isinstance(value, dict)
    return Checked(value, tuple(warnings))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _suggest(name: str, known: list[str]) -> str:
    lowered = {k.lower(): k for k in known}
    close = lowered.get(name.lower()) or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.6)), None)
    if close is None:
        found = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        close = lowered[found[0]] if found else None
    if close is not None:
        return f"; did you mean {close!r}?"
    return f"; the fields here are {', '.join(sorted(known))}"


def _check(node: Node, value: Any, path: str, obj: str, warnings: list[str]) -> Any:
    if value is None:
        return None  # an absent value, as the API server prunes it
    t = node.type
    if t is NodeType.FREE:
        return value
    if t is NodeType.OBJECT:
        if not isinstance(value, Mapping):
            raise PolicyValidationError(obj, path, f"must be an object, not {_type_name(value)}")
        return _check_object(node, value, path, obj, warnings)
    if t is NodeType.ARRAY:
        if not isinstance(value, list):
            raise PolicyValidationError(obj, path, f"must be a list, not {_type_name(value)}")
        assert node.items is not None
        return [_check(node.items, v, f"{path}[{i}]", obj, warnings) for i, v in enumerate(value)]
    if t is NodeType.STRING_MAP:
        if not isinstance(value, Mapping):
            raise PolicyValidationError(obj, path, f"must be an object of key: value, not {_type_name(value)}")
        for k, v in value.items():
            if v is not None and not isinstance(v, str):
                raise PolicyValidationError(
                    obj, _join(path, str(k)), f'must be a string, not {_type_name(v)} (quote it: {k}: "{v}")'
                )
        return dict(value)
    if t is NodeType.BOOLEAN:
        if not isinstance(value, bool):
            raise PolicyValidationError(obj, path, f"must be true or false, not {_type_name(value)}")
        return value
    if t is NodeType.INTEGER:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyValidationError(obj, path, f"must be an integer, not {_type_name(value)}")
        _check_range(node, value, path, obj)
        return value
    if t is NodeType.INT_OR_STRING:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise PolicyValidationError(obj, path, f"must be a number or a string, not {_type_name(value)}")
        return _check_string(node, value, path, obj, warnings) if isinstance(value, str) else value
    if not isinstance(value, str):
        raise PolicyValidationError(obj, path, f"must be a string, not {_type_name(value)}")
    return _check_string(node, value, path, obj, warnings)


def _check_range(node: Node, value: int, path: str, obj: str) -> None:
    if (node.minimum is not None and value < node.minimum) or (node.maximum is not None and value > node.maximum):
        raise PolicyValidationError(obj, path, f"{value} out of range {node.minimum}-{node.maximum}")


def _check_string(node: Node, value: str, path: str, obj: str, warnings: list[str]) -> str:
    if node.enum and value not in node.enum:
        same = [e for e in node.enum if e.lower() == value.lower()]
        if node.enum_any_case and same:
            warnings.append(f"{path}: {value!r} is spelled {same[0]!r} in Kubernetes (the API server refuses it)")
            return same[0]
        hint = f"did you mean {same[0]!r}? " if same else ""
        close = difflib.get_close_matches(value, node.enum, n=1, cutoff=0.6)
        if not same and close:
            hint = f"did you mean {close[0]!r}? "
        raise PolicyValidationError(obj, path, f"unknown value {value!r}; {hint}one of {', '.join(node.enum)}")
    if node.pattern and not re.fullmatch(node.pattern, value):
        raise PolicyValidationError(obj, path, f"unknown value {value!r}")
    return value


def _check_object(node: Node, value: Mapping[str, Any], path: str, obj: str, warnings: list[str]) -> dict[str, Any]:
    known = list(node.properties)
    unknown = [str(k) for k in value if k not in node.properties]
    out: dict[str, Any] = {}
    if unknown and node.selector and _indentation_slip(value, unknown, known):
        # ``matchLabels:`` followed by labels indented at its own level: YAML reads an empty
        # matchLabels and the labels as fields of the selector. Dropping them would select
        # every endpoint; they are what was meant, so they are taken as matchLabels.
        for k in unknown:
            warnings.append(
                f"{_join(path, k)}: not a selector field; taken as matchLabels.{k} because the matchLabels "
                "above it is empty (indent it under matchLabels)"
            )
        value = {
            "matchLabels": {k: str(value[k]) for k in unknown},
            **{k: v for k, v in value.items() if k in node.properties and k != "matchLabels"},
        }
        unknown = []
    if unknown:
        name = unknown[0]
        raise PolicyValidationError(obj, _join(path, name), "unknown field" + _suggest(name, known))
    for name, sub in value.items():
        out[str(name)] = _check(node.properties[name], sub, _join(path, str(name)), obj, warnings)
        if name in node.legacy and sub is not None:
            warnings.append(node.legacy[name])
    for name in node.required:
        if out.get(name) is None:
            raise PolicyValidationError(obj, _join(path, name), "required")
    return out


def _indentation_slip(value: Mapping[str, Any], unknown: list[str], known: list[str]) -> bool:
    return (
        "matchLabels" in value
        and value["matchLabels"] is None
        and all(isinstance(value[k], str) for k in unknown)
        and not any(difflib.get_close_matches(k, known, n=1, cutoff=0.6) for k in unknown)
    )


# --- OpenAPI v3 (CRD) schemas ----------------------------------------------------------------


def openapi_schema(kind: PolicyKind) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a CRD for ``kind`` (unknown fields: none kept)."""
    schema = _openapi(document_model(kind))
    props = schema["properties"]
    props["metadata"] = {"type": "object"}
    props["status"] = {
        "type": "object",
        "description": _STATUS.description,
        "x-kubernetes-preserve-unknown-fields": True,
    }
    return schema


def _openapi(node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if node.description:
        out["description"] = node.description
    t = node.type
    if t is NodeType.OBJECT:
        out["type"] = "object"
        if node.required:
            out["required"] = list(node.required)
        if node.one_of_required:
            out["oneOf"] = [{"required": list(group)} for group in node.one_of_required]
        out["properties"] = {name: _openapi(sub) for name, sub in node.properties.items()}
    elif t is NodeType.ARRAY:
        assert node.items is not None
        out["type"] = "array"
        out["items"] = _openapi(node.items)
    elif t is NodeType.STRING_MAP:
        out["type"] = "object"
        out["additionalProperties"] = {"type": "string"}
    elif t is NodeType.FREE:
        out["type"] = "object"
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif t is NodeType.INT_OR_STRING:
        out["x-kubernetes-int-or-string"] = True
    else:
        out["type"] = t.value
    if node.enum:
        out["enum"] = list(node.enum)
    if node.pattern:
        out["pattern"] = node.pattern
    if node.minimum is not None:
        out["minimum"] = node.minimum
    if node.maximum is not None:
        out["maximum"] = node.maximum
    return out
