"""CiliumNetworkPolicy / CiliumClusterwideNetworkPolicy L3/L4 semantics on the x/y/z model."""

# Policy documents are inline YAML; long lines keep each one readable.
# ruff: noqa: E501

from __future__ import annotations

from collections.abc import Callable

PROBES = ["80/TCP", "81/TCP", "80/UDP", "443/TCP"]


def ns(p: str) -> str:
    return p.split("/")[0]


def pod(p: str) -> str:
    return p.split("/")[1]


def _indent(spec: str, n: int) -> str:
    return "\n".join(" " * n + line for line in spec.strip("\n").splitlines())


def cnp(name: str, namespace: str, spec: str) -> str:
    return (
        "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{_indent(spec, 2)}\n"
    )


def ccnp(name: str, spec: str) -> str:
    return (
        "apiVersion: cilium.io/v2\nkind: CiliumClusterwideNetworkPolicy\n"
        f"metadata: {{name: {name}}}\nspec:\n{_indent(spec, 2)}\n"
    )


A = "endpointSelector: {matchLabels: {pod: a}}\n"
Exp = Callable[[int, str, str, str], bool]

CASES: dict[str, tuple[list[str], Exp]] = {
    "from-endpoints-namespaced": (
        [cnp("p", "x", A + "ingress:\n- fromEndpoints: [{matchLabels: {pod: b}}]")],
        lambda port, proto, s, d: d != "x/a" or s == "x/b",
    ),
    "from-endpoints-wildcard-is-namespace": (
        [cnp("p", "x", A + "ingress:\n- fromEndpoints: [{}]")],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "x",
    ),
    "from-endpoints-explicit-namespace": (
        [cnp("p", "x", A + "ingress:\n- fromEndpoints: [{matchLabels: {k8s:io.kubernetes.pod.namespace: y}}]")],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "y",
    ),
    "from-endpoints-namespace-labels": (
        [cnp("p", "x", A + "ingress:\n- fromEndpoints: [{matchLabels: {k8s:io.cilium.k8s.namespace.labels.ns: z}}]")],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "z",
    ),
    "from-endpoints-any-source-and-expressions": (
        [
            cnp(
                "p",
                "x",
                A
                + "ingress:\n- fromEndpoints:\n  - matchExpressions: [{key: 'any:pod', operator: NotIn, values: [b]}]",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or s in ("x/a", "x/c"),
    ),
    "empty-endpoint-selector-selects-namespace": (
        [cnp("p", "y", "endpointSelector: {}\ningress:\n- fromEndpoints: [{matchLabels: {pod: c}}]")],
        lambda port, proto, s, d: ns(d) != "y" or s == "y/c",
    ),
    "empty-ingress-rule-denies-all": (
        [cnp("p", "x", A + "ingress:\n- {}")],
        lambda port, proto, s, d: d != "x/a",
    ),
    "l4-only-rule-wildcards-peers": (
        [cnp("p", "x", A + "ingress:\n- toPorts: [{ports: [{port: '81', protocol: TCP}]}]")],
        lambda port, proto, s, d: d != "x/a" or (port, proto) == (81, "TCP"),
    ),
    "l3-l4-combined": (
        [
            cnp(
                "p",
                "x",
                A + "ingress:\n- fromEndpoints: [{matchLabels: {pod: b}}]\n"
                "  toPorts: [{ports: [{port: '80', protocol: TCP}]}]",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or (s == "x/b" and (port, proto) == (80, "TCP")),
    ),
    "protocol-any": (
        [cnp("p", "x", A + "ingress:\n- toPorts: [{ports: [{port: '80', protocol: ANY}]}]")],
        lambda port, proto, s, d: d != "x/a" or port == 80,
    ),
    "protocol-omitted-is-any": (
        [cnp("p", "x", A + "ingress:\n- toPorts: [{ports: [{port: '80'}]}]")],
        lambda port, proto, s, d: d != "x/a" or port == 80,
    ),
    "port-range": (
        [cnp("p", "x", A + "ingress:\n- toPorts: [{ports: [{port: '81', endPort: 443, protocol: TCP}]}]")],
        lambda port, proto, s, d: d != "x/a" or (proto == "TCP" and 81 <= port <= 443),
    ),
    "named-port": (
        [cnp("p", "x", A + "ingress:\n- toPorts: [{ports: [{port: serve-81-tcp}]}]")],
        lambda port, proto, s, d: d != "x/a" or (port, proto) == (81, "TCP"),
    ),
    "from-entities-all": (
        [cnp("p", "x", A + "ingress:\n- fromEntities: [all]")],
        lambda port, proto, s, d: True,
    ),
    "from-entities-cluster": (
        [cnp("p", "x", A + "ingress:\n- fromEntities: [cluster]")],
        lambda port, proto, s, d: True,
    ),
    "from-entities-world-excludes-pods": (
        [cnp("p", "x", A + "ingress:\n- fromEntities: [world]")],
        lambda port, proto, s, d: d != "x/a",
    ),
    "from-cidr-selects-pods-by-address": (
        [cnp("p", "x", A + "ingress:\n- fromCIDR: [10.0.2.0/24]")],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "y",
    ),
    "from-cidr-set-except": (
        [cnp("p", "x", A + "ingress:\n- fromCIDRSet: [{cidr: 10.0.0.0/16, except: [10.0.3.0/24, 10.0.1.2/32]}]")],
        lambda port, proto, s, d: d != "x/a" or (ns(s) != "z" and s != "x/b"),
    ),
    "egress-to-endpoints": (
        [cnp("p", "x", A + "egress:\n- toEndpoints: [{matchLabels: {pod: b}}]")],
        lambda port, proto, s, d: s != "x/a" or d == "x/b",
    ),
    "egress-to-cidr-with-ports": (
        [
            cnp(
                "p",
                "x",
                A + "egress:\n- toCIDR: [10.0.3.0/24]\n  toPorts: [{ports: [{port: '80', protocol: TCP}]}]",
            )
        ],
        lambda port, proto, s, d: s != "x/a" or (ns(d) == "z" and (port, proto) == (80, "TCP")),
    ),
    "ingress-deny-wins-over-allow-all": (
        [
            cnp(
                "p",
                "x",
                A + "ingress:\n- fromEntities: [all]\ningressDeny:\n- fromEndpoints: [{matchLabels: {pod: b}}]",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or s != "x/b",
    ),
    "deny-in-other-policy-wins": (
        [
            cnp("allow", "x", A + "ingress:\n- fromEndpoints: [{matchLabels: {pod: b}}]"),
            cnp(
                "deny",
                "x",
                A + "ingressDeny:\n- fromEndpoints: [{matchLabels: {pod: b}}]\n"
                "  toPorts: [{ports: [{port: '80', protocol: TCP}]}]",
            ),
        ],
        lambda port, proto, s, d: d != "x/a" or (s == "x/b" and (port, proto) != (80, "TCP")),
    ),
    "egress-deny-port-with-allow-all": (
        [
            cnp(
                "p",
                "x",
                A + "egress:\n- toEntities: [all]\negressDeny:\n- toPorts: [{ports: [{port: '80', protocol: TCP}]}]",
            )
        ],
        lambda port, proto, s, d: s != "x/a" or (port, proto) != (80, "TCP"),
    ),
    "deny-only-enforces-default-deny": (
        [cnp("p", "x", A + "ingressDeny:\n- fromEndpoints: [{matchLabels: {pod: b}}]")],
        lambda port, proto, s, d: d != "x/a",
    ),
    "enable-default-deny-false": (
        [
            cnp(
                "p",
                "x",
                A + "enableDefaultDeny: {ingress: false}\ningress:\n- fromEndpoints: [{matchLabels: {pod: b}}]\n"
                "ingressDeny:\n- fromEndpoints: [{matchLabels: {pod: c}}]",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or s != "x/c",
    ),
    "from-requires": (
        [
            cnp("req", "x", A + "ingress:\n- fromRequires: [{matchLabels: {pod: b}}]"),
            cnp("eps", "x", A + "ingress:\n- fromEndpoints: [{}]"),
        ],
        lambda port, proto, s, d: d != "x/a" or s == "x/b",
    ),
    "specs-list": (
        [
            "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: p, namespace: x}\nspecs:\n"
            "- endpointSelector: {matchLabels: {pod: a}}\n  ingress:\n  - fromEndpoints: [{matchLabels: {pod: b}}]\n"
            "- endpointSelector: {matchLabels: {pod: c}}\n  egress:\n  - toEndpoints: [{matchLabels: {pod: a}}]\n"
        ],
        lambda port, proto, s, d: (d != "x/a" or s == "x/b") and (s != "x/c" or d == "x/a"),
    ),
    "ccnp-wildcard-subject-cluster-wide": (
        [ccnp("p", "endpointSelector: {}\ningress:\n- fromEndpoints: [{matchLabels: {pod: b}}]")],
        lambda port, proto, s, d: pod(s) == "b",
    ),
    "ccnp-subject-in-every-namespace": (
        [ccnp("p", A + "ingress:\n- fromEndpoints: [{matchLabels: {k8s:io.kubernetes.pod.namespace: z}}]")],
        lambda port, proto, s, d: pod(d) != "a" or ns(s) == "z",
    ),
    "ccnp-wildcard-peer-is-all-pods": (
        [ccnp("p", A + "egress:\n- toEndpoints: [{}]\n  toPorts: [{ports: [{port: '80', protocol: TCP}]}]")],
        lambda port, proto, s, d: pod(s) != "a" or (port, proto) == (80, "TCP"),
    ),
    "l7-rules-keep-l3-l4": (
        [
            cnp(
                "p",
                "x",
                A + "ingress:\n- fromEndpoints: [{matchLabels: {pod: b}}]\n"
                "  toPorts:\n  - ports: [{port: '80', protocol: TCP}]\n    rules:\n      http: [{method: GET, path: /}]",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or (s == "x/b" and (port, proto) == (80, "TCP")),
    ),
    "to-fqdns-selects-nothing-not-wildcard": (
        [
            cnp(
                "p",
                "x",
                A
                + "egress:\n- toFQDNs: [{matchName: example.com}]\n  toPorts: [{ports: [{port: '443', protocol: TCP}]}]",
            )
        ],
        lambda port, proto, s, d: s != "x/a",
    ),
}
