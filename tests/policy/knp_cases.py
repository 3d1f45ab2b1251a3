"""Kubernetes NetworkPolicy v1 semantics on the upstream x/y/z, a/b/c model.

Each case: policies, and expect(port, proto, src, dst) for every probe. Pods
are "ns/pod"; pod labels pod=<a|b|c>, namespace labels ns=<x|y|z>, IPs
10.0.<ns 1-3>.<pod 1-3>, named ports serve-{80,81}-{tcp,udp,sctp}.
"""

# Policy documents are inline YAML; long lines keep each one readable.
# ruff: noqa: E501

from __future__ import annotations

from collections.abc import Callable

PROBES = ["80/TCP", "81/TCP", "82/TCP", "80/UDP", "81/UDP", "80/SCTP"]


def ns(p: str) -> str:
    return p.split("/")[0]


def pod(p: str) -> str:
    return p.split("/")[1]


def knp(name: str, namespace: str, spec: str) -> str:
    body = "\n".join("  " + line for line in spec.strip("\n").splitlines())
    return (
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{body}\n"
    )


Exp = Callable[[int, str, str, str], bool]

CASES: dict[str, tuple[list[str], Exp]] = {
    "no-policy-allows-all": ([], lambda port, proto, s, d: True),
    "default-deny-ingress": (
        [knp("deny", "x", "podSelector: {}\npolicyTypes: [Ingress]")],
        lambda port, proto, s, d: ns(d) != "x",
    ),
    "default-deny-ingress-implicit-type": (
        [knp("deny", "x", "podSelector: {}")],
        lambda port, proto, s, d: ns(d) != "x",
    ),
    "default-deny-egress": (
        [knp("deny", "x", "podSelector: {}\npolicyTypes: [Egress]")],
        lambda port, proto, s, d: ns(s) != "x",
    ),
    "default-deny-both": (
        [knp("deny", "x", "podSelector: {}\npolicyTypes: [Ingress, Egress]")],
        lambda port, proto, s, d: ns(s) != "x" and ns(d) != "x",
    ),
    "allow-from-pod-same-namespace": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - podSelector: {matchLabels: {pod: b}}",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or s == "x/b",
    ),
    "allow-from-namespace": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - namespaceSelector: {matchLabels: {ns: y}}",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "y",
    ),
    "allow-from-namespace-by-metadata-name": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n"
                "  - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: z}}",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "z",
    ),
    "allow-from-namespace-and-pod": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n"
                "  - namespaceSelector: {matchLabels: {ns: y}}\n    podSelector: {matchLabels: {pod: b}}",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or s == "y/b",
    ),
    "allow-from-namespace-or-pod": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n"
                "  - namespaceSelector: {matchLabels: {ns: y}}\n  - podSelector: {matchLabels: {pod: b}}",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or ns(s) == "y" or s == "x/b",
    ),
    "allow-from-all-namespaces": (
        [knp("p", "x", "podSelector: {}\ningress:\n- from:\n  - namespaceSelector: {}")],
        lambda port, proto, s, d: True,
    ),
    "allow-from-namespace-expression-notin": (
        [
            knp(
                "p",
                "x",
                "podSelector: {}\ningress:\n- from:\n  - namespaceSelector:\n"
                "      matchExpressions: [{key: ns, operator: NotIn, values: [y]}]",
            )
        ],
        lambda port, proto, s, d: ns(d) != "x" or ns(s) != "y",
    ),
    "allow-from-pod-expression-in": (
        [
            knp(
                "p",
                "x",
                "podSelector: {}\ningress:\n- from:\n  - podSelector:\n"
                "      matchExpressions: [{key: pod, operator: In, values: [a, c]}]",
            )
        ],
        lambda port, proto, s, d: ns(d) != "x" or (ns(s) == "x" and pod(s) in "ac"),
    ),
    "ingress-empty-rule-allows-all": (
        [
            knp("deny", "x", "podSelector: {}\npolicyTypes: [Ingress]"),
            knp("allow", "x", "podSelector: {}\ningress:\n- {}"),
        ],
        lambda port, proto, s, d: True,
    ),
    "ports-without-peers-from-everywhere": (
        [knp("p", "x", "podSelector: {matchLabels: {pod: a}}\ningress:\n- ports: [{port: 81}]")],
        lambda port, proto, s, d: d != "x/a" or (port == 81 and proto == "TCP"),
    ),
    "ip-block-with-except": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n"
                "  - ipBlock: {cidr: 10.0.2.0/24, except: [10.0.2.2/32]}",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or s in ("y/a", "y/c"),
    ),
    "egress-ip-block": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to:\n"
                "  - ipBlock: {cidr: 10.0.3.0/24}",
            )
        ],
        lambda port, proto, s, d: s != "x/a" or ns(d) == "z",
    ),
    "egress-to-pod": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to:\n"
                "  - podSelector: {matchLabels: {pod: b}}",
            )
        ],
        lambda port, proto, s, d: s != "x/a" or d == "x/b",
    ),
    "egress-rules-imply-egress-type": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\negress:\n- to:\n  - namespaceSelector: {matchLabels: {ns: y}}",
            )
        ],
        # policyTypes defaults to [Ingress, Egress]: ingress to x/a denied too.
        lambda port, proto, s, d: (s != "x/a" or ns(d) == "y") and d != "x/a",
    ),
    "ingress-rules-ignored-when-egress-only-type": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\n"
                "ingress:\n- from:\n  - podSelector: {matchLabels: {pod: b}}\negress:\n- {}",
            )
        ],
        lambda port, proto, s, d: True,
    ),
    "multiple-policies-are-additive": (
        [
            knp(
                "p1",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - podSelector: {matchLabels: {pod: b}}",
            ),
            knp(
                "p2",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - podSelector: {matchLabels: {pod: c}}",
            ),
        ],
        lambda port, proto, s, d: d != "x/a" or s in ("x/b", "x/c"),
    ),
    "policies-in-other-namespace-do-not-select": (
        [
            knp(
                "p",
                "y",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n  - podSelector: {matchLabels: {pod: b}}",
            )
        ],
        lambda port, proto, s, d: d != "y/a" or s == "y/b",
    ),
    "numbered-port": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: 80}]")],
        lambda port, proto, s, d: ns(d) != "x" or (port == 80 and proto == "TCP"),
    ),
    "named-port": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: serve-81-tcp}]")],
        lambda port, proto, s, d: ns(d) != "x" or (port == 81 and proto == "TCP"),
    ),
    "named-port-udp": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: serve-80-udp, protocol: UDP}]")],
        lambda port, proto, s, d: ns(d) != "x" or (port == 80 and proto == "UDP"),
    ),
    "named-port-protocol-mismatch-allows-nothing": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: serve-80-udp}]")],
        lambda port, proto, s, d: ns(d) != "x",
    ),
    "egress-named-port": (
        [knp("p", "x", "podSelector: {}\npolicyTypes: [Egress]\negress:\n- ports: [{port: serve-80-tcp}]")],
        lambda port, proto, s, d: ns(s) != "x" or (port == 80 and proto == "TCP"),
    ),
    "end-port": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: 81, endPort: 82}]")],
        lambda port, proto, s, d: ns(d) != "x" or (port in (81, 82) and proto == "TCP"),
    ),
    "udp": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: 80, protocol: UDP}]")],
        lambda port, proto, s, d: ns(d) != "x" or (port == 80 and proto == "UDP"),
    ),
    "sctp": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{port: 80, protocol: SCTP}]")],
        lambda port, proto, s, d: ns(d) != "x" or (port == 80 and proto == "SCTP"),
    ),
    "protocol-without-port": (
        [knp("p", "x", "podSelector: {}\ningress:\n- ports: [{protocol: UDP}]")],
        lambda port, proto, s, d: ns(d) != "x" or proto == "UDP",
    ),
    "peers-and-ports-combined": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\ningress:\n- from:\n"
                "  - namespaceSelector: {matchLabels: {ns: z}}\n  ports: [{port: 80}, {port: 81, protocol: UDP}]",
            )
        ],
        lambda port, proto, s, d: d != "x/a" or (ns(s) == "z" and (port, proto) in ((80, "TCP"), (81, "UDP"))),
    ),
    "egress-and-ingress-both-needed": (
        [
            knp(
                "e",
                "x",
                "podSelector: {matchLabels: {pod: b}}\npolicyTypes: [Egress]\negress:\n- to:\n  - namespaceSelector: {matchLabels: {ns: y}}",
            ),
            knp("i", "y", "podSelector: {}\ningress:\n- from:\n  - podSelector: {}"),
        ],
        lambda port, proto, s, d: (s != "x/b" or ns(d) == "y") and (ns(d) != "y" or ns(s) == "y"),
    ),
    # ipBlocks naming pod addresses, as a fault run tried them (x/a is 10.0.1.1, x/b 10.0.1.2).
    "ipblock-egress-pod-address-with-except": (
        [
            knp(
                "p",
                "x",
                "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]\negress:\n- to:\n"
                "  - ipBlock: {cidr: 10.0.1.1/4, except: [10.0.1.2/32]}",
            )
        ],
        lambda port, proto, s, d: s != "x/a" or d != "x/b",
    ),
    "legacy-extensions-v1beta1": (
        [
            "apiVersion: extensions/v1beta1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\n"
            "spec:\n  podSelector: {matchLabels: {pod: a}}\n  ingress:\n  - from:\n"
            "    - podSelector: {matchLabels: {pod: b}}"
        ],
        lambda port, proto, s, d: d != "x/a" or s == "x/b",
    ),
}
