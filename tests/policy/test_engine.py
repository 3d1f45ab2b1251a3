"""Engine-level tests: entries, entities, revisions, diffs, validation, unsupported, trace."""

# Policy documents are inline YAML; long lines keep each one readable.
# ruff: noqa: E501

from __future__ import annotations

import copy
import ipaddress
import pickle
import subprocess
import sys
from typing import Any

import pytest
import yaml

from services.common.labels import (
    Label,
    LabelSet,
    ReservedIdentity,
    cidr_identity_labels,
    filter_identity_labels,
    parse_label,
    pod_identity_labels,
)
from services.policy.engine.identity import Identity, LocalAllocator
from services.policy.engine.model import (
    Direction,
    EntryKey,
    IpProto,
    PolicyKind,
    PolicyRef,
    PolicyValidationError,
    Verdict,
)
from services.policy.engine.parse import parse_policy
from services.policy.engine.policyengine import PolicyEngine
from services.policy.engine.resolve import lookup
from services.policy.engine.trace import trace

ING, EGR = Direction.INGRESS, Direction.EGRESS


def pod_labels(ns: str, **labels: str) -> LabelSet:
    return pod_identity_labels({"metadata": {"namespace": ns, "labels": labels}}, None)


@pytest.fixture
def world() -> tuple[PolicyEngine, dict[str, int]]:
    """Engine with pods x/a (256), x/b (257), y/a (258) and a CIDR identity 192.0.2.0/24."""
    eng = PolicyEngine()
    alloc = LocalAllocator()
    ids: dict[str, int] = {}
    for ns, name in (("x", "a"), ("x", "b"), ("y", "a")):
        ident = alloc.allocate(pod_labels(ns, app=name))
        eng.upsert_identity(ident)
        ids[f"{ns}/{name}"] = ident.id
    cidr = alloc.allocate_cidr("192.0.2.0/24")
    eng.upsert_identity(cidr)
    ids["cidr"] = cidr.id
    return eng, ids


def doc(text: str) -> dict[str, Any]:
    loaded = yaml.safe_load(text)
    assert isinstance(loaded, dict)
    return loaded


CNP_A = "apiVersion: cilium.io/v2\nkind: CiliumNetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  endpointSelector: {matchLabels: {app: a}}\n"


@pytest.mark.parametrize(
    ("entity", "expected"),
    [
        ("world", {2, "cidr"}),
        ("host", {1}),
        ("remote-node", {6}),
        ("health", {4}),
        ("init", {5}),
        ("unmanaged", {3}),
        ("kube-apiserver", {7}),
        ("cluster", {1, 3, 4, 5, 6, 7, "x/a", "x/b", "y/a"}),
        ("all", {0}),
    ],
)
@pytest.mark.parametrize("direction", ["ingress", "egress"])
def test_entities_map_to_identities(world: Any, entity: str, expected: set[Any], direction: str) -> None:
    eng, ids = world
    field = "fromEntities" if direction == "ingress" else "toEntities"
    eng.upsert_policy_document(doc(CNP_A + f"  {direction}:\n  - {field}: [{entity}]\n"))
    pol = eng.policy_for(ids["x/a"])
    d = ING if direction == "ingress" else EGR
    want = {ids[x] if isinstance(x, str) else x for x in expected}
    assert {k.identity for k in pol.entries if k.direction is d} == want
    assert all(k.protocol is IpProto.ANY and (k.port_low, k.port_high) == (0, 0) for k in pol.entries)
    assert pol.enforced(d) and not pol.enforced(EGR if d is ING else ING)


