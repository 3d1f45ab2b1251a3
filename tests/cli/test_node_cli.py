"""The CLI on a node or in a pod of the cluster finds the services without flags."""

from __future__ import annotations

from pathlib import Path


def test_in_a_pod_of_the_cluster_the_defaults_are_the_node_socket_and_the_services(tmp_path: Path) -> None:
    from services.cli.client import cluster_default

    socket = tmp_path / "cni.sock"
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    assert cluster_default("policy", pod, socket) == "palisade-policy.palisade-system.svc:9402"
    assert cluster_default("datapath", pod, socket) == "palisade-datapath.palisade-system.svc:9404"
    socket.touch()
    assert cluster_default("datapath", pod, socket) == f"unix:{socket}"
    assert cluster_default("policy", {}, socket) == ""
