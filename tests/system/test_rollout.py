"""Safe rollout on a 3-node dev cluster: `palisade observe` across every node with each filter, and
`palisade policy diff` against the flows the nodes' rings recorded (real packets throughout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf.timestamp_pb2 import Timestamp

from testkit.harness import ROOT
from testkit.stack import Stack, analyze, running_stack

pytestmark = [pytest.mark.root, pytest.mark.bcc]

SUBNET = "172.31.253.0/24"
#: backend-api without its frontend rule: frontend -> backend:8080 would be cut.
BACKEND_WITHOUT_FRONTEND = {
    "apiVersion": "cilium.io/v2",
    "kind": "CiliumNetworkPolicy",
    "metadata": {"name": "backend-api", "namespace": "shop"},
    "spec": {
        "endpointSelector": {"matchLabels": {"app": "backend"}},
        "ingress": [{"fromEndpoints": [{}], "toPorts": [{"ports": [{"port": "9125", "protocol": "UDP"}]}]}],
    },
}
#: A default-deny for the debug pod, which nobody talked to.
DEBUG_CLOSED = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "debug-closed", "namespace": "tools"},
    "spec": {"podSelector": {"matchLabels": {"app": "debug"}}, "policyTypes": ["Ingress"]},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("rollout"), ROOT / "examples", "--nodes", "3", "--node-subnet", SUBNET
    ) as s:
        yield s


@pytest.fixture(scope="module")
def endpoints(stack: Stack) -> dict[str, dict[str, Any]]:
    eps = stack.endpoints()
    assert len({e["node"] for e in eps.values()}) >= 2
    return eps


@pytest.fixture(scope="module")
def traffic(stack: Stack, endpoints: dict[str, dict[str, Any]]) -> None:
    """Flows no client watched: they are in the rings."""
    assert stack.reach("shop/frontend", "shop/backend", 8080)
    assert stack.reach("shop/frontend", "shop/backend", 8080)
    assert not stack.reach("tools/debug", "shop/db", 5432)
    assert stack.reach("shop/frontend", "shop/backend", 9125, "UDP")


def observe(stack: Stack, *args: str) -> list[dict[str, Any]]:
    out = stack.palisade("observe", *args, "-o", "json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def nanos(rfc3339: str) -> int:
    ts = Timestamp()
    ts.FromJsonString(rfc3339)
    return ts.ToNanoseconds()


def test_observe_merges_every_nodes_ring_in_time_order(
    stack: Stack, endpoints: dict[str, dict[str, Any]], traffic: None
) -> None:
    flows = observe(stack, "--last", "200")
    assert len({f["node"] for f in flows}) >= 2
    # protobuf's JSON time drops trailing zeros ("...49.532Z"), so the strings do not sort as times
    times = [nanos(f["time"]) for f in flows]
    assert times == sorted(times)
    assert len(observe(stack, "--last", "3")) == 3
    assert observe(stack, "--last", "3") == flows[-3:]


@pytest.mark.parametrize(
    ("args", "check"),
    [
        (["--verdict", "dropped"], lambda f, ids: f["verdict"] == "VERDICT_DENY"),
        (["--verdict", "forwarded"], lambda f, ids: f["verdict"] == "VERDICT_ALLOW"),
        (["--namespace", "tools"], lambda f, ids: "tools/" in f.get("source_pod", "") + f.get("destination_pod", "")),
        (["--pod", "shop/db"], lambda f, ids: "shop/db" in (f.get("source_pod"), f.get("destination_pod"))),
        (["--from-pod", "tools/debug"], lambda f, ids: f.get("source_pod") == "tools/debug"),
        (["--to-pod", "shop/backend"], lambda f, ids: f.get("destination_pod") == "shop/backend"),
        (["--port", "5432"], lambda f, ids: 5432 in (f.get("destination_port"), f.get("source_port"))),
        (["--protocol", "udp"], lambda f, ids: f["protocol"] == "PROTOCOL_UDP"),
        (["--from-identity", "@tools/debug"], lambda f, ids: f["source_identity"] == ids["tools/debug"]),
        (["--to-identity", "@shop/db"], lambda f, ids: f["destination_identity"] == ids["shop/db"]),
        (["--node", "@shop/backend"], lambda f, ids: f["node"] == ids["node:shop/backend"]),
        (["--since", "1h"], lambda f, ids: True),
    ],
)
def test_observe_filters_across_the_cluster(
    stack: Stack, endpoints: dict[str, dict[str, Any]], traffic: None, args: list[str], check: Any
) -> None:
    ids: dict[str, Any] = {k: e["identity"] for k, e in endpoints.items()}
    ids.update({f"node:{k}": e["node"] for k, e in endpoints.items()})
    flag, value = args
    if value.startswith("@"):
        pod = value[1:]
        value = str(ids["node:" + pod] if flag == "--node" else ids[pod])
    everything = observe(stack, "--last", "500")
    got = observe(stack, "--last", "500", flag, value)
    assert got, f"{flag} {value} matched nothing"
    assert all(check(f, ids) for f in got), got
    # the filter leaves out nothing that matches (flows recorded since may come on top)
    assert {json.dumps(f, sort_keys=True) for f in everything if check(f, ids)} <= {
        json.dumps(f, sort_keys=True) for f in got
    }


def test_observe_follow_prints_history_then_live_flows(stack: Stack, traffic: None) -> None:
    cmd = [sys.executable, "-m", "services.cli.main", "observe", "--last", "1", "--follow", "--limit", "3"]
    cmd += ["--to-pod", "shop/backend", "-o", "json", *stack.flags("observe")]
    env = {**os.environ, "PALISADE_TLS_DIR": str(stack.tls_dir)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # the history: printed before any new flow
        assert first["destination_pod"] == "shop/backend"
        assert stack.reach("shop/frontend", "shop/backend", 8080)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    live = [json.loads(line) for line in out.splitlines()]
    assert len(live) == 2 and all(f["destination_pod"] == "shop/backend" for f in live)
    assert all(f["time"] > first["time"] for f in live)


def _diff(stack: Stack, tmp: Path, *docs: dict[str, Any], extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    path = tmp / "change.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out = stack.palisade("policy", "diff", "-f", str(path), *extra, "-o", "json")
    assert out.returncode in (0, 3), out.stderr
    return out.returncode, json.loads(out.stdout)


def test_diff_reports_an_observed_flow_the_change_would_cut_with_its_count(
    stack: Stack, endpoints: dict[str, dict[str, Any]], traffic: None, tmp_path: Path
) -> None:
    code, answer = _diff(stack, tmp_path, BACKEND_WITHOUT_FRONTEND)
    assert code == 3
    cut = [f for f in answer["flows"] if f["after"] == "VERDICT_DENY"]
    assert {(f["flow"]["source_pod"], f["flow"]["destination_pod"], f["flow"]["port"]) for f in cut} == {
        ("shop/frontend", "shop/backend", 8080)
    }
    assert int(cut[0]["flow"]["count"]) >= 2 and int(answer["newly_dropped"]) == int(cut[0]["flow"]["count"])
    assert [p["name"] for p in cut[0]["policies"]] == ["backend-api"]
    text = stack.palisade("policy", "diff", "-f", str(tmp_path / "change.yaml"))
    assert (
        text.returncode == 3
        and "newly DROPPED" in text.stdout
        and "CiliumNetworkPolicy shop/backend-api" in text.stdout
    )
    # nothing was applied
    assert stack.reach("shop/frontend", "shop/backend", 8080)


def test_diff_of_a_change_that_touches_nothing_observed_reports_nothing(
    stack: Stack, traffic: None, tmp_path: Path
) -> None:
    code, answer = _diff(stack, tmp_path, DEBUG_CLOSED)
    assert code == 0
    assert not answer.get("flows") and int(answer.get("newly_dropped", 0)) == 0
    assert answer["pairs"]  # the identity pairs it changes are still shown


def _analyze(folder: Path) -> dict[str, dict[str, bool]]:
    return dict(analyze("-f", str(folder), "--probe", "8080/TCP")["probes"][0]["matrix"])


def test_diff_identity_pairs_equal_what_analyze_gives_before_and_after(
    stack: Stack, endpoints: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    after_dir = tmp_path / "after"
    shutil.copytree(stack.manifests, after_dir)
    (after_dir / "40-backend.yaml").write_text(yaml.safe_dump(BACKEND_WITHOUT_FRONTEND))
    before, after = _analyze(stack.manifests), _analyze(after_dir)
    ident = {k: e["identity"] for k, e in endpoints.items()}
    expected = {
        (ident[s], ident[d], before[s][d], after[s][d])
        for s in before
        for d in before[s]
        if s != d and before[s][d] != after[s][d]
    }
    _, answer = _diff(stack, tmp_path, BACKEND_WITHOUT_FRONTEND, extra=("--probe", "8080/TCP", "--no-flows"))
    got = {
        (p["source_identity"], p["destination_identity"], p["before"] == "VERDICT_ALLOW", p["after"] == "VERDICT_ALLOW")
        for p in answer["pairs"]
    }
    assert expected and got == expected


def test_diff_bad_input_names_the_problem(stack: Stack, tmp_path: Path) -> None:
    out = stack.palisade("policy", "diff", "--delete", "cnp/shop/nope")
    assert out.returncode == 2 and "nope" in out.stderr
    bad = dict(BACKEND_WITHOUT_FRONTEND, spec={"endpointSelector": {}, "ingres": []})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    out = stack.palisade("policy", "diff", "-f", str(tmp_path / "bad.yaml"))
    assert out.returncode == 2 and "bad.yaml" in out.stderr and "ingres" in out.stderr


AUDIT = {"policy.palisade.io/mode": "audit"}
#: In audit: the debug pod would admit only the frontend, on 80.
DEBUG_AUDIT = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "debug-audit", "namespace": "tools", "annotations": AUDIT},
    "spec": {
        "podSelector": {"matchLabels": {"app": "debug"}},
        "ingress": [
            {
                "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "frontend"}}}],
                "ports": [{"port": 80}],
            }
        ],
    },
}
#: In audit: a deny of the frontend, on 80.
DEBUG_DENY_AUDIT = {
    "apiVersion": "cilium.io/v2",
    "kind": "CiliumNetworkPolicy",
    "metadata": {"name": "debug-deny-audit", "namespace": "tools", "annotations": AUDIT},
    "spec": {
        "endpointSelector": {"matchLabels": {"app": "debug"}},
        "enableDefaultDeny": {"ingress": False},
        "ingressDeny": [
            {
                "fromEndpoints": [{"matchLabels": {"app": "frontend", "k8s:io.kubernetes.pod.namespace": "shop"}}],
                "toPorts": [{"ports": [{"port": "80", "protocol": "TCP"}]}],
            }
        ],
    },
}
#: Enforced: a deny of the db (without default deny: everything else stays open).
DEBUG_NO_DB = {
    "apiVersion": "cilium.io/v2",
    "kind": "CiliumNetworkPolicy",
    "metadata": {"name": "debug-no-db", "namespace": "tools"},
    "spec": {
        "endpointSelector": {"matchLabels": {"app": "debug"}},
        "enableDefaultDeny": {"ingress": False},
        "ingressDeny": [{"fromEndpoints": [{"matchLabels": {"app": "db", "k8s:io.kubernetes.pod.namespace": "shop"}}]}],
    },
}


def _import(stack: Stack, tmp: Path, *docs: dict[str, Any]) -> None:
    path = tmp / "import.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out = stack.palisade("policy", "import", str(path), "--wait")
    assert out.returncode == 0, out.stderr


def test_audit_mode_on_real_packets_across_the_cluster(
    stack: Stack, endpoints: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Runs last: it imports policies of its own, and deletes them at the end."""
    _import(stack, tmp_path, DEBUG_AUDIT, DEBUG_DENY_AUDIT, DEBUG_NO_DB)
    try:
        listed = json.loads(stack.palisade("policy", "get", "-o", "json").stdout)["policies"]
        modes = {p["ref"]["name"]: p.get("mode") for p in listed}
        assert (modes["debug-audit"], modes["debug-deny-audit"], modes["debug-no-db"]) == ("audit", "audit", "enforce")
        table = stack.palisade("policy", "get").stdout
        assert "MODE" in table and "audit" in table

        if not stack.reach("shop/backend", "tools/debug", 80):
            # What the nodes did with it, gathered after the probe (the flows are read once a poll).
            time.sleep(0.5)
            seen = stack.palisade("observe", "--last", "50", "--to-pod", "tools/debug", "-o", "json")
            listed = stack.palisade("endpoint", "list", "-o", "json", *stack.flags("endpoint"))
            pytest.fail(
                f"shop/backend -> tools/debug:80 refused under an audited policy\n{seen.stdout}\n{listed.stdout}"
            )
        assert stack.reach("shop/frontend", "tools/debug", 80)  # audited deny: passes
        assert not stack.reach("shop/db", "tools/debug", 80)  # enforced deny beside them: dropped

        flows = observe(stack, "--last", "500", "--to-pod", "tools/debug", "--port", "80")
        audits = {
            (f["source_pod"], f.get("reason"), tuple(f.get("audit_policies", [])))
            for f in flows
            if f["verdict"] == "VERDICT_AUDIT"
        }
        assert audits == {
            ("shop/backend", "FLOW_REASON_DEFAULT_DENY", ("NetworkPolicy tools/debug-audit",)),
            ("shop/frontend", "FLOW_REASON_POLICY_DENY", ("CiliumNetworkPolicy tools/debug-deny-audit",)),
        }
        assert {f["source_pod"] for f in flows if f["verdict"] == "VERDICT_DENY"} == {"shop/db"}
        only_audit = observe(stack, "--last", "500", "--verdict", "audit")
        assert only_audit and all(f["verdict"] == "VERDICT_AUDIT" for f in only_audit)
        text = stack.palisade("observe", "--last", "500", "--verdict", "audit").stdout
        assert "AUDIT" in text and "by NetworkPolicy tools/debug-audit" in text

        # Enforcing it is an edit: the backend is dropped now, the frontend still passes.
        enforced = dict(DEBUG_AUDIT, metadata={"name": "debug-audit", "namespace": "tools"})
        _import(stack, tmp_path, enforced)
        assert not stack.reach("shop/backend", "tools/debug", 80)
        assert stack.reach("shop/frontend", "tools/debug", 80)
    finally:
        for kind, name in (("networkpolicy", "debug-audit"), ("cnp", "debug-deny-audit"), ("cnp", "debug-no-db")):
            stack.palisade("policy", "delete", kind, name, "-n", "tools")
