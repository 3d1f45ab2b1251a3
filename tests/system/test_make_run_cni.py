"""`make run RUN_ARGS=--cni`: the dev node makes its pods as a container runtime does, through palisade-cni.

Each pod's sandbox is a network namespace the node makes and joins by exec'ing the plugin
(CNI ADD; DEL when it goes), so the examples' story runs on the path kubelet's pods take:
identities from the watcher's Pod objects, policy enforced with real packets, kept across
a datapath kill -9 (the endpoints are restored), and nothing left after Ctrl-C.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from testkit.harness import ROOT
from testkit.stack import Stack, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stackcni"), ROOT / "examples", "--cni") as s:
        yield s


def test_pods_come_through_the_cni_plugin_and_the_story_is_enforced(stack: Stack) -> None:
    out = stack.palisade("endpoint", "list", "-o", "json")
    eps = json.loads(out.stdout)["endpoints"]
    assert {f"{e['namespace']}/{e['pod']}" for e in eps} == {"shop/frontend", "shop/backend", "shop/db", "tools/debug"}
    assert all(e["container_id"].startswith("dev") and "/cni-dev-" in e["netns"] for e in eps)
    assert all(e["identity"] != 5 for e in eps)  # init only until the Pod object's labels arrived
    assert not stack.story_broken()  # the named port "pg" from the Pod object


def test_a_datapath_kill_9_keeps_cni_endpoints_enforcing(stack: Stack) -> None:
    before = {e["id"] for e in json.loads(stack.palisade("endpoint", "list", "-o", "json").stdout)["endpoints"]}
    old = stack.kill("datapath")
    stack.serving_again("datapath", old)
    after = {e["id"] for e in json.loads(stack.palisade("endpoint", "list", "-o", "json").stdout)["endpoints"]}
    assert after == before
    assert wait_for(lambda: not stack.story_broken())


def test_zz_ctrl_c_removes_the_sandboxes(stack: Stack) -> None:
    stack.interrupt()
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    eps_netns = [n for n in netns if n.startswith("cni-dev-")]
    assert not eps_netns, eps_netns
