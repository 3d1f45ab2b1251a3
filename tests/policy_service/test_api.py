"""PolicyService over real gRPC: import, delete, get/list, trace, and clear errors for bad requests."""

from __future__ import annotations

import grpc
import pytest
import yaml

from palisade.v1 import common_pb2, policy_pb2
from testkit import builders
from testkit.policycluster import eventually, palisade
from testkit.scenario import CACHE, DB, WEB, Env

NP = "NetworkPolicy"


def ref(name: str, kind: str = NP, namespace: str = "default") -> common_pb2.ObjectRef:
    return common_pb2.ObjectRef(kind=kind, namespace=namespace, name=name)


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value


async def test_an_import_with_an_invalid_document_fails_whole_and_changes_nothing(env: Env) -> None:
    good = builders.netpol("web-in", {"app": "web"}, {"app": "db"}, 80)
    bad = builders.netpol("bad", {"app": "web"}, {"app": "db"}, 80)
    bad["spec"]["policyTypes"] = ["Sideways"]
    l7 = builders.cnp("l7", {"app": "db"}, {"app": "web"}, 80)
    l7["spec"]["ingress"][0]["toPorts"][0]["rules"] = {"http": [{"method": "GET"}]}
    typo = builders.cnp("typo", {"app": "db"}, {"app": "web"}, 80)
    typo["spec"]["ingress"][0]["fromEndpoint"] = typo["spec"]["ingress"][0].pop("fromEndpoints")
    before = (await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())).revision
    for dry_run in (True, False):
        err = await rpc_error(
            env.api.ImportPolicies(
                policy_pb2.ImportPoliciesRequest(
                    documents=yaml.safe_dump_all([good, bad, l7, typo]), origin="mixed.yaml", dry_run=dry_run
                )
            )
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.details() or ""
        assert "2 of 4 documents invalid" in details
        assert "mixed.yaml[1]" in details and "NetworkPolicy default/bad: spec.policyTypes[0]" in details
        assert "CiliumNetworkPolicy default/typo: spec.ingress[0].fromEndpoint: unknown field" in details
        assert "did you mean 'fromEndpoints'" in details
        # Nothing was imported, not even the valid documents; the revision did not move.
        listed = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())
        assert [p.ref.name for p in listed.policies] == ["db-from-web"]
        assert listed.revision == before

    answer = await env.api.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump_all([good, l7]), origin="mixed.yaml")
    )
    assert answer.revision > before
    states = {p.ref.name: p for p in answer.policies}
    assert states["web-in"].state != policy_pb2.POLICY_STATE_REJECTED
    assert states["web-in"].source == policy_pb2.POLICY_SOURCE_API
    assert any("rules" in u for u in states["l7"].unsupported)
    listed = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest(namespace="default"))
    assert {(p.ref.name, p.source) for p in listed.policies} == {
        ("db-from-web", policy_pb2.POLICY_SOURCE_KUBERNETES),
        ("web-in", policy_pb2.POLICY_SOURCE_API),
        ("l7", policy_pb2.POLICY_SOURCE_API),
    }
    assert (await env.api.ListPolicies(policy_pb2.ListPoliciesRequest(namespace="other"))).policies == []

    # A typo in a new version of an imported policy: refused, the imported version stays.
    edited = builders.netpol("web-in", {"app": "web"}, {"app": "db"}, 8080)
    edited["spec"]["ingress"][0]["ports"][0]["prot"] = "TCP"
    err = await rpc_error(env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(edited))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.ingress[0].ports[0].prot: unknown field; did you mean 'port'?" in (err.details() or "")
    kept = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref("web-in"), source=policy_pb2.POLICY_SOURCE_API))
    assert "port: 80" in kept.document and not kept.error

    # Dry run validates without changing anything; its revision is the one the import would make.
    dry = await env.api.ImportPolicies(
        policy_pb2.ImportPoliciesRequest(
            documents=yaml.safe_dump(builders.netpol("dry", {"app": "db"}, {}, 1)), dry_run=True
        )
    )
    assert dry.revision == answer.revision + 1 and dry.policies[0].state == policy_pb2.POLICY_STATE_UNSPECIFIED
    assert (await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())).revision == answer.revision
    assert (await rpc_error(env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref("dry"))))).code() == (
        grpc.StatusCode.NOT_FOUND
    )

    # Delete the API copy; it is gone from the datapaths too.
    deleted = await env.api.DeletePolicy(policy_pb2.DeletePolicyRequest(ref=ref("web-in")))
    assert deleted.revision > answer.revision
    await env.settled(deleted.revision)
    assert env.datapaths["n1"].state.policies[WEB][1] == {}
    err = await rpc_error(env.api.DeletePolicy(policy_pb2.DeletePolicyRequest(ref=ref("web-in"))))
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_trace_explains_verdicts_between_pods_and_labels(env: Env) -> None:
    request = policy_pb2.TraceRequest(
        source=policy_pb2.TracePeer(pod="default/web-1"),
        destination=policy_pb2.TracePeer(pod="default/db-1"),
        port=5432,
        protocol=common_pb2.PROTOCOL_TCP,
    )
    allowed = await env.api.Trace(request)
    assert allowed.verdict == common_pb2.VERDICT_ALLOW
    assert (allowed.source_identity, allowed.destination_identity) == (WEB, DB)
    assert allowed.ingress_enforced and not allowed.egress_enforced
    assert [(m.policy.name, m.direction) for m in allowed.matches] == [("db-from-web", common_pb2.DIRECTION_INGRESS)]
    assert "ALLOWED" in allowed.explanation

    request.port = 22
    denied = await env.api.Trace(request)
    assert denied.verdict == common_pb2.VERDICT_DENY and denied.ingress_verdict == common_pb2.VERDICT_DENY

    by_labels = await env.api.Trace(
        policy_pb2.TraceRequest(
            source=policy_pb2.TracePeer(labels=["k8s:app=cache", "k8s:io.kubernetes.pod.namespace=default"]),
            destination=policy_pb2.TracePeer(pod="default/db-1"),
            port=5432,
        )
    )
    assert by_labels.verdict == common_pb2.VERDICT_DENY


