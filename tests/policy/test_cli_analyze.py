"""``palisade analyze``: output format and exit code 2 on bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import analyze as cli
from testkit.harness import ROOT
from tests.policy.typo_cases import CASES, doc_of

MODEL = """\
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: a}}
spec: {containers: [{name: c, ports: [{name: http, containerPort: 8080}]}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: b}}
---
apiVersion: v1
kind: Service
metadata: {name: s, namespace: x}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: c, namespace: x}
"""
POLICY = """\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p, namespace: x}
spec:
  podSelector: {matchLabels: {app: a}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: b}}}]
    ports: [{port: http}]
"""


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["analyze", *argv])
    result: int = args.func(args)
    return result


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "policy.yml").write_text(POLICY)
    assert run(["-f", str(tmp_path), "--probe", "8080/TCP", "--probe", "80/tcp", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "probes": [
            {
                "port": 8080,
                "protocol": "TCP",
                "matrix": {"x/a": {"x/a": True, "x/b": True}, "x/b": {"x/a": True, "x/b": True}},
            },
            {
                "port": 80,
                "protocol": "TCP",
                "matrix": {"x/a": {"x/a": True, "x/b": True}, "x/b": {"x/a": False, "x/b": True}},
            },
        ]
    }
    assert "ignored ConfigMap" in err and "ignored Service" not in err  # Services are what toServices names


@pytest.mark.parametrize(
    ("content", "probe", "needle"),
    [
        ("kind: Pod\nmetadata: {name: [\n", "80/TCP", "in.yaml: not valid YAML or JSON at line"),
        (POLICY.replace("port: http", "port: 90, endPort: 80"), "80/TCP", "spec.ingress[0].ports[0].endPort"),
        (MODEL, "80/ICMPX", "--probe"),
        (MODEL, "0/TCP", "--probe"),
    ],
)
def test_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, probe: str, needle: str
) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(content)
    assert run(["-f", str(f), "--probe", probe, "-o", "json"]) == 2
    err = capsys.readouterr().err
    assert needle in err
    if "--probe" not in needle:
        assert str(f) in err


def test_table_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.yaml").write_text(MODEL + "---\n" + POLICY)
    assert run(["-f", str(tmp_path / "m.yaml"), "--probe", "80/TCP"]) == 0
    out = capsys.readouterr().out
    assert "Probe 80/TCP" in out and "x/b" in out


TYPO = """\
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: only-b, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: a}}
  ingress:
  - fromEndpoint: [{matchLabels: {app: b}}]
    toPorts: [{ports: [{port: "80"}]}]
"""


def test_a_typo_exits_2_naming_the_file_the_object_the_path_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(MODEL + "---\n" + TYPO)
    assert run(["-f", str(f), "--probe", "80/TCP", "-o", "json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert str(f) in err
    assert (
        "CiliumNetworkPolicy x/only-b: spec.ingress[0].fromEndpoint: unknown field; did you mean 'fromEndpoints'?"
        in err
    )


def test_keep_going_reports_the_invalid_policy_and_analyzes_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(MODEL + "---\n" + TYPO + "---\n" + POLICY)
    assert run(["-f", str(f), "--probe", "8080/TCP", "-o", "json", "--keep-going"]) == 1
    out, err = capsys.readouterr()
    assert "spec.ingress[0].fromEndpoint: unknown field" in err and "left out" in err
    # The valid policy is enforced (b may reach a's named port), the invalid one is not.
    matrix = json.loads(out)["probes"][0]["matrix"]
    assert matrix == {"x/a": {"x/a": True, "x/b": True}, "x/b": {"x/a": True, "x/b": True}}


def test_engine_warnings_and_unsupported_parts_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    legacy = POLICY.replace("networking.k8s.io/v1", "extensions/v1beta1")
    l7 = (
        TYPO.replace("fromEndpoint:", "fromEndpoints:")
        .replace('ports: [{port: "80"}]}]', 'ports: [{port: "80"}], rules: {http: [{method: GET}]}}]')
        .replace("only-b", "l7")
    )
    f = tmp_path / "in.yaml"
    f.write_text(MODEL + "---\n" + legacy + "---\n" + l7)
    assert run(["-f", str(f), "--probe", "80/TCP", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # standard output holds the JSON alone
    assert "NetworkPolicy x/p: apiVersion: legacy extensions/v1beta1" in err
    assert "CiliumNetworkPolicy x/l7: unsupported, not enforced: spec.ingress[0].toPorts[0].rules" in err


def test_no_pods_is_said_instead_of_an_empty_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(POLICY)
    assert run(["-f", str(f), "--probe", "80/TCP", "-o", "json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no Pod objects in" in err


def test_no_policies_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(MODEL)
    assert run(["-f", str(f), "--probe", "80/TCP", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert "no valid NetworkPolicy" in err and "every connection is allowed" in err
    assert json.loads(out)["probes"][0]["matrix"]["x/b"]["x/a"] is True


@pytest.mark.parametrize(
    ("kind", "case", "where", "edit", "path", "words"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_every_typo_stops_analyze_naming_its_path(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    case: str,
    where: Callable[[dict[str, Any]], Any],
    edit: Callable[[dict[str, Any]], None],
    path: str,
    words: str,
) -> None:
    doc = doc_of(kind)
    edit(where(doc))
    f = tmp_path / "in.yaml"
    f.write_text(MODEL + "---\n" + yaml.safe_dump(doc))
    assert run(["-f", str(f), "--probe", "80/TCP", "-o", "json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{path}: " in err and words in err, err


HOST_NETWORK = """
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {name: agent, namespace: x, labels: {app: agent}}
spec: {nodeName: n1, hostNetwork: true, containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: local, namespace: x, labels: {app: a}}
spec: {nodeName: n1, containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: remote, namespace: x, labels: {app: a}}
spec: {nodeName: n2, containers: [{name: c, image: i}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: x}
spec: {podSelector: {}, policyTypes: [Ingress, Egress]}
"""

TO_HOST_ONLY = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-own-node, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: a}}
  egress: [{toEntities: [host]}]
"""


# A host-network pod is its node: `host` to pods of its node, `remote-node` to the others; no
# policy judges its own traffic, and host traffic to a pod of its own node is always allowed.
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("", {("agent", "local"): True, ("agent", "remote"): False, ("local", "agent"): False,
              ("remote", "agent"): False, ("local", "remote"): False}),
        (TO_HOST_ONLY, {("agent", "local"): True, ("agent", "remote"): False, ("local", "agent"): True,
                        ("remote", "agent"): False, ("local", "remote"): False}),
    ],
)  # fmt: skip
def test_a_host_network_pod_is_seen_as_its_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, expected: dict[tuple[str, str], bool]
) -> None:
    (tmp_path / "m.yaml").write_text(HOST_NETWORK + ("---\n" + extra if extra else ""))
    assert run(["-f", str(tmp_path), "--probe", "80/TCP", "-o", "json"]) == 0
    matrix = json.loads(capsys.readouterr().out)["probes"][0]["matrix"]
    assert {pair: matrix[f"x/{pair[0]}"][f"x/{pair[1]}"] for pair in expected} == expected


