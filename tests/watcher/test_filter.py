"""What counts as a policy-relevant change, per kind (pure)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from services.watcher.filter import is_relevant_change, relevant_view, strip_noise
from services.watcher.kinds import Kind
from tests.watcher import objects as o

Obj = dict[str, Any]


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    def change(obj: Obj) -> None:
        *parents, last = path.split(".")
        target = obj
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = value

    return change


BASE: dict[Kind, Obj] = {
    Kind.POD: o.pod("web", "prod", ip="10.0.0.1", app="web"),
    Kind.NAMESPACE: o.namespace("prod", team="a"),
    Kind.NODE: o.node("n1"),
    Kind.NETWORK_POLICY: o.netpol("deny"),
    Kind.CILIUM_NETWORK_POLICY: o.cnp("allow"),
    Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY: o.ccnp("egress"),
    Kind.SERVICE: {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "prod"},
        "spec": {"clusterIP": "10.96.0.10", "selector": {"app": "web"}, "ports": [{"port": 80}]},
    },
    Kind.ENDPOINT_SLICE: {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "web-1", "namespace": "prod", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"port": 8080}],
        "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}],
    },
}


@pytest.mark.parametrize(
    ("kind", "change", "relevant"),
    [
        # Bookkeeping every kind has.
        (Kind.POD, _set("metadata.resourceVersion", "99"), False),
        (Kind.POD, _set("metadata.managedFields", [{"manager": "kubelet"}]), False),
        (Kind.POD, _set("metadata.generation", 7), False),
        (Kind.POD, _set("metadata.annotations", {"kubectl.kubernetes.io/last-applied-configuration": "{}"}), False),
        (Kind.NODE, _set("metadata.resourceVersion", "99"), False),
        # Pods: status noise versus IPs and phase.
        (Kind.POD, _set("status.conditions", [{"type": "Ready", "status": "True"}]), False),
        (Kind.POD, _set("status.containerStatuses", [{"restartCount": 3}]), False),
        (Kind.POD, _set("status.startTime", "2024-01-01T00:00:00Z"), False),
        (Kind.POD, _set("status.podIP", "10.0.0.2"), True),
        (Kind.POD, _set("status.podIPs", [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]), True),
        (Kind.POD, _set("status.phase", "Succeeded"), True),
        (Kind.POD, _set("status.hostIP", "192.168.0.2"), True),
        (Kind.POD, _set("metadata.labels", {"app": "api"}), True),
        (Kind.POD, _set("metadata.annotations", {"policy.cilium.io/proxy-visibility": "x"}), True),
        (Kind.POD, _set("metadata.deletionTimestamp", "2024-01-01T00:00:00Z"), True),
        (Kind.POD, _set("metadata.uid", "another"), True),
        (Kind.POD, _set("spec.serviceAccountName", "robot"), True),
        (Kind.POD, _set("spec.nodeName", "node-2"), True),
        # Namespaces: labels matter.
        (Kind.NAMESPACE, _set("metadata.labels", {"team": "b"}), True),
        (Kind.NAMESPACE, _set("spec.finalizers", ["kubernetes"]), False),
        # Nodes: heartbeats are noise, addresses and pod CIDRs are not.
        (Kind.NODE, _set("status.conditions", [{"type": "Ready", "lastHeartbeatTime": "now"}]), False),
        (Kind.NODE, _set("status.images", [{"names": ["busybox"]}]), False),
        (Kind.NODE, _set("status.addresses", [{"type": "InternalIP", "address": "192.168.0.11"}]), True),
        (Kind.NODE, _set("spec.podCIDRs", ["10.0.2.0/24"]), True),
        (Kind.NODE, _set("spec.unschedulable", True), False),
        # Policies: the spec is everything, status is what agents write back.
        (Kind.NETWORK_POLICY, _set("spec.policyTypes", ["Ingress", "Egress"]), True),
        (Kind.CILIUM_NETWORK_POLICY, _set("status.nodes", {"n1": {"enforcing": True}}), False),
        (Kind.CILIUM_NETWORK_POLICY, _set("spec.ingress", []), True),
        (Kind.CILIUM_NETWORK_POLICY, _set("specs", [{"endpointSelector": {}}]), True),
        (Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY, _set("spec.egress", []), True),
        (Kind.CILIUM_CLUSTERWIDE_NETWORK_POLICY, _set("status.derivativePolicies", {}), False),
        # Services: the spec is what is load-balanced; the load balancer status is not.
        (Kind.SERVICE, _set("spec.selector", {"app": "api"}), True),
        (Kind.SERVICE, _set("status.loadBalancer", {"ingress": [{"ip": "1.2.3.4"}]}), False),
        # EndpointSlices: endpoints (with their conditions) and ports.
        (Kind.ENDPOINT_SLICE, _set("endpoints", [{"addresses": ["10.0.0.1"], "conditions": {"ready": False}}]), True),
        (Kind.ENDPOINT_SLICE, _set("ports", [{"port": 9090}]), True),
        (Kind.ENDPOINT_SLICE, _set("metadata.generation", 4), False),
    ],
)
def test_relevant_change(kind: Kind, change: Callable[[Obj], None], relevant: bool) -> None:
    old = BASE[kind]
    new = copy.deepcopy(old)
    change(new)
    assert is_relevant_change(kind, old, new) is relevant


def test_strip_noise_removes_managed_fields_without_touching_the_input() -> None:
    obj = o.pod("web")
    obj["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    stripped = strip_noise(obj)
    assert "managedFields" not in stripped["metadata"]
    assert "managedFields" in obj["metadata"]
    assert stripped["metadata"]["labels"] == obj["metadata"]["labels"]


def test_view_drops_only_the_noisy_annotation() -> None:
    obj = o.pod("web")
    obj["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "{}", "a": "b"}
    assert relevant_view(Kind.POD, obj)["metadata"]["annotations"] == {"a": "b"}