@pytest.mark.parametrize(("port", "verdict", "code"), [(5432, "ALLOWED", 0), (22, "DENIED", 1)])
async def test_trace_prints_its_final_verdict_once(env: Env, port: int, verdict: str, code: int) -> None:
    address = f"--policy-address={env.policy.address}"
    traced = await palisade(
        "policy", "trace", "--src", "default/web-1", "--dst", "default/db-1", "--port", str(port), address
    )
    assert traced.returncode == code, traced.stderr
    finals = [line for line in traced.stdout.splitlines() if "verdict" in line.lower() and "final" in line.lower()]
    assert finals == [f"Final verdict: {verdict}"], traced.stdout


# (method, request, status code, part of the message)
BAD_REQUESTS: list[tuple[str, object, str, str]] = [
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=""), "INVALID_ARGUMENT", "documents is empty"),
    (
        "ImportPolicies",
        policy_pb2.ImportPoliciesRequest(documents="kind: [unclosed", origin="x.yaml"),
        "INVALID_ARGUMENT",
        "x.yaml: not valid YAML or JSON at line",
    ),
    (
        "ImportPolicies",
        policy_pb2.ImportPoliciesRequest(documents="- 1\n- 2"),
        "INVALID_ARGUMENT",
        "expected an object",
    ),
    ("GetPolicy", policy_pb2.GetPolicyRequest(ref=ref("x", kind="")), "INVALID_ARGUMENT", "ref.kind is required"),
    ("GetPolicy", policy_pb2.GetPolicyRequest(ref=ref("x", kind="Pod")), "INVALID_ARGUMENT", "not a policy kind"),
    ("GetPolicy", policy_pb2.GetPolicyRequest(ref=ref("")), "INVALID_ARGUMENT", "ref.name is required"),
    ("GetPolicy", policy_pb2.GetPolicyRequest(ref=ref("nope")), "NOT_FOUND", "no policy NetworkPolicy default/nope"),
    (
        "GetPolicy",
        policy_pb2.GetPolicyRequest(ref=ref("x", kind="CiliumClusterwideNetworkPolicy", namespace="ns")),
        "INVALID_ARGUMENT",
        "cluster-scoped",
    ),
    (
        "DeletePolicy",
        policy_pb2.DeletePolicyRequest(ref=ref("db-from-web"), source=policy_pb2.POLICY_SOURCE_KUBERNETES),
        "FAILED_PRECONDITION",
        "delete it there",
    ),
    ("Resync", policy_pb2.ResyncRequest(), "INVALID_ARGUMENT", "node is required"),
    ("WaitForRevision", policy_pb2.WaitForRevisionRequest(), "INVALID_ARGUMENT", "revision is required"),
    (
        "WaitForRevision",
        policy_pb2.WaitForRevisionRequest(revision=1 << 40),
        "INVALID_ARGUMENT",
        "has not been handed out yet",
    ),
    (
        "ReportRealized",
        policy_pb2.ReportRealizedRequest(reports=[policy_pb2.RealizedReport(node="n1", identity=WEB, revision=1)]),
        "INVALID_ARGUMENT",
        "reports[0]: endpoint_id or pod is required",
    ),
    (
        "ReportRealized",
        policy_pb2.ReportRealizedRequest(
            reports=[policy_pb2.RealizedReport(node="n1", endpoint_id=1, identity=WEB, revision=1 << 40)]
        ),
        "INVALID_ARGUMENT",
        "above the current revision",
    ),
    (
        "Trace",
        policy_pb2.TraceRequest(source=policy_pb2.TracePeer(pod="default/ghost"), port=80),
        "NOT_FOUND",
        "source.pod default/ghost is not in the ipcache",
    ),
    (
        "Trace",
        policy_pb2.TraceRequest(
            source=policy_pb2.TracePeer(pod="default/web-1"), destination=policy_pb2.TracePeer(), port=80
        ),
        "INVALID_ARGUMENT",
        "destination needs a pod",
    ),
    ("Trace", policy_pb2.TraceRequest(port=0), "INVALID_ARGUMENT", "port 0 must be 1-65535"),
]


