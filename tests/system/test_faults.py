"""Faults a hostile but fair operator causes, under counted traffic: no denied connection gets in.

One `make run` stack with the examples. Each test keeps connections going from real pods
(see :mod:`tests.system.traffic`) while it kills a part with SIGKILL (the stack restarts it,
as a kubelet would), breaks a policy file across a watcher restart, restarts the policy
service under an imported deny, or writes a policy larger than the bus's maximum payload;
then it counts: every allowed connection opened, no denied one did.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from testkit.harness import ROOT
from testkit.stack import Stack, Traffic, assert_clean, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

#: Allowed by the examples (frontend -> backend:8080) and denied (frontend -> db:5432, default deny).
ALLOWED = [("shop/backend", 8080)]
DENIED = [("shop/db", 5432)]
NAMESPACE_LABEL = "k8s:io.kubernetes.pod.namespace"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("faults"), ROOT / "examples") as s:
        yield s


def services(stack: Stack) -> dict[str, dict[str, Any]]:
    out = stack.palisade("status", "-o", "json", timeout=30)
    return {r["service"]: r for r in json.loads(out.stdout)["services"]} if out.returncode == 0 else {}


def all_synced(stack: Stack) -> bool:
    rows = services(stack)
    return len(rows) == 4 and all(r["health"] == "SERVING" and r["synced"] for r in rows.values())


def policy(stack: Stack, kind: str, name: str, *flags: str) -> dict[str, Any] | None:
    out = stack.palisade("policy", "get", kind, name, *flags, "-o", "json")
    return json.loads(out.stdout) if out.returncode == 0 else None


@pytest.mark.parametrize("part", ["nats", "etcd", "watcher", "ipam", "policy", "datapath"])
def test_kill_9_of_any_part_drops_no_allowed_and_admits_no_denied_connection(stack: Stack, part: str) -> None:
    assert wait_for(lambda: all_synced(stack), 60)
    with Traffic(stack, "shop/frontend", ALLOWED, DENIED) as traffic:
        time.sleep(0.5)
        old = stack.kill(part)
        stack.serving_again(part, old)
        assert wait_for(lambda: all_synced(stack), 60), services(stack)
        time.sleep(0.5)
    assert_clean(traffic.counts)
    # Still a working system: a policy edit takes effect after the restart.
    stack.check_policy_edit()


def test_a_broken_file_keeps_its_deny_across_a_watcher_restart(stack: Stack) -> None:
    # Allow tools -> db, so only the clusterwide deny of 60-no-tools-to-db.yaml keeps it denied.
    allow = stack.manifests / "65-allow-tools-to-db.yaml"
    allow.write_text(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        "metadata: {name: tools-to-db, namespace: shop}\n"
        "spec:\n  podSelector: {matchLabels: {app: db}}\n  ingress:\n"
        "  - from: [{namespaceSelector: {matchLabels: {team: tools}}}]\n"
    )
    deny = stack.manifests / "60-no-tools-to-db.yaml"
    good = deny.read_text()
    assert wait_for(lambda: policy(stack, "networkpolicy", "tools-to-db", "-n", "shop") is not None)
    assert wait_for(lambda: all_synced(stack), 60)
    try:
        with Traffic(stack, "tools/debug", [("shop/frontend", 80)], [("shop/db", 5432)]) as traffic:
            deny.write_text(good + "\n  broken: [unclosed\n")
            assert wait_for(lambda: services(stack)["watcher"]["details"].get("errors") not in (None, "0"))
            old = stack.kill("watcher")
            stack.serving_again("watcher", old)
            time.sleep(1.5)  # the restarted watcher has published what it had to; traffic keeps counting
            kept = policy(stack, "ccnp", "no-tools-to-data")
            assert kept is not None, "the restarted watcher deleted a policy whose file is only unreadable"
        assert_clean(traffic.counts)
    finally:
        deny.write_text(good)
        allow.unlink()
    assert wait_for(lambda: services(stack)["watcher"]["details"].get("errors") in (None, "0"))


def test_an_imported_deny_survives_a_policy_service_restart(stack: Stack, tmp_path: Any) -> None:
    path = tmp_path / "deny.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "cilium.io/v2",
                "kind": "CiliumClusterwideNetworkPolicy",
                "metadata": {"name": "api-no-tools-to-web"},
                "spec": {
                    "endpointSelector": {"matchLabels": {"tier": "web"}},
                    "ingressDeny": [{"fromEndpoints": [{"matchLabels": {NAMESPACE_LABEL: "tools"}}]}],
                },
            }
        )
    )
    assert stack.reach("tools/debug", "shop/frontend", 80)
    imported = stack.palisade("policy", "import", str(path), "--wait")
    assert imported.returncode == 0, imported.stderr
    try:
        assert not stack.reach("tools/debug", "shop/frontend", 80)
        with (
            Traffic(stack, "tools/debug", [], [("shop/frontend", 80)]) as denied,
            Traffic(stack, "shop/frontend", ALLOWED, DENIED) as other,
        ):
            old = stack.kill("policy")
            stack.serving_again("policy", old)
            assert wait_for(lambda: all_synced(stack), 60)
            time.sleep(1.0)
        assert denied.counts["denied_admitted"] == 0 and denied.counts["denied_blocked"] > 0, denied.counts
        assert_clean(other.counts)
        shown = policy(stack, "ccnp", "api-no-tools-to-web")
        assert shown is not None and "API" in json.dumps(shown).upper(), shown
        assert not stack.reach("tools/debug", "shop/frontend", 80)
    finally:
        stack.palisade("policy", "delete", "ccnp", "api-no-tools-to-web", "--source", "api")
    assert wait_for(lambda: stack.reach("tools/debug", "shop/frontend", 80))


def big_deny(name: str, rules: int) -> dict[str, Any]:
    """A CCNP denying tools -> web, padded with rules that select nothing up to more than a bus message."""
    padding = [
        {"fromEndpoints": [{"matchLabels": {f"pad{j}": f"{i:06d}-" + "x" * 56 for j in range(8)}}]}
        for i in range(rules)
    ]
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "endpointSelector": {"matchLabels": {"tier": "web"}},
            "ingressDeny": [
                {"fromEndpoints": [{"matchLabels": {"k8s:io.kubernetes.pod.namespace": "tools"}}]},
                *padding,
            ],
        },
    }


def test_a_policy_larger_than_a_bus_message_is_enforced_and_replaced(stack: Stack) -> None:
    path = stack.manifests / "90-big.yaml"
    path.write_text(yaml.safe_dump(big_deny("big-deny", 2500)))
    assert path.stat().st_size > 1024 * 1024  # NATS's default maximum payload
    try:
        assert wait_for(lambda: not stack.reach("tools/debug", "shop/frontend", 80), 120)
        with Traffic(stack, "tools/debug", [], [("shop/frontend", 80)]) as traffic:
            time.sleep(1.0)
        assert traffic.counts["denied_admitted"] == 0 and traffic.counts["denied_blocked"] > 0, traffic.counts
        details = services(stack)["watcher"]["details"]
        assert details.get("errors") in (None, "0") and details.get("publish_pending") in (None, "0"), details
        # A small policy of the same name replaces it at once (nothing stuck behind the large one).
        small = big_deny("big-deny", 0)
        small["spec"]["ingressDeny"][0]["fromEndpoints"][0]["matchLabels"] = {"app": "nobody"}
        path.write_text(yaml.safe_dump(small))
        assert wait_for(lambda: stack.reach("tools/debug", "shop/frontend", 80), 60)
    finally:
        path.unlink()
    assert wait_for(lambda: policy(stack, "ccnp", "big-deny") is None)
