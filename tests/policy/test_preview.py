"""The preview of a policy change (pure): identity pairs agree with `analyze` before and after;
observed flows whose verdict changes are counted and named by policy."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from services.common.manifests import Document
from services.policy.engine.analyze import Model, Probe, build_model, connectivity
from services.policy.engine.model import Direction, IpProto, PolicyKind, PolicyRef
from services.policy.engine.parse import parse_policy
from services.policy.engine.preview import DiffProbe, FlowKey, ObservedFlow, Preview, preview, probes_of


def docs(bodies: list[dict[str, Any]]) -> list[Document]:
    return [Document(f"doc[{i}]", b) for i, b in enumerate(bodies)]


def ns(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {"team": name}}}


def pod(namespace: str, name: str, app: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": {"app": app}},
    }


def knp(
    name: str, app: str, ingress: list[dict[str, Any]] | None = None, egress: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    types = (["Ingress"] if ingress is not None else []) + (["Egress"] if egress is not None else [])
    spec: dict[str, Any] = {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": types}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": "shop", "name": name},
        "spec": spec,
    }


def from_app(app: str, *ports: int) -> dict[str, Any]:
    rule: dict[str, Any] = {"from": [{"podSelector": {"matchLabels": {"app": app}}}]}
    if ports:
        rule["ports"] = [{"port": p} for p in ports]
    return rule


def deny_cnp(name: str, app: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"namespace": "shop", "name": name},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": app}},
            "ingressDeny": [{"fromEndpoints": [{}], "toPorts": [{"ports": [{"port": str(port), "protocol": "TCP"}]}]}],
        },
    }


PODS = [
    ns("shop"),
    pod("shop", "web", "web"),
    pod("shop", "api", "api"),
    pod("shop", "db", "db"),
    pod("shop", "db2", "db"),
]
WEB_TO_DB = knp("db", "db", ingress=[from_app("web", 5432)])
API_TO_DB = knp("db", "db", ingress=[from_app("api", 5432)])
ALL_TO_DB = knp("db", "db", ingress=[{}])


def run_preview(
    before: list[dict[str, Any]],
    edits: list[dict[str, Any]],
    deletes: list[str],
    probes: list[DiffProbe],
    flows: tuple[ObservedFlow, ...] | list[ObservedFlow] = (),
) -> tuple[Model, Model, Preview]:
    """The live engine (``before``), a copy changed as the policy service's preview changes it, and
    the model of the same files after the change (for `analyze`)."""
    live = build_model(docs(PODS + before))
    after = copy.deepcopy(live.engine)
    changed = []
    for doc in edits:
        new = parse_policy(doc)
        old = live.engine.declared_policy(new.key)
        changed += [p for p in (old, new) if p is not None]
        after.upsert_policy(new)
    for name in deletes:
        ref = next(p.key for p in live.policies if p.key.name == name)
        gone = live.engine.declared_policy(ref)
        assert gone is not None
        changed.append(gone)
        after.delete_policy(ref)
    pods: dict[int, list[str]] = {}
    for key, pm in live.pods.items():
        pods.setdefault(pm.identity, []).append(key)
    result = preview(live.engine, after, changed, pods=pods, probes=probes, flows=flows)
    names = {(d["kind"], d["metadata"]["name"]) for d in edits}
    kept = [
        d for d in before if (d["kind"], d["metadata"]["name"]) not in names and d["metadata"]["name"] not in deletes
    ]
    return live, build_model(docs(PODS + kept + edits)), result


P5432 = DiffProbe(IpProto.TCP, 5432)
P80 = DiffProbe(IpProto.TCP, 80)


@pytest.mark.parametrize(
    ("before", "edits", "deletes"),
    [
        pytest.param([], [WEB_TO_DB], [], id="new default-deny on db"),
        pytest.param([WEB_TO_DB], [API_TO_DB], [], id="edit: another client"),
        pytest.param([WEB_TO_DB], [], ["db"], id="delete: open again"),
        pytest.param([WEB_TO_DB], [ALL_TO_DB], [], id="edit: widen"),
        pytest.param([ALL_TO_DB], [deny_cnp("no-pg", "db", 5432)], [], id="deny rule"),
        pytest.param([WEB_TO_DB], [knp("web-out", "web", egress=[])], [], id="egress default-deny"),
        pytest.param([WEB_TO_DB], [WEB_TO_DB], [], id="no change"),
    ],
)
@pytest.mark.parametrize("probe", [P5432, P80])
def test_pairs_equal_what_analyze_gives_before_and_after(
    before: list[dict[str, Any]], edits: list[dict[str, Any]], deletes: list[str], probe: DiffProbe
) -> None:
    live, model_after, result = run_preview(before, edits, deletes, [probe])
    p = Probe(probe.port, probe.protocol)
    was, will = connectivity(live, p), connectivity(model_after, p)
    expected = {
        (live.pods[s].identity, live.pods[d].identity, was[s][d], will[s][d])
        for s in was
        for d in was
        if was[s][d] != will[s][d]
    }
    got = {(c.source, c.destination, c.allowed_before, c.allowed_after) for c in result.pairs}
    assert got == expected
    assert all(c.probe == probe for c in result.pairs)


def test_a_change_is_grouped_by_the_policy_that_makes_it_and_ports_come_from_the_policies() -> None:
    live, _, result = run_preview([WEB_TO_DB], [API_TO_DB], [], [])
    ident = {k: v.identity for k, v in live.pods.items()}
    any_port = (DiffProbe(IpProto.TCP, 0), DiffProbe(IpProto.UDP, 0))
    assert result.probes == (*any_port[:1], P5432, *any_port[1:])  # the default deny reaches every port
    ref = PolicyRef(PolicyKind.NETWORK_POLICY, "shop", "db")
    assert {(c.source, c.destination, c.allowed_after, c.policies) for c in result.pairs} == {
        (ident["shop/web"], ident["shop/db"], False, (ref,)),
        (ident["shop/api"], ident["shop/db"], True, (ref,)),
    }
    # an every-port rule is probed on port 0 ("any port no rule names") of TCP and UDP
    assert probes_of([parse_policy(ALL_TO_DB)]) == any_port
    assert probes_of([parse_policy(knp("closed", "db", ingress=[]))]) == any_port


def test_observed_flows_that_would_be_cut_are_counted_and_untouched_ones_are_not() -> None:
    live = build_model(docs(PODS))
    ident = {k: v.identity for k, v in live.pods.items()}
    web, api, db = ident["shop/web"], ident["shop/api"], ident["shop/db"]
    flows = [
        ObservedFlow(FlowKey(db, web, Direction.INGRESS, 6, 5432), 7, "shop/web", "shop/db", "n1"),
        ObservedFlow(FlowKey(db, api, Direction.INGRESS, 6, 5432), 3, "shop/api", "shop/db", "n2"),
        ObservedFlow(FlowKey(web, db, Direction.EGRESS, 6, 5432), 5, "shop/web", "shop/db", "n1"),  # egress: untouched
        ObservedFlow(FlowKey(api, web, Direction.INGRESS, 6, 80), 4),  # another subject
        ObservedFlow(FlowKey(db, 1, Direction.INGRESS, 6, 9), 2),  # host traffic: always passes
    ]
    _, _, result = run_preview([], [WEB_TO_DB], [], [P5432], flows)
    assert [(c.flow.key.remote, c.flow.count, c.allowed_before, c.allowed_after) for c in result.flows] == [
        (api, 3, True, False)
    ]
    assert result.newly_dropped == 3 and result.flows_judged == 21
    assert result.flows[0].policies == (PolicyRef(PolicyKind.NETWORK_POLICY, "shop", "db"),)

    # a change that touches nothing observed reports nothing
    _, _, quiet = run_preview([], [knp("api-in", "api", ingress=[from_app("web", 80)])], [], [P80], flows[:3])
    assert quiet.flows == () and quiet.newly_dropped == 0
    # newly allowed flows are reported, never counted as drops
    dropped = [ObservedFlow(FlowKey(db, api, Direction.INGRESS, 6, 5432), 2)]
    _, _, opened = run_preview([WEB_TO_DB], [ALL_TO_DB], [], [P5432], dropped)
    assert [(c.allowed_before, c.allowed_after) for c in opened.flows] == [(False, True)]
    assert opened.newly_dropped == 0


def names_cnp(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"namespace": "shop", "name": "web-out"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "web"}},
            "egress": [
                {"toFQDNs": [{"matchName": name}], "toPorts": [{"ports": [{"port": "443", "protocol": "TCP"}]}]}
            ],
        },
    }


def test_a_change_of_names_is_a_note_naming_the_selectors() -> None:
    live, _, result = run_preview([names_cnp("a.example.test")], [names_cnp("b.example.test")], [], [])
    web = live.pods["shop/web"].identity
    assert result.notes == (
        f"identity {web} (shop/web): rules on names change (toFQDNs added: toFQDNs b.example.test TCP/443; "
        "toFQDNs removed: toFQDNs a.example.test TCP/443); connections to learned addresses are not previewed",
    )
    assert not result.pairs  # no pod's verdict changes
    _, _, unchanged = run_preview([names_cnp("a.example.test")], [names_cnp("a.example.test")], [], [])
    assert unchanged.notes == ()
