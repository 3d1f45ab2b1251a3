"""toFQDNs and DNS rules in the engine: validation naming the field, resolution into each identity's
rules on names, their diffs (incremental and whole agree), and audit mode."""

# Policy documents are inline YAML; long lines keep each one readable.
# ruff: noqa: E501

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.fqdn import matches
from services.policy.engine.audit import full_engine, overlays, with_audit
from services.policy.engine.identity import Identity, LocalAllocator
from services.policy.engine.model import DnsRule, EntryKey, FqdnRule, IpProto, NameRules, PolicyValidationError, Verdict
from services.policy.engine.names import dns_decision, fqdn_matches
from services.policy.engine.orders import OrderDiff, PlannedOrder
from services.policy.engine.parse import parse_policy
from services.policy.engine.policyengine import PolicyEngine, apply_diff
from tests.policy.strategies import IDS, PROBES, documents, named, pod_range_labels
from tests.policy.test_engine import CNP_A, EGR, doc, pod_labels

TCP, UDP, ANY = IpProto.TCP, IpProto.UDP, IpProto.ANY
KUBE_DNS = "toEndpoints: [{matchLabels: {'k8s:io.kubernetes.pod.namespace': kube-system, k8s-app: kube-dns}}]"


@pytest.fixture
def world() -> tuple[PolicyEngine, dict[str, int]]:
    """Pods x/a (256), x/b (257) and the cluster's DNS server kube-system/kube-dns (258)."""
    eng = PolicyEngine()
    alloc = LocalAllocator()
    ids: dict[str, int] = {}
    for ns, labels in (("x", {"app": "a"}), ("x", {"app": "b"}), ("kube-system", {"k8s-app": "kube-dns"})):
        ident = alloc.allocate(pod_labels(ns, **labels))
        eng.upsert_identity(ident)
        ids[f"{ns}/{next(iter(labels.values()))}"] = ident.id
    return eng, ids


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "path", "message"),
    [
        ("egress:\n  - toFQDNs: [{matchName: 'api/v1.example.test'}]\n", "spec.egress[0].toFQDNs[0].matchName", "'/'"),
        (
            "egress:\n  - toFQDNs: [{matchName: 'a..example.test'}]\n",
            "spec.egress[0].toFQDNs[0].matchName",
            "empty label",
        ),
        ("egress:\n  - toFQDNs: [{matchName: '*.example.test'}]\n", "spec.egress[0].toFQDNs[0].matchName", "'*'"),
        (
            "egress:\n  - toFQDNs: [{matchPattern: '[a-z].example.test'}]\n",
            "spec.egress[0].toFQDNs[0].matchPattern",
            "'[]'",
        ),
        (
            "egress:\n  - toFQDNs: [{matchPattern: 'a.**.test'}]\n",
            "spec.egress[0].toFQDNs[0].matchPattern",
            "first label",
        ),
        ("egress:\n  - toFQDNs: [{}]\n", "spec.egress[0].toFQDNs[0]", "empty selector"),
        (
            "egress:\n  - toFQDNs: [{matchName: a.test, matchPattern: '*.test'}]\n",
            "spec.egress[0].toFQDNs[0]",
            "exactly one of matchName or matchPattern",
        ),
        (
            "egress:\n  - toFQDNs: [{matchName: a.test}]\n    toEndpoints: [{}]\n",
            "spec.egress[0].toFQDNs",
            "cannot be combined with toEndpoints",
        ),
        (
            "egress:\n  - toFQDNs: [{matchName: a.test}]\n    toPorts: [{ports: [{port: https}]}]\n",
            "spec.egress[0].toPorts",
            "named port https/ANY cannot be used with toFQDNs",
        ),
        (
            "egress:\n  - toPorts: [{ports: [{port: '53'}], rules: {dns: [{matchPattern: 'a b'}]}}]\n",
            "spec.egress[0].toPorts[0].rules.dns[0].matchPattern",
            "' '",
        ),
        (
            "ingress:\n  - toPorts: [{ports: [{port: '53'}], rules: {dns: [{matchPattern: '*'}]}}]\n",
            "spec.ingress[0].toPorts[0].rules.dns",
            "only allowed in egress",
        ),
        (
            "egress:\n  - toPorts: [{rules: {dns: [{matchPattern: '*'}]}}]\n",
            "spec.egress[0].toPorts[0].ports",
            "need the DNS server port",
        ),
        (
            "egress:\n  - toPorts: [{ports: [{port: '53', endPort: 54}], rules: {dns: [{matchPattern: '*'}]}}]\n",
            "spec.egress[0].toPorts[0].ports[0].endPort",
            "one port, not a range",
        ),
        (
            "egress:\n  - toPorts: [{ports: [{port: '53'}], rules: {dns: [{matchPattern: '*'}], http: [{method: GET}]}}]\n",
            "spec.egress[0].toPorts[0].rules",
            "dns cannot be combined with http",
        ),
    ],
)
def test_invalid_names_are_errors_naming_the_field(section: str, path: str, message: str) -> None:
    with pytest.raises(PolicyValidationError) as err:
        parse_policy(doc(CNP_A + "  " + section))
    assert err.value.path == path
    assert message in err.value.message


