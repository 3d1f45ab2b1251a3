"""The whole system as `make run` brings it up: real services, real pods, real packets.

One stack per module (it takes a few seconds to start); every test talks to it the way
a user does, through the `palisade` CLI and the manifest folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import ROOT
from testkit.stack import Stack, analyze, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

HERE = Path(__file__).resolve().parent
PROBES = ["80/TCP", "81/UDP", "8080/TCP"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack"), ROOT / "examples") as s:
        yield s


def test_banner_lists_services_and_pods(stack: Stack) -> None:
    text = "".join(stack.output)
    for name in ("nats", "etcd", "watcher", "ipam", "policy", "datapath"):
        assert f"  {name} " in text
    for pod in ("shop/frontend", "shop/backend", "shop/db", "tools/debug"):
        assert pod in text


def test_status_shows_every_service_serving_and_synced(stack: Stack) -> None:
    out = stack.palisade("status", "-o", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    services = {s["service"]: s for s in json.loads(out.stdout)["services"]}
    assert {s["health"] for s in services.values()} == {"SERVING"}
    assert all(s["synced"] for s in services.values())


def test_example_story_is_enforced_with_real_packets(stack: Stack) -> None:
    assert not stack.story_broken()


def test_editing_a_policy_file_changes_connectivity(stack: Stack) -> None:
    stack.check_policy_edit()


def test_a_broken_policy_file_leaves_everything_else_enforced(stack: Stack) -> None:
    bad = stack.manifests / "80-broken.yaml"
    bad.write_text("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: x\n")
    try:
        time.sleep(2)
        assert stack.reach("shop/frontend", "shop/backend", 8080)
        assert not stack.reach("tools/debug", "shop/db", 5432)
        out = stack.palisade("status", "-o", "json")
        watcher = next(s for s in json.loads(out.stdout)["services"] if s["service"] == "watcher")
        assert watcher["details"].get("errors") not in (None, "0")
    finally:
        bad.unlink()


def test_a_typo_in_an_enforced_policy_keeps_its_valid_version_enforced(stack: Stack) -> None:
    """`fromEndpoints` misspelled in the backend's policy would leave its rule only `toPorts`: port
    8080 open to every pod. The edit is refused instead: the valid version stays enforced (real
    packets), `palisade status` and `policy get` show the error with the field's path, and
    fixing the file clears it."""
    path = stack.manifests / "40-backend.yaml"
    valid = path.read_text()
    typo = valid.replace(
        "    - fromEndpoints:\n        - matchLabels:", "    - fromEndpoint:\n        - matchLabels:", 1
    )
    assert typo != valid
    revision = stack.policy_revision()

    def invalid() -> list[dict[str, object]]:
        out = stack.palisade("status", "-o", "json")
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout).get("invalid_policies", []))

    path.write_text(typo)
    try:
        assert wait_for(lambda: any("fromEndpoint" in str(p["error"]) for p in invalid()), 30), invalid()
        (shown,) = invalid()
        assert "spec.ingress[0].fromEndpoint" in str(shown["error"]) and "fromEndpoints" in str(shown["error"])
        got = stack.palisade("policy", "get", "-o", "json")
        assert got.returncode == 0 and "spec.ingress[0].fromEndpoint" in got.stdout, got.stdout
        assert stack.policy_revision() == revision  # nothing changed in the repository
        assert not stack.reach("tools/debug", "shop/backend", 8080)  # the typo would have let it in
        assert stack.reach("shop/frontend", "shop/backend", 8080)
    finally:
        path.write_text(valid)
    assert wait_for(lambda: not invalid(), 30), invalid()
    assert not stack.reach("tools/debug", "shop/backend", 8080)


def test_connectivity_probe_matches_analyze(stack: Stack) -> None:
    files = ["-f", str(HERE / "manifests" / "xyz.yaml")]
    probes = [a for p in PROBES for a in ("--probe", p)]
    expected = analyze(*files, *probes)
    probed = stack.palisade("connectivity", "probe", *files, *probes, "-o", "json")
    assert probed.returncode == 0, probed.stderr
    assert json.loads(probed.stdout) == expected
    # The matrix is not trivial: something is allowed and something denied.
    cells = [v for p in expected["probes"] for row in p["matrix"].values() for v in row.values()]
    assert True in cells and False in cells
    # And the probe cleaned up after itself.
    listed = stack.palisade("endpoint", "list", "-o", "json")
    pods = {f"{e['namespace']}/{e['pod']}" for e in json.loads(listed.stdout)["endpoints"]}
    assert not any(p.startswith(("px/", "py/")) for p in pods)


def test_zz_ctrl_c_stops_everything_and_leaves_nothing_behind(stack: Stack) -> None:
    # The datapath is gone when the stack stops (killed, or restarted by hand outside it), so the
    # pods' deletions fail: the stack still removes their namespaces, veths, routes and pins itself.
    listed = stack.palisade("endpoint", "list", "-o", "json")
    host_ifnames = [e["host_ifname"] for e in json.loads(listed.stdout)["endpoints"]]
    assert host_ifnames
    os.kill(stack.pid("datapath"), signal.SIGKILL)
    stack.interrupt()
    assert not os.path.exists(stack.bpffs)
    # Only the logs stay, to read after a crash; the next start removes them.
    assert [p.name for p in stack.run_dir.iterdir()] == ["logs"]
    assert '"service started"' in (stack.run_dir / "logs" / "policy.log").read_text()
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    # This stack's pods (the examples' namespaces and the probe's), not other stacks' on the machine.
    assert not [n for n in netns if n.startswith(("pal_shop_", "pal_tools_", "pal_px_", "pal_py_"))]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in links.splitlines() if any(f"{ep}@" in line for ep in host_ifnames)]
    leftover = subprocess.run(["pgrep", "-f", str(stack.manifests)], capture_output=True, text=True).stdout
    assert leftover.strip() == ""
