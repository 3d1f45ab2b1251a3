"""Builders for the policy service tests: identities, ipcache entries, policy documents, deltas."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from palisade.v1 import common_pb2, identity_pb2, k8s_pb2
from services.common.subjects import k8s_subject

KIND_ENUM = {
    "NetworkPolicy": k8s_pb2.K8S_KIND_NETWORK_POLICY,
    "CiliumNetworkPolicy": k8s_pb2.K8S_KIND_CILIUM_NETWORK_POLICY,
    "CiliumClusterwideNetworkPolicy": k8s_pb2.K8S_KIND_CILIUM_CLUSTERWIDE_NETWORK_POLICY,
    "Namespace": k8s_pb2.K8S_KIND_NAMESPACE,
    "Pod": k8s_pb2.K8S_KIND_POD,
    "Node": k8s_pb2.K8S_KIND_NODE,
    "Service": k8s_pb2.K8S_KIND_SERVICE,
    "EndpointSlice": k8s_pb2.K8S_KIND_ENDPOINT_SLICE,
}
KIND_TOKEN = {
    "NetworkPolicy": "networkpolicy",
    "CiliumNetworkPolicy": "ciliumnetworkpolicy",
    "CiliumClusterwideNetworkPolicy": "ciliumclusterwidenetworkpolicy",
    "Namespace": "namespace",
    "Pod": "pod",
    "Node": "node",
    "Service": "service",
    "EndpointSlice": "endpointslice",
}


def pod_labels(namespace: str = "default", **labels: str) -> list[common_pb2.Label]:
    """Identity labels of a pod as ipam computes them (the parts policies select on)."""
    out = [common_pb2.Label(source="k8s", key=k, value=v) for k, v in sorted(labels.items())]
    out.append(common_pb2.Label(source="k8s", key="io.kubernetes.pod.namespace", value=namespace))
    out.append(
        common_pb2.Label(
            source="k8s", key="io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name", value=namespace
        )
    )
    out.append(common_pb2.Label(source="k8s", key="io.cilium.k8s.policy.cluster", value="default"))
    return out


def identity_update(
    number: int, labels: Mapping[str, str], namespace: str = "default", deleted: bool = False
) -> identity_pb2.IdentityUpdate:
    return identity_pb2.IdentityUpdate(
        identity=identity_pb2.Identity(
            id=number, labels=pod_labels(namespace, **dict(labels)), kind=identity_pb2.IDENTITY_KIND_CLUSTER
        ),
        deleted=deleted,
    )


def ipcache_entry(
    ip: str,
    identity: int,
    node: str,
    pod: str,
    namespace: str = "default",
    named_ports: Mapping[str, int] | None = None,
    deleted: bool = False,
) -> identity_pb2.IpcacheEntry:
    entry = identity_pb2.IpcacheEntry(
        prefix=f"{ip}/32", identity=identity, node=node, namespace=namespace, pod=pod, deleted=deleted
    )
    for name, port in (named_ports or {}).items():
        entry.named_ports[name].CopyFrom(identity_pb2.NamedPort(port=port, protocol=common_pb2.PROTOCOL_TCP))
    return entry


def policy_entry(
    direction: int,
    remote: int,
    port: int = 0,
    proto: int = common_pb2.PROTOCOL_TCP,
    verdict: int = common_pb2.VERDICT_ALLOW,
) -> common_pb2.PolicyEntry:
    """A policy entry as orders carry it: ``remote`` on the single ``port`` of ``proto``, or on every
    port and protocol when ``port`` is 0."""
    key = common_pb2.PolicyKey(
        direction=direction,  # type: ignore[arg-type]
        remote_identity=remote,
        protocol=proto if port else 0,  # type: ignore[arg-type]
        port_low=port,
        port_high=port,
    )
    return common_pb2.PolicyEntry(key=key, verdict=verdict)  # type: ignore[arg-type]


def netpol(
    name: str,
    subject: Mapping[str, str],
    peer: Mapping[str, str],
    port: int | str,
    namespace: str = "default",
) -> dict[str, Any]:
    """A NetworkPolicy: pods ``subject`` accept TCP ``port`` from pods ``peer``."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": dict(subject)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": dict(peer)}}], "ports": [{"port": port}]}],
        },
    }


def cnp(
    name: str, subject: Mapping[str, str], peer: Mapping[str, str], port: int, namespace: str = "default"
) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "endpointSelector": {"matchLabels": dict(subject)},
            "ingress": [
                {
                    "fromEndpoints": [{"matchLabels": dict(peer)}],
                    "toPorts": [{"ports": [{"port": str(port), "protocol": "TCP"}]}],
                }
            ],
        },
    }


def delta(doc: Mapping[str, Any], *, delete: bool = False) -> k8s_pb2.K8sDelta:
    """The K8sDelta the watcher publishes for ``doc`` (a Kubernetes object), on :func:`delta_subject`."""
    meta = doc["metadata"]
    return k8s_pb2.K8sDelta(
        kind=KIND_ENUM[doc["kind"]],
        op=k8s_pb2.DELTA_OP_DELETE if delete else k8s_pb2.DELTA_OP_UPSERT,
        namespace=meta.get("namespace", ""),
        name=meta["name"],
        uid=meta.get("uid", ""),
        object_json=json.dumps(doc).encode(),
        source="test",
    )


def delta_subject(doc: Mapping[str, Any]) -> str:
    meta = doc["metadata"]
    return k8s_subject(KIND_TOKEN[doc["kind"]], meta.get("namespace") or "", meta["name"])