def test_names_are_supported_not_reported() -> None:
    policy = parse_policy(
        doc(
            CNP_A
            + f"  egress:\n  - {KUBE_DNS}\n    toPorts: [{{ports: [{{port: '53', protocol: ANY}}], rules: {{dns: [{{matchPattern: '*.example.test'}}]}}}}]\n"
            "  - toFQDNs: [{matchPattern: '*.Example.Test.'}, {matchName: api.other.test}]\n"
        )
    )
    assert policy.unsupported == ()
    fqdn_rule = policy.rules[0].peer_rules[1]
    assert fqdn_rule.fqdns == ("*.example.test", "api.other.test")
    assert fqdn_rule.peers == ()  # adds no peer identity: the node learns the addresses


def test_a_dns_rule_on_a_port_the_nodes_do_not_steer_is_reported() -> None:
    """Its queries are allowed (L4) but their names neither filtered nor learned: the status says so."""
    policy = parse_policy(
        doc(
            CNP_A
            + "  egress:\n  - toPorts: [{ports: [{port: '5353', protocol: UDP}], rules: {dns: [{matchName: b.test}]}}]\n"
        )
    )
    (note,) = policy.unsupported
    assert note.startswith("spec.egress[0].toPorts[0].ports[0].port: DNS rules on port 5353: only port 53 is steered")


def test_other_l7_rules_stay_reported() -> None:
    policy = parse_policy(
        doc(CNP_A + "  egress:\n  - toPorts: [{ports: [{port: '80'}], rules: {http: [{method: GET}]}}]\n")
    )
    assert policy.unsupported == ("spec.egress[0].toPorts[0].rules: L7 rules.http; L3/L4 part enforced",)


def test_clusterwide_policies_take_names() -> None:
    policy = parse_policy(
        doc(
            "apiVersion: cilium.io/v2\nkind: CiliumClusterwideNetworkPolicy\nmetadata: {name: c}\nspec:\n"
            "  endpointSelector: {}\n  egress:\n  - toFQDNs: [{matchName: a.test}]\n"
        )
    )
    assert policy.rules[0].peer_rules[0].fqdns == ("a.test",)


# --- resolution -----------------------------------------------------------------------------


DNS_53 = "    toPorts: [{ports: [{port: '53', protocol: ANY}], rules: {dns: [{matchPattern: '*.example.test'}, {matchName: b.test}]}}]\n"