async def test_bad_requests_say_what_is_wrong(env: Env) -> None:
    # One service for every case: starting one per case would only slow the suite down.
    for method, request, code, says in BAD_REQUESTS:
        err = await rpc_error(getattr(env.api_for(method), method)(request, timeout=10))
        assert err.code() == getattr(grpc.StatusCode, code), (method, request, err.details())
        assert says in (err.details() or ""), (method, err.details())


async def test_status_reports_synced_revision_and_figures(env: Env) -> None:
    from palisade.v1 import common_pb2_grpc

    status = await common_pb2_grpc.StatusServiceStub(env.channel).GetStatus(common_pb2.GetStatusRequest())
    assert status.service == "policy" and status.synced
    current = (await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())).revision
    assert status.revision == current
    assert status.details["policies"] == "1"
    assert status.details["nodes"] == "3"
    assert int(status.details["identities"]) >= 3


def _doc(name: str = "ok", namespace: str = "default", peer: dict[str, str] | None = None) -> str:
    return yaml.safe_dump(builders.netpol(name, {"app": "web"}, peer or {"app": "db"}, 80, namespace=namespace))


MALFORMED: list[tuple[str, object, str]] = [
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents="[" * 5000 + "]" * 5000), "nested too deeply"),
    (
        "ImportPolicies",
        policy_pb2.ImportPoliciesRequest(documents="a:\n" + "".join(" " * i + "b:\n" for i in range(1, 5000))),
        "nested too deeply",
    ),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc("a" * 100_000)), "metadata.name"),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc("a.*.>")), "metadata.name"),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc("a b c")), "metadata.name"),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc(namespace="../../etc")), "metadata.namespace"),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc(namespace="Shop_NS!")), "metadata.namespace"),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc(peer={"a b": "x"})), "podSelector.matchLabels"),
    ("ImportPolicies", policy_pb2.ImportPoliciesRequest(documents=_doc(peer={"a\nb": "x"})), "podSelector.matchLabels"),
    (
        "ImportPolicies",
        policy_pb2.ImportPoliciesRequest(documents=_doc(peer={"a\x00b": "x"})),
        "podSelector.matchLabels",
    ),
    (
        "ImportPolicies",
        policy_pb2.ImportPoliciesRequest(documents=_doc(peer={"app": "x" * 1_000_000})),
        "matchLabels.value",
    ),
    ("GetPolicy", policy_pb2.GetPolicyRequest(ref=ref("a" * 100_000)), "ref.name"),
    ("Resync", policy_pb2.ResyncRequest(node="../x"), "node"),
    (
        "ReportRealized",
        policy_pb2.ReportRealizedRequest(
            reports=[policy_pb2.RealizedReport(node="n1", identity=WEB, revision=1, pod="Shop_NS!/web")]
        ),
        "reports[0].pod namespace",
    ),
    (
        "ReportRealized",
        policy_pb2.ReportRealizedRequest(
            reports=[policy_pb2.RealizedReport(node="n 1", identity=WEB, revision=1, endpoint_id=3)]
        ),
        "reports[0].node",
    ),
    # Names are checked once each (reports repeat them at every revision): a bad one after good
    # ones, and the same bad one again, are still refused, naming the report.
    *(
        (
            "ReportRealized",
            policy_pb2.ReportRealizedRequest(
                reports=[
                    policy_pb2.RealizedReport(node="n1", identity=WEB, revision=1, pod="default/web-1"),
                    policy_pb2.RealizedReport(node="n1", identity=WEB, revision=1, pod="Shop_NS!/web"),
                ]
            ),
            "reports[1].pod namespace",
        )
        for _ in range(2)
    ),
    (
        "ReportRealized",
        policy_pb2.ReportRealizedRequest(
            reports=[
                policy_pb2.RealizedReport(node="n1", identity=WEB, revision=1, endpoint_id=3),
                policy_pb2.RealizedReport(node="n 1", identity=WEB, revision=1, endpoint_id=3),
            ]
        ),
        "reports[1].node",
    ),
    ("DeletePolicy", policy_pb2.DeletePolicyRequest(ref=ref("x", namespace="../../etc")), "ref.namespace"),
    ("DeletePolicy", policy_pb2.DeletePolicyRequest(ref=ref("a.*.>")), "ref.name"),
    (
        "Trace",
        policy_pb2.TraceRequest(
            source=policy_pb2.TracePeer(pod="../../etc/x"),
            destination=policy_pb2.TracePeer(pod="default/db-1"),
            port=80,
        ),
        "source.pod namespace",
    ),
    (
        "Trace",
        policy_pb2.TraceRequest(
            source=policy_pb2.TracePeer(labels=["k8s:a b=c"]),
            destination=policy_pb2.TracePeer(pod="default/" + "x" * 10_000),
            port=80,
        ),
        "source.labels[0].key",
    ),
]