def test_entries_and_enforcement_flags(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(
        doc(
            CNP_A
            + "  ingress:\n  - fromEndpoints: [{matchLabels: {app: b}}]\n    toPorts: [{ports: [{port: '80', endPort: 90, protocol: TCP}]}]\n"
            "  egressDeny:\n  - toCIDR: [192.0.2.0/24]\n"
            "  egress:\n  - icmps: [{fields: [{type: 8}, {type: EchoRequest, family: IPv6}]}]\n"
        )
    )
    pol = eng.policy_for(ids["x/a"])
    assert dict(pol.entries) == {
        EntryKey(ING, ids["x/b"], IpProto.TCP, 80, 90): Verdict.ALLOW,
        EntryKey(EGR, ids["cidr"], IpProto.ANY, 0, 0): Verdict.DENY,
        EntryKey(EGR, 0, IpProto.ICMP, 8, 8): Verdict.ALLOW,
        EntryKey(EGR, 0, IpProto.ICMPV6, 128, 128): Verdict.ALLOW,
    }
    assert pol.ingress_enforced and pol.egress_enforced
    assert eng.policy_for(ids["x/b"]).entries == {}
    assert not eng.policy_for(ids["x/b"]).ingress_enforced
    assert lookup(pol, EGR, ids["cidr"], IpProto.ICMP, 8).allowed is False
    assert lookup(pol, EGR, ids["x/b"], IpProto.ICMP, 8).allowed is True
    assert lookup(pol, EGR, ids["x/b"], IpProto.ICMP, 0).reason == "default-deny"
    assert lookup(pol, ING, ids["x/b"], IpProto.TCP, 85).reason == "allow-entry"


def test_revisions_and_rejection(world: Any) -> None:
    eng, ids = world
    eng.seed_revision(41)
    r1 = eng.upsert_policy_document(doc(CNP_A + "  ingress:\n  - fromEndpoints: [{matchLabels: {app: b}}]\n"))
    assert r1.revision == 42 and set(r1.diffs) == {ids["x/a"]}
    before = dict(eng.policy_for(ids["x/a"]).entries)
    with pytest.raises(PolicyValidationError) as err:
        eng.upsert_policy_document(
            doc(CNP_A + "  ingress:\n  - fromCIDRSet: [{cidr: 10.0.0.0/8, except: [11.0.0.0/16]}]\n")
        )
    assert err.value.object == "CiliumNetworkPolicy x/p"
    assert err.value.path == "spec.ingress[0].fromCIDRSet[0].except[0]"
    assert eng.revision == 42 and dict(eng.policy_for(ids["x/a"]).entries) == before
    r2 = eng.upsert_policy_document(doc(CNP_A + "  ingress:\n  - fromEndpoints: [{matchLabels: {app: b}}]\n"))
    assert r2.revision == 43 and not r2.diffs  # accepted, unchanged result
    r3 = eng.delete_policy(PolicyRef(PolicyKind.CILIUM_NETWORK_POLICY, "x", "p"))
    assert r3.revision == 44
    assert r3.diffs[ids["x/a"]].removed == frozenset(before) and not r3.diffs[ids["x/a"]].ingress_enforced
    eng.seed_revision(10)
    assert eng.revision == 44


def test_identity_changes_produce_diffs(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(doc(CNP_A + "  ingress:\n  - fromEndpoints: [{matchLabels: {app: c}}]\n"))
    assert eng.policy_for(ids["x/a"]).entries == {}
    new = Identity(300, pod_labels("x", app="c"))
    res = eng.upsert_identity(new)
    assert res.diffs[ids["x/a"]].added == {EntryKey(ING, 300, IpProto.ANY, 0, 0): Verdict.ALLOW}
    assert 300 in res.diffs  # the new subject itself appears
    res = eng.remove_identity(300)
    assert res.diffs[ids["x/a"]].removed == {EntryKey(ING, 300, IpProto.ANY, 0, 0)}
    assert res.diffs[300].deleted


def test_ipcache_moves_identity_in_and_out_of_cidr(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(doc(CNP_A + "  egress:\n  - toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]\n"))
    assert eng.policy_for(ids["x/a"]).entries == {}
    res = eng.upsert_ipcache(ipaddress.ip_address("10.2.0.5"), ids["y/a"])
    assert res.diffs[ids["x/a"]].added == {EntryKey(EGR, ids["y/a"], IpProto.ANY, 0, 0): Verdict.ALLOW}
    res = eng.upsert_ipcache(ipaddress.ip_address("10.1.0.7"), ids["y/a"])  # partly excepted: conservative
    assert res.diffs[ids["x/a"]].removed == {EntryKey(EGR, ids["y/a"], IpProto.ANY, 0, 0)}
    res = eng.delete_ipcache(ipaddress.ip_address("10.1.0.7"))
    assert ids["x/a"] in res.diffs
    assert ipaddress.ip_network("10.1.0.0/16") in eng.referenced_cidrs()


def test_named_ports_per_identity(world: Any) -> None:
    eng, ids = world
    eng.set_named_ports(ids["x/b"], {"http": [(IpProto.TCP, 8080)]})
    eng.set_named_ports(ids["y/a"], {"http": [(IpProto.TCP, 9090)]})
    eng.upsert_policy_document(doc(CNP_A + "  egress:\n  - toPorts: [{ports: [{port: http, protocol: TCP}]}]\n"))
    assert set(eng.policy_for(ids["x/a"]).entries) == {
        EntryKey(EGR, ids["x/b"], IpProto.TCP, 8080, 8080),
        EntryKey(EGR, ids["y/a"], IpProto.TCP, 9090, 9090),
    }
    res = eng.set_named_ports(ids["y/a"], {"http": [(IpProto.TCP, 9191)]})
    assert res.diffs[ids["x/a"]].added == {EntryKey(EGR, ids["y/a"], IpProto.TCP, 9191, 9191): Verdict.ALLOW}


def test_trace_names_deciding_rules(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(
        doc(
            CNP_A
            + "  ingress:\n  - fromEntities: [all]\n  ingressDeny:\n  - fromEndpoints: [{matchLabels: {app: b}}]\n"
        )
    )
    t = trace(eng, src=ids["x/b"], dst=ids["x/a"], port=80, protocol=IpProto.TCP)
    assert not t.allowed and t.ingress.reason == "deny-rule"
    assert [r.peer_rule for r in t.ingress.matched] == ["spec.ingressDeny[0]"]
    assert t.egress.reason == "default-allow"
    t2 = trace(eng, src=ids["y/a"], dst=ids["x/a"], port=80, protocol=IpProto.TCP)
    assert t2.allowed and t2.ingress.reason == "allow-rule" and "Final verdict: ALLOWED" in t2.render()


@pytest.mark.parametrize(
    ("text", "obj", "path"),
    [
        (
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  podSelector: {}\n"
            "  ingress:\n  - from:\n    - podSelector: {}\n    - ipBlock: {cidr: 192.168.0.0/16, except: [10.1.0.0/16]}\n",
            "NetworkPolicy x/p",
            "spec.ingress[0].from[1].ipBlock.except[0]",
        ),
        (
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  podSelector: {}\n"
            "  ingress:\n  - ports: [{port: 90, endPort: 80}]\n",
            "NetworkPolicy x/p",
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  podSelector: {}\n"
            "  egress:\n  - ports: [{port: 80, protocol: ICMP}]\n",
            "NetworkPolicy x/p",
            "spec.egress[0].ports[0].protocol",
        ),
        (
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  podSelector:\n"
            "    matchExpressions: [{key: a, operator: Foo}]\n",
            "NetworkPolicy x/p",
            "spec.podSelector.matchExpressions[0].operator",
        ),
        (
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  podSelector: {}\n"
            "  policyTypes: [Sideways]\n",
            "NetworkPolicy x/p",
            "spec.policyTypes[0]",
        ),
        (
            CNP_A + "  egress:\n  - toEntities: [moon]\n",
            "CiliumNetworkPolicy x/p",
            "spec.egress[0].toEntities[0]",
        ),
        (
            CNP_A + "  egress:\n  - toCIDR: [10.0.0.300/8]\n",
            "CiliumNetworkPolicy x/p",
            "spec.egress[0].toCIDR[0]",
        ),
        (
            CNP_A + "  ingress:\n  - toPorts: [{ports: [{port: '70000'}]}]\n",
            "CiliumNetworkPolicy x/p",
            "spec.ingress[0].toPorts[0].ports[0].port",
        ),
        (
            "apiVersion: cilium.io/v2\nkind: CiliumClusterwideNetworkPolicy\nmetadata: {name: c}\nspecs:\n- ingress: [{}]\n",
            "CiliumClusterwideNetworkPolicy c",
            "specs[0]",
        ),
    ],
)
def test_validation_errors_name_object_and_path(text: str, obj: str, path: str) -> None:
    with pytest.raises(PolicyValidationError) as err:
        parse_policy(doc(text))
    assert err.value.object == obj
    assert err.value.path == path
    assert str(err.value).startswith(f"{obj}: {path}: ")


def test_ip_block_error_message_format() -> None:
    text = (
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec:\n  podSelector: {}\n"
        "  ingress:\n  - from:\n    - podSelector: {}\n    - ipBlock: {cidr: 192.168.0.0/16, except: [10.1.0.0/16]}\n"
    )
    with pytest.raises(PolicyValidationError) as err:
        parse_policy(doc(text))
    assert str(err.value) == (
        "NetworkPolicy x/p: spec.ingress[0].from[1].ipBlock.except[0]: 10.1.0.0/16 not inside cidr 192.168.0.0/16"
    )


@pytest.mark.parametrize(
    ("section", "feature"),
    [
        ("egress:\n  - toGroups: [{aws: {labels: {a: b}}}]\n", "spec.egress[0].toGroups: toGroups"),
        ("ingress:\n  - fromNodes: [{matchLabels: {a: b}}]\n", "spec.ingress[0].fromNodes: fromNodes"),
        (
            "ingress:\n  - toPorts: [{ports: [{port: '80'}], rules: {http: [{method: GET}]}}]\n",
            "spec.ingress[0].toPorts[0].rules: L7 rules.http",
        ),
        (
            "egress:\n  - toPorts: [{ports: [{port: '443'}], serverNames: [a.com]}]\n",
            "spec.egress[0].toPorts[0].serverNames",
        ),
        (
            "egress:\n  - toPorts: [{ports: [{port: '80'}], listener: {envoyConfig: {kind: CiliumEnvoyConfig, name: e}, name: l}}]\n",
            "spec.egress[0].toPorts[0].listener",
        ),
        ("ingress:\n  - fromEntities: [all]\n    authentication: {mode: required}\n", "spec.ingress[0].authentication"),
        ("ingress:\n  - fromCIDRSet: [{cidrGroupRef: g}]\n", "spec.ingress[0].fromCIDRSet[0].cidrGroupRef"),
        (
            "egress:\n  - toPorts: [{ports: [{port: '0', protocol: VRRP}]}]\n",
            "spec.egress[0].toPorts[0].ports[0].protocol",
        ),
    ],
)
def test_unsupported_features_are_reported(section: str, feature: str) -> None:
    policy = parse_policy(doc(CNP_A + "  " + section))
    assert any(u.startswith(feature) for u in policy.unsupported), policy.unsupported


def test_node_selector_rule_reported_and_not_applied() -> None:
    policy = parse_policy(
        doc(
            "apiVersion: cilium.io/v2\nkind: CiliumClusterwideNetworkPolicy\nmetadata: {name: h}\nspec:\n"
            "  nodeSelector: {}\n  ingress:\n  - fromEntities: [cluster]\n"
        )
    )
    assert policy.rules == ()
    assert policy.unsupported and policy.unsupported[0].startswith("spec.nodeSelector: host policy")


# --- labels ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("k8s:app=web", Label("k8s", "app", "web")),
        ("reserved:host", Label("reserved", "host", "")),
        ("$world", Label("reserved", "world", "")),
        ("app=a:b", Label("unspec", "app", "a:b")),
        ("cidr:10.0.0.0/8", Label("cidr", "10.0.0.0/8", "")),
    ],
)
def test_parse_and_format_labels(text: str, label: Label) -> None:
    assert parse_label(text) == label
    if not text.startswith("$") and ":" in text.split("=")[0]:
        assert str(label) == text


@pytest.mark.parametrize(
    ("key", "kept"),
    [
        ("app", True),
        ("app.kubernetes.io/name", True),
        ("pod-template-hash", False),
        ("controller-revision-hash", False),
        ("statefulset.kubernetes.io/pod-name", False),
        ("apps.kubernetes.io/pod-index", False),
        ("job-name", False),
        ("batch.kubernetes.io/job-name", False),
        ("batch.kubernetes.io/controller-uid", False),
        ("controller-uid", False),
        ("io.kubernetes.pod.namespace", True),
        ("io.kubernetes.foo", False),
        ("io.cilium.k8s.namespace.labels.team", True),
        ("io.cilium.k8s.policy.serviceaccount", True),
    ],
)
def test_identity_label_filter(key: str, kept: bool) -> None:
    assert (Label("k8s", key, "v") in filter_identity_labels([Label("k8s", key, "v")])) is kept


def test_pod_identity_labels() -> None:
    labels = pod_identity_labels(
        {
            "metadata": {"namespace": "x", "labels": {"app": "web", "pod-template-hash": "123"}},
            "spec": {"serviceAccountName": "sa1"},
        },
        {"metadata": {"name": "x", "labels": {"team": "blue"}}},
    )
    assert str(labels) == ";".join(
        [
            "k8s:app=web",
            "k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=x",
            "k8s:io.cilium.k8s.namespace.labels.team=blue",
            "k8s:io.cilium.k8s.policy.cluster=default",
            "k8s:io.cilium.k8s.policy.serviceaccount=sa1",
            "k8s:io.kubernetes.pod.namespace=x",
        ]
    )
    assert LabelSet.parse(str(labels)) == labels and hash(LabelSet.parse(str(labels))) == hash(labels)
    assert str(cidr_identity_labels("10.0.0.0/8")) == "cidr:10.0.0.0/8;reserved:world"
    assert int(ReservedIdentity.KUBE_APISERVER) == 7 and int(ReservedIdentity.REMOTE_NODE) == 6


def test_selectors_copy_and_pickle_with_their_hash_recomputed() -> None:
    policy = parse_policy(
        doc(CNP_A + "  ingress:\n  - fromEndpoints: [{matchLabels: {app: b}}]\n  - fromCIDR: [10.0.0.0/8]\n")
    )
    for sel in policy.referenced_selectors():
        for clone in (pickle.loads(pickle.dumps(sel)), copy.deepcopy(sel), copy.copy(sel)):
            assert clone == sel and hash(clone) == hash(sel)
    # Selectors cache their hash, and string hashes differ between processes:
    # another process must recompute it rather than unpickle ours.
    code = "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); print(hash(s) == hash(type(s)(*s.__reduce__()[1])))"
    for sel in policy.referenced_selectors():
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=pickle.dumps(sel),
            capture_output=True,
            check=True,
            env={"PYTHONHASHSEED": "1"},
        )
        assert out.stdout.strip() == b"True"