@pytest.mark.parametrize(
    ("egress", "fqdn", "dns"),
    [
        (
            "  - toFQDNs: [{matchPattern: '*.example.test'}]\n    toPorts: [{ports: [{port: '443', protocol: TCP}, {port: '8000', endPort: 8080, protocol: TCP}]}]\n",
            [FqdnRule("*.example.test", TCP, 443, 443), FqdnRule("*.example.test", TCP, 8000, 8080)],
            [],
        ),
        (
            "  - toFQDNs: [{matchName: a.test}, {matchPattern: '*'}]\n",
            [FqdnRule("*", ANY, 0, 0), FqdnRule("a.test", ANY, 0, 0)],
            [],
        ),
        (
            "  - toFQDNs: [{matchName: a.test}]\n    toPorts: [{ports: [{port: '443'}]}]\n",
            [FqdnRule("a.test", p, 443, 443) for p in (TCP, UDP, IpProto.SCTP)],
            [],
        ),
        (
            f"  - {KUBE_DNS}\n{DNS_53}",
            [],
            [DnsRule(258, p, 53, ("*.example.test", "b.test")) for p in (TCP, UDP)],
        ),
        (
            "  - toPorts: [{ports: [{port: '5353', protocol: UDP}], rules: {dns: [{matchName: b.test}]}}]\n",
            [],
            [DnsRule(0, UDP, 5353, ("b.test",))],
        ),
        (
            # two rules for one server and port: one DNS rule with both selectors
            f"  - {KUBE_DNS}\n    toPorts: [{{ports: [{{port: '53', protocol: UDP}}], rules: {{dns: [{{matchName: a.test}}]}}}}]\n"
            f"  - {KUBE_DNS}\n    toPorts: [{{ports: [{{port: '53', protocol: UDP}}], rules: {{dns: [{{matchName: b.test}}]}}}}]\n",
            [],
            [DnsRule(258, UDP, 53, ("a.test", "b.test"))],
        ),
    ],
)
def test_rules_on_names_per_identity(world: Any, egress: str, fqdn: list[FqdnRule], dns: list[DnsRule]) -> None:
    eng, ids = world
    eng.upsert_policy_document(doc(CNP_A + "  egress:\n" + egress))
    assert eng.policy_for(ids["x/a"]).names == NameRules(tuple(sorted(fqdn)), tuple(dns))
    assert eng.policy_for(ids["x/b"]).names == NameRules()