def test_connectivity_probe_refuses_host_network_pods_it_cannot_make(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(HOST_NETWORK)
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "connectivity", "probe", "-f", str(tmp_path), "--probe", "80/TCP"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "x/agent" in out.stderr and "spec.hostNetwork" in out.stderr


# --- names: toFQDNs and DNS rules with the user's DNS table -----------------------------------

NAMES_MODEL = """\
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: a}}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: b}}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: x, labels: {app: c}}
---
apiVersion: v1
kind: Pod
metadata: {name: dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: a-names, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: a}}
  egress:
  - toEndpoints: [{matchLabels: {"k8s:io.kubernetes.pod.namespace": kube-system, k8s-app: kube-dns}}]
    toPorts: [{ports: [{port: "53", protocol: ANY}], rules: {dns: [{matchPattern: "*.example.test"}]}}]
  - toFQDNs: [{matchPattern: "*.example.test"}, {matchName: other.test}]
    toPorts: [{ports: [{port: "443", protocol: TCP}]}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: b-names-without-dns-rule, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: b}}
  egress:
  - toFQDNs: [{matchPattern: "*"}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: c-world-but-one, namespace: x}
spec:
  endpointSelector: {matchLabels: {app: c}}
  egress:
  - toEntities: [world]
  egressDeny:
  - toCIDR: [198.51.100.7/32]
"""
DNS = [
    "--dns",
    "api.example.test=192.0.2.10,192.0.2.11",
    "--dns",
    "other.test=198.51.100.7",
    "--dns",
    "a.b.example.test=203.0.113.5",
]


def test_names_are_judged_from_the_dns_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.yaml").write_text(NAMES_MODEL)
    assert run(["-f", str(tmp_path), "--probe", "443/TCP", "--probe", "80/TCP", *DNS, "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert "unsupported" not in err
    https, http = json.loads(out)["probes"]
    assert https["names"] == {
        # a: *.example.test by name (one label only), other.test selected by toFQDNs but not resolvable
        "x/a": {"a.b.example.test": False, "api.example.test": True, "other.test": False},
        # b: toFQDNs without any DNS rule: its queries never reach the proxy, nothing is learned
        "x/b": {"a.b.example.test": False, "api.example.test": False, "other.test": False},
        # c: the world by its addresses, except the one denied
        "x/c": {"a.b.example.test": True, "api.example.test": True, "other.test": False},
        "kube-system/dns": {"a.b.example.test": True, "api.example.test": True, "other.test": True},
    }
    assert http["names"]["x/a"] == {"a.b.example.test": False, "api.example.test": False, "other.test": False}
    # the pod matrix is as without the table
    assert run(["-f", str(tmp_path), "--probe", "443/TCP", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["probes"][0] == {k: v for k, v in https.items() if k != "names"}


def test_names_in_the_table_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.yaml").write_text(NAMES_MODEL)
    assert run(["-f", str(tmp_path), "--probe", "443/TCP", *DNS]) == 0
    out = capsys.readouterr().out
    assert "Names on 443/TCP (row = source pod, column = name)" in out
    names = out.split("Names on 443/TCP")[1]
    row = next(line for line in names.splitlines() if line.startswith("x/a "))
    assert row.split("|")[1].split() == ["-", "yes", "-"]


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("api.example.test", "write NAME=IP[,IP...]"),
        ("api.example.test=", "write NAME=IP[,IP...]"),
        ("api..example.test=192.0.2.1", "empty label"),
        ("*.example.test=192.0.2.1", "'*'"),
        ("api.example.test=192.0.2.300", "'192.0.2.300' is not an IP address"),
    ],
)
def test_a_bad_dns_entry_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str, needle: str
) -> None:
    (tmp_path / "m.yaml").write_text(NAMES_MODEL)
    assert run(["-f", str(tmp_path), "--probe", "443/TCP", "--dns", entry]) == 2
    err = capsys.readouterr().err
    assert "--dns" in err and needle in err
