"""Operating a running stack as a user would on a cluster: scheduling, the node's CLI, versions,
and the bug-report archive (`palisade sysdump`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.system.stack import Stack, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

# Pods of a namespace of their own: a single-node stack's pods are named namespaces of the host.
BASE = """\
apiVersion: v1
kind: Namespace
metadata: {name: opsdemo, labels: {team: ops}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: opsdemo, labels: {app: client}}
spec:
  nodeName: dev-node
  containers: [{name: c, image: busybox}]
"""
UNBOUND_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: unbound
  namespace: opsdemo
  labels: {app: unbound}
spec:
  containers:
    - name: web
      image: nginx
      ports: [{containerPort: 8081, protocol: TCP}]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    examples = tmp_path_factory.mktemp("manifests")
    (examples / "10-base.yaml").write_text(BASE)
    with running_stack(tmp_path_factory.mktemp("stack"), examples) as s:
        yield s


def test_a_pod_without_node_name_is_scheduled_onto_the_single_dev_node(stack: Stack) -> None:
    # As people write them: no spec.nodeName. The dev cluster's scheduler binds it to dev-node.
    (stack.manifests / "90-unbound.yaml").write_text(UNBOUND_POD)

    def created() -> bool:
        return stack.palisade("endpoint", "get", "opsdemo/unbound", "-o", "json").returncode == 0

    assert wait_for(created, 60), "a pod without spec.nodeName was never created on the dev node"
    endpoint = json.loads(stack.palisade("endpoint", "get", "opsdemo/unbound", "-o", "json").stdout)
    assert endpoint["node"] == "dev-node"
    # It is a pod like the others: its identity is its own, and policy reaches it.
    assert stack.reach("opsdemo/client", "opsdemo/unbound", 8081)