async def test_malformed_input_is_invalid_argument_naming_the_field(env: Env) -> None:
    for method, request, field in MALFORMED:
        err = await rpc_error(getattr(env.api_for(method), method)(request, timeout=30))
        details = err.details() or ""
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field, err.code(), details[:300])
        assert field in details, (method, field, details[:300])
        assert len(details) < 3000, (method, field, len(details))
    # Nothing was imported.
    listing = await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())
    assert [p.ref.name for p in listing.policies] == ["db-from-web"]


async def test_an_ip_block_without_a_prefix_length_is_rejected(env: Env) -> None:
    doc = builders.netpol("to-host", {"app": "web"}, {"app": "db"}, 80)
    doc["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "10.0.0.1"}}]
    err = await rpc_error(
        env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(doc)), timeout=10)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ipBlock.cidr" in (err.details() or "") and "prefix length" in (err.details() or "")
    doc["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.2.3"]}}]
    err = await rpc_error(
        env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(doc)), timeout=10)
    )
    assert "ipBlock.except[0]" in (err.details() or "")
    doc["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    answer = await env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(doc)), timeout=10)
    assert answer.policies[0].state != policy_pb2.POLICY_STATE_REJECTED, answer.policies[0].error


async def test_diff_previews_a_change_against_live_identities_and_observed_flows_without_applying_it(
    env: Env,
) -> None:
    before = (await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())).revision
    # The Kubernetes policy db-from-web edited to let cache in instead of web.
    edit = yaml.safe_dump(builders.netpol("db-from-web", {"app": "db"}, {"app": "cache"}, 5432))
    web_to_db = policy_pb2.ObservedFlow(
        source_identity=WEB,
        destination_identity=DB,
        direction=common_pb2.DIRECTION_INGRESS,
        protocol=common_pb2.PROTOCOL_TCP,
        port=5432,
        count=4,
        source_pod="default/web-1",
        destination_pod="default/db-1",
        node="n2",
    )
    web_to_db_egress = policy_pb2.ObservedFlow()
    web_to_db_egress.CopyFrom(web_to_db)
    web_to_db_egress.direction = common_pb2.DIRECTION_EGRESS
    web_to_db_egress.count = 5
    answer = await env.api.Diff(
        policy_pb2.DiffRequest(documents=edit, origin="edit.yaml", flows=[web_to_db, web_to_db_egress])
    )
    assert answer.revision == before
    changes = {
        (c.source_identity, c.destination_identity, c.probe.port, c.before, c.after, tuple(p.name for p in c.policies))
        for c in answer.pairs
    }
    assert changes == {
        (WEB, DB, 5432, common_pb2.VERDICT_ALLOW, common_pb2.VERDICT_DENY, ("db-from-web",)),
        (CACHE, DB, 5432, common_pb2.VERDICT_DENY, common_pb2.VERDICT_ALLOW, ("db-from-web",)),
    }
    web_pair = next(c for c in answer.pairs if c.source_identity == WEB)
    assert list(web_pair.source_pods) == ["default/web-1", "default/web-2"]
    assert list(web_pair.destination_pods) == ["default/db-1"]
    assert [(f.flow.count, f.flow.node, f.after) for f in answer.flows] == [(4, "n2", common_pb2.VERDICT_DENY)]
    assert answer.newly_dropped == 4 and answer.flows_judged == 9

    # Nothing was applied: same revision, web still reaches db.
    assert (await env.api.ListPolicies(policy_pb2.ListPoliciesRequest())).revision == before
    trace = policy_pb2.TraceRequest(
        source=policy_pb2.TracePeer(pod="default/web-1"),
        destination=policy_pb2.TracePeer(pod="default/db-1"),
        port=5432,
        protocol=common_pb2.PROTOCOL_TCP,
    )
    assert (await env.api.Trace(trace)).verdict == common_pb2.VERDICT_ALLOW

    # Deleting it opens db to every peer: newly allowed pairs, nothing observed newly dropped.
    opened = await env.api.Diff(policy_pb2.DiffRequest(deletes=[ref("db-from-web")], flows=[web_to_db]))
    assert opened.newly_dropped == 0 and not opened.flows
    # (port 0 stands for every port no rule names: the default deny is gone there too)
    assert {(c.source_identity, c.probe.port, c.after) for c in opened.pairs} == {
        (CACHE, 5432, common_pb2.VERDICT_ALLOW),
        (CACHE, 0, common_pb2.VERDICT_ALLOW),
        (WEB, 0, common_pb2.VERDICT_ALLOW),
    }

    # A change that touches nothing observed reports nothing.
    quiet = yaml.safe_dump(builders.netpol("cache-in", {"app": "cache"}, {"app": "web"}, 6379))
    untouched = await env.api.Diff(policy_pb2.DiffRequest(documents=quiet, flows=[web_to_db]))
    assert not untouched.flows and untouched.newly_dropped == 0
    assert {(c.source_identity, c.destination_identity, c.probe.port, c.after) for c in untouched.pairs} == {
        (DB, CACHE, 6379, common_pb2.VERDICT_DENY),
        (DB, CACHE, 0, common_pb2.VERDICT_DENY),
        (WEB, CACHE, 0, common_pb2.VERDICT_DENY),
    }

    # Bad input names what is wrong.
    err = await rpc_error(env.api.Diff(policy_pb2.DiffRequest(deletes=[ref("nope")])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in (err.details() or "")
    err = await rpc_error(env.api.Diff(policy_pb2.DiffRequest()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nothing to preview" in (err.details() or "")


async def test_a_policy_in_audit_mode_is_shown_never_enforced_and_enforced_by_an_edit(env: Env) -> None:
    closed = builders.netpol("web-closed", {"app": "web"}, {"app": "cache"}, 80)
    closed["metadata"]["annotations"] = {"policy.palisade.io/mode": "audit"}
    before = max(dp.state.revision for dp in env.datapaths.values())
    answer = await env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(closed)))
    # An import of an audited policy is a change like any other: a revision to wait for.
    assert answer.revision > before
    await env.settled(answer.revision)
    status = await env.api.GetPolicy(
        policy_pb2.GetPolicyRequest(ref=ref("web-closed"), source=policy_pb2.POLICY_SOURCE_API)
    )
    assert status.mode == "audit" and not status.error
    assert list(status.subjects) == [WEB]
    # Web stays open (nothing enforced), and its nodes hold the audited allow: cache -> web:80.
    audited = {(common_pb2.DIRECTION_INGRESS, CACHE, 6, 80, 80): common_pb2.VERDICT_AUDIT_ALLOW}
    assert env.datapaths["n1"].state.policies[WEB] == ((False, False), audited)
    assert env.datapaths["n3"].state.policies[WEB] == ((False, False), audited)
    resync = await env.api_for("Resync").Resync(policy_pb2.ResyncRequest(node="n1"))
    (web,) = [p for p in resync.policies if p.identity == WEB]
    assert web.enforcement.audit_ingress and not web.enforcement.ingress
    assert await env.all_match_resync()

    # Preview enforcing it: db -> web would be cut (observed 2 times), cache -> web stays allowed.
    enforced = yaml.safe_dump({**closed, "metadata": {"name": "web-closed", "namespace": "default"}})
    db_to_web = policy_pb2.ObservedFlow(
        source_identity=DB, destination_identity=WEB, direction=common_pb2.DIRECTION_INGRESS,
        protocol=common_pb2.PROTOCOL_TCP, port=80, count=2,
    )  # fmt: skip
    preview = await env.api.Diff(policy_pb2.DiffRequest(documents=enforced, flows=[db_to_web]))
    assert preview.newly_dropped == 2
    assert [p.name for p in preview.flows[0].policies] == ["web-closed"]

    # Switching to enforce is an edit like any other: a new revision, realized on web's nodes.
    switched = await env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=enforced))
    assert switched.revision > answer.revision
    await env.settled(switched.revision)
    allow_cache = {(common_pb2.DIRECTION_INGRESS, CACHE, 6, 80, 80): common_pb2.VERDICT_ALLOW}
    assert env.datapaths["n1"].state.policies[WEB] == ((True, False), allow_cache)  # the audited allow is gone
    status = await env.api.GetPolicy(
        policy_pb2.GetPolicyRequest(ref=ref("web-closed"), source=policy_pb2.POLICY_SOURCE_API)
    )
    assert status.mode == "enforce"
    # ... and back to audit: web is open again.
    back = await env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(closed)))
    await env.settled(back.revision)
    assert env.datapaths["n1"].state.policies[WEB] == ((False, False), audited)
    assert await env.all_match_resync()
    # Deleting the audited policy is a new revision too, after which web holds nothing of it.
    gone = await env.api.DeletePolicy(policy_pb2.DeletePolicyRequest(ref=ref("web-closed")))
    assert gone.revision > back.revision
    await env.settled(gone.revision)
    assert env.datapaths["n1"].state.policies.get(WEB, ((False, False), {})) == ((False, False), {})

    # A mistyped mode names the annotation.
    closed["metadata"]["annotations"] = {"policy.palisade.io/mode": "audti"}
    err = await rpc_error(env.api.ImportPolicies(policy_pb2.ImportPoliciesRequest(documents=yaml.safe_dump(closed))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "metadata.annotations[policy.palisade.io/mode]: 'audti' is not a mode; use enforce or audit" in (
        err.details() or ""
    )


async def test_a_namespace_in_audit_mode_puts_its_policies_in_audit(env: Env) -> None:
    """The Kubernetes policy db-from-web (namespace default) closes db to all but web."""
    audit_ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default", "annotations": {}}}
    audit_ns["metadata"]["annotations"] = {"policy.palisade.io/mode": "audit"}  # type: ignore[index]
    before = env.datapaths["n2"].state.revision
    await env.feed.policy(audit_ns)
    await eventually(lambda: env.datapaths["n2"].state.revision > before, "the namespace's change realized")
    status = await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref("db-from-web")))
    assert status.mode == "audit" and list(status.subjects) == [DB]
    # db is no longer enforced; what the policy allows is an audited allow, the rest audited default deny
    audited = {(common_pb2.DIRECTION_INGRESS, WEB, 6, 5432, 5432): common_pb2.VERDICT_AUDIT_ALLOW}
    await eventually(lambda: env.datapaths["n2"].state.policies.get(DB) == ((False, False), audited), "db audited")

    # The annotation removed: enforced again.
    audit_ns["metadata"]["annotations"] = {}  # type: ignore[index]
    await env.feed.policy(audit_ns)
    enforced = {(common_pb2.DIRECTION_INGRESS, WEB, 6, 5432, 5432): common_pb2.VERDICT_ALLOW}
    await eventually(lambda: env.datapaths["n2"].state.policies.get(DB) == ((True, False), enforced), "db enforced")
    assert (await env.api.GetPolicy(policy_pb2.GetPolicyRequest(ref=ref("db-from-web")))).mode == "enforce"