def test_a_dns_rule_allows_the_dns_traffic_itself(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(doc(CNP_A + f"  egress:\n  - {KUBE_DNS}\n{DNS_53}"))
    entries = dict(eng.policy_for(ids["x/a"]).entries.items())
    for proto in (TCP, UDP):
        assert entries[EntryKey(EGR, 258, proto, 53, 53)] is Verdict.ALLOW


def test_fqdn_allows_only_where_egress_is_enforced_dns_rules_always(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(
        doc(
            CNP_A
            + f"  egress:\n  - {KUBE_DNS}\n{DNS_53}  - toFQDNs: [{{matchName: a.test}}]\n  enableDefaultDeny: {{egress: false}}\n"
        )
    )
    names = eng.policy_for(ids["x/a"]).names
    assert names.fqdn == ()  # an allow in a direction without default deny changes nothing
    assert [d.port for d in names.dns] == [53, 53]


def test_names_follow_the_dns_servers_identities(world: Any) -> None:
    eng, ids = world
    eng.upsert_policy_document(doc(CNP_A + f"  egress:\n  - {KUBE_DNS}\n{DNS_53}"))
    second = Identity(300, pod_labels("kube-system", **{"k8s-app": "kube-dns", "zone": "b"}))
    res = eng.upsert_identity(second)
    diff = res.diffs[ids["x/a"]]
    assert diff.names is not None
    assert sorted({d.remote_identity for d in diff.names.dns}) == [258, 300]
    assert eng.policy_for(ids["x/a"]).names == eng.compute_all()[ids["x/a"]].names
    res = eng.remove_identity(300)
    assert {d.remote_identity for d in res.diffs[ids["x/a"]].names.dns} == {258}


def test_diffs_carry_names_only_when_they_change(world: Any) -> None:
    eng, ids = world
    a = ids["x/a"]
    res = eng.upsert_policy_document(doc(CNP_A + "  egress:\n  - toFQDNs: [{matchName: a.test}]\n"))
    assert res.diffs[a].names == NameRules((FqdnRule("a.test", ANY, 0, 0),))
    # a policy change that leaves the names alone: entries change, names do not
    res = eng.upsert_policy_document(
        doc(CNP_A + "  egress:\n  - toFQDNs: [{matchName: a.test}]\n  - toEndpoints: [{matchLabels: {app: b}}]\n")
    )
    assert res.diffs[a].names is None and res.diffs[a].added
    # only the names change
    res = eng.upsert_policy_document(
        doc(CNP_A + "  egress:\n  - toFQDNs: [{matchName: b.test}]\n  - toEndpoints: [{matchLabels: {app: b}}]\n")
    )
    assert res.diffs[a].names == NameRules((FqdnRule("b.test", ANY, 0, 0),))
    assert not res.diffs[a].added and not res.diffs[a].removed
    # applying every diff gives what a full computation gives
    held: dict[int, Any] = {}
    eng2 = PolicyEngine()
    for ident in eng.identities().values():
        if ident.id >= 256:
            for d in eng2.upsert_identity(ident).diffs.values():
                apply_diff(held, d)
    for d in eng2.upsert_policy_document(doc(CNP_A + "  egress:\n  - toFQDNs: [{matchName: b.test}]\n")).diffs.values():
        apply_diff(held, d)
    assert held[a].names == eng2.compute_all()[a].names
    res = eng.delete_policy(parse_policy(doc(CNP_A + "  egress: []\n")).key)
    assert res.diffs[a].names == NameRules()


# --- audit mode -----------------------------------------------------------------------------


def test_audited_names_are_marked_and_travel_with_the_enforced_ones(world: Any) -> None:
    eng, ids = world
    a = ids["x/a"]
    eng.upsert_policy_document(doc(CNP_A + "  egress:\n  - toFQDNs: [{matchName: a.test}]\n"))
    audited = parse_policy(
        doc(
            CNP_A.replace("name: p", "name: q")
            + f"  egress:\n  - toFQDNs: [{{matchName: b.test}}]\n  - {KUBE_DNS}\n{DNS_53}"
        )
    )
    found = overlays(eng, full_engine(eng, [audited]))
    assert found[a].names == NameRules(
        (FqdnRule("b.test", ANY, 0, 0, audit=True),),
        tuple(DnsRule(258, p, 53, ("*.example.test", "b.test"), audit=True) for p in (TCP, UDP)),
    )
    # an order whose enforced part did not change still carries the whole set when the audited part did
    diff = OrderDiff(a, False, True)
    order = with_audit([PlannedOrder("n", 1, 1, (diff,))], {}, found, lambda i: eng.policy_for(i).names)[0]
    names = order.diffs[0].names
    assert names is not None
    assert FqdnRule("a.test", ANY, 0, 0) in names.fqdn and FqdnRule("b.test", ANY, 0, 0, audit=True) in names.fqdn
    # nothing changed: nothing carried
    again = with_audit([PlannedOrder("n", 2, 2, (diff,))], found, found)[0]
    assert again.diffs[0].names is None


# --- the resolver's rules on names agree with the rule walker's (analyze, trace) ---------------

NAMES = ["a.test", "b.test", "x.a.test", "x.y.a.test", "c.test"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    docs=st.lists(documents, min_size=1, max_size=4),
    idents=st.dictionaries(st.sampled_from(IDS), pod_range_labels, min_size=1, max_size=4),
    probes=st.lists(st.sampled_from(PROBES), min_size=3, max_size=5, unique=True),
)
def test_fqdn_rules_agree_with_the_rule_walker(
    docs: list[dict[str, Any]], idents: dict[int, Any], probes: list[tuple[int, Any]]
) -> None:
    eng = PolicyEngine()
    for i, labels in idents.items():
        eng.upsert_identity(Identity(i, labels))
    for n, d in enumerate(docs):
        eng.upsert_policy_document(named(d, f"p{n}"))
    for i in idents:
        policy = eng.policy_for(i)
        if policy is None:
            continue  # not an endpoint (a CIDR identity): no policy of its own
        rules = eng.rules_for(i)
        for name in NAMES:
            for port, proto in probes:
                by_names = any(
                    matches(f.selector, name) and f.covers(protocol=proto, port=port) for f in policy.names.fqdn
                )
                walked = policy.egress_enforced and bool(fqdn_matches(rules, name, proto, port))
                assert by_names == walked, (i, name, port, proto, policy.names)
            resolvable = any(matches(s, name) for d in policy.names.dns for s in d.selectors)
            if resolvable:
                assert dns_decision(rules, name).allowed
