"""Builders of Kubernetes objects for the watcher tests."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def namespace(name: str, **labels: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def pod(name: str, ns: str = "default", ip: str = "", **labels: str) -> Obj:
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running" if ip else "Pending"},
    }
    if ip:
        obj["status"]["podIP"] = ip
        obj["status"]["podIPs"] = [{"ip": ip}]
    return obj


def node(name: str, cidr: str = "10.0.1.0/24") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}]},
    }


def netpol(name: str, ns: str = "default", app: str = "web") -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"]},
    }


def cnp(name: str, ns: str = "default", app: str = "web") -> Obj:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"endpointSelector": {"matchLabels": {"app": app}}, "ingress": [{"fromEntities": ["world"]}]},
    }


def ccnp(name: str) -> Obj:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": name},
        "spec": {"endpointSelector": {}, "egress": [{"toEntities": ["cluster"]}]},
    }


def service(name: str, ns: str = "default", app: str = "web") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": "10.96.0.10", "selector": {"app": app}, "ports": [{"port": 80, "targetPort": 8080}]},
    }


def endpoint_slice(name: str, ns: str = "default", service: str = "web", ip: str = "10.0.1.10") -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
    }
