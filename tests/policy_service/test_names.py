"""Rules on names over the real bus and API: orders carry an identity's toFQDNs and DNS rules whole
when they change (names_changed), Resync returns the same, audited ones are marked."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import yaml

from palisade.v1 import common_pb2, policy_pb2
from testkit.policycluster import eventually, palisade
from testkit.scenario import CACHE, DB, WEB, Env, next_orders

UDP, TCP, ANY = common_pb2.PROTOCOL_UDP, common_pb2.PROTOCOL_TCP, common_pb2.PROTOCOL_ANY
ALLOW, AUDIT_ALLOW = common_pb2.VERDICT_ALLOW, common_pb2.VERDICT_AUDIT_ALLOW


def web_names(name: str = "web-names", pattern: str = "*.example.test", mode: str | None = None) -> dict[str, Any]:
    """web may resolve ``pattern`` through db (standing in for the DNS server) and reach those names on 443."""
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if mode is not None:
        meta["annotations"] = {"policy.palisade.io/mode": mode}
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": meta,
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "web"}},
            "egress": [
                {
                    "toEndpoints": [{"matchLabels": {"app": "db"}}],
                    "toPorts": [
                        {"ports": [{"port": "53", "protocol": "ANY"}], "rules": {"dns": [{"matchPattern": pattern}]}}
                    ],
                },
                {"toFQDNs": [{"matchPattern": pattern}], "toPorts": [{"ports": [{"port": "443", "protocol": "TCP"}]}]},
            ],
        },
    }


def expected(pattern: str, verdict: int = ALLOW) -> tuple[Any, Any]:
    return (
        ((pattern, TCP, 443, 443, verdict),),
        tuple((DB, proto, 53, (pattern,), verdict) for proto in (TCP, UDP)),
    )


async def test_orders_and_resync_carry_rules_on_names(env: Env) -> None:
    before = {n: env.log.last_sequence(n) for n in env.datapaths}
    await env.feed.policy(web_names())
    orders = await next_orders(env, before, "orders for web-names")
    # web lives on n1 and n3: their orders carry web's whole set of rules on names
    for node in ("n1", "n3"):
        (diff,) = [d for d in orders[node].diffs if d.identity == WEB]
        assert diff.names_changed and not diff.full
        assert [(r.selector, r.protocol, r.port_low, r.verdict) for r in diff.fqdn_rules] == [
            ("*.example.test", TCP, 443, ALLOW)
        ]
        assert [(r.remote_identity, r.protocol, r.port, list(r.selectors)) for r in diff.dns_rules] == [
            (DB, TCP, 53, ["*.example.test"]),
            (DB, UDP, 53, ["*.example.test"]),
        ]
        # the DNS traffic itself is an ordinary allow entry
        assert {(e.key.remote_identity, e.key.protocol, e.key.port_low) for e in diff.add} >= {(DB, UDP, 53)}
    await env.settled(orders["n1"].revision)
    for node in ("n1", "n3"):
        assert env.datapaths[node].state.names == {WEB: expected("*.example.test")}
    assert env.datapaths["n2"].state.names == {}
    assert await env.all_match_resync()

    # a change of the names only: the new set replaces the old one, entries untouched
    before = {n: env.log.last_sequence(n) for n in env.datapaths}
    await env.feed.policy(web_names(pattern="**.example.test"))
    orders = await next_orders(env, before, "orders for the new pattern")
    (diff,) = [d for d in orders["n1"].diffs if d.identity == WEB]
    assert diff.names_changed and not diff.add and not diff.remove
    await env.settled(orders["n1"].revision)
    assert env.datapaths["n1"].state.names == {WEB: expected("**.example.test")}

    # a new DNS server identity: the DNS rules follow it
    before = {n: env.log.last_sequence(n) for n in env.datapaths}
    await env.feed.identity(CACHE + 1, app="db")
    orders = await next_orders(env, before, "orders for a second db identity")
    await env.settled(orders["n1"].revision)
    servers = {r[0] for r in env.datapaths["n1"].state.names[WEB][1]}
    assert servers == {DB, CACHE + 1}

    # the policy goes: an order empties the set
    await env.feed.policy(web_names(pattern="**.example.test"), delete=True)
    await eventually(lambda: env.datapaths["n1"].state.names == {}, "web's rules on names removed on n1")
    assert await env.all_match_resync()


async def test_audited_rules_on_names_are_marked(env: Env) -> None:
    before = {n: env.log.last_sequence(n) for n in ("n1", "n3")}  # web's nodes
    await env.feed.policy(web_names("audited", mode="audit"))
    orders = await next_orders(env, before, "orders for the audited policy")
    await eventually(lambda: env.datapaths["n1"].state.revision >= orders["n1"].revision, "n1 applied it")
    assert env.datapaths["n1"].state.names == {WEB: expected("*.example.test", AUDIT_ALLOW)}
    assert await env.all_match_resync()
    # enforced beside it: both travel, each with its verdict
    before = {n: env.log.last_sequence(n) for n in ("n1", "n3")}  # web's nodes
    await env.feed.policy(web_names("enforced", pattern="a.test"))
    orders = await next_orders(env, before, "orders for the enforced policy")
    await eventually(lambda: env.datapaths["n1"].state.revision >= orders["n1"].revision, "n1 applied it")
    fqdn, dns = env.datapaths["n1"].state.names[WEB]
    assert fqdn == (("*.example.test", TCP, 443, 443, AUDIT_ALLOW), ("a.test", TCP, 443, 443, ALLOW))
    # the audited DNS rule is the server's rule as it would be with the audited policy enforced too
    assert {(r[1], r[3], r[4]) for r in dns} == {
        (p, sel, v)
        for p in (TCP, UDP)
        for sel, v in ((("a.test",), ALLOW), (("*.example.test", "a.test"), AUDIT_ALLOW))
    }
    assert await env.all_match_resync()


async def test_trace_judges_names_and_dns_queries(env: Env) -> None:
    answer = await env.api.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(web_names()), origin="names.yaml"), timeout=10
    )
    await env.settled(answer.revision)
    address = f"--policy-address={env.policy.address}"
    src = ("policy", "trace", "--src", "default/web-1")

    allowed = await palisade(*src, "--dns-query", "API.example.test.", address)
    assert allowed.returncode == 0, allowed.stderr
    assert "DNS query api.example.test: ALLOWED" in allowed.stdout
    assert "CiliumNetworkPolicy default/web-names (api): spec.egress[0] (*.example.test)" in allowed.stdout
    refused = await palisade(*src, "--dns-query", "example.test", address)
    assert refused.returncode == 1
    assert "REFUSED" in refused.stdout and "spec.egress[0] (*.example.test)" in refused.stdout
    unfiltered = await palisade("policy", "trace", "--src", "default/db-1", "--dns-query", "a.test", address)
    assert unfiltered.returncode == 0 and "FORWARDED (no DNS rule selects this pod" in unfiltered.stdout

    by_name = await palisade(*src, "--to-fqdn", "api.example.test=192.0.2.10", "--port", "443", address)
    assert by_name.returncode == 0, by_name.stdout + by_name.stderr
    assert "toFQDNs: ALLOWED (allowed by toFQDNs)" in by_name.stdout
    assert "matched: CiliumNetworkPolicy default/web-names (api): spec.egress[1] (*.example.test)" in by_name.stdout
    assert by_name.stdout.rstrip().endswith("Final verdict: ALLOWED")
    for args in (("api.example.test=192.0.2.10", "80"), ("a.b.example.test=192.0.2.10", "443")):
        denied = await palisade(*src, "--to-fqdn", args[0], "--port", args[1], address)
        assert denied.returncode == 1 and "Final verdict: DENIED" in denied.stdout, denied.stdout

    response = await env.api.Trace(
        policy_pb2.TraceRequest(
            source=policy_pb2.TracePeer(pod="default/web-1"), fqdn="api.example.test", address="192.0.2.10", port=443
        )
    )
    assert response.verdict == ALLOW and response.egress_verdict == ALLOW
    assert [(m.policy.name, m.rule_path) for m in response.matches] == [("web-names", "spec.egress[1]")]
    for bad, message in (
        (
            policy_pb2.TraceRequest(source=policy_pb2.TracePeer(pod="default/web-1"), fqdn="a.test", port=1),
            "go together",
        ),
        (
            policy_pb2.TraceRequest(
                source=policy_pb2.TracePeer(pod="default/web-1"), fqdn="a..test", address="192.0.2.1", port=1
            ),
            "fqdn: name 'a..test' has an empty label",
        ),
        (policy_pb2.TraceRequest(source=policy_pb2.TracePeer(pod="default/web-1"), dns_query="a b"), "dns_query:"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await env.api.Trace(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in str(err.value.details())
