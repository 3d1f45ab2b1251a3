"""A client that reaches one backend both by its ClusterIP and by its pod address, from one port.

The pods and Service of :func:`manifest` go into a running stack's folder; :func:`alternate`
then opens connections from one explicitly bound client port, alternately through the ClusterIP
and straight to the pod, one after the other and with the previous path's connection still open,
TCP and UDP, and counts those that failed. Binding the port makes the reuse certain: after DNAT
both paths give the backend the same tuple.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections import Counter

import yaml

from services.datapath.netns import in_netns
from testkit.traffic import close_to_time_wait

NAMESPACE = "reuse"
TCP_PORT, UDP_PORT = 7000, 7001
FRONT_TCP, FRONT_UDP = 80, 53


def manifest(client_node: str, backend_node: str) -> str:
    """A namespace with a client pod and a backend pod on the given nodes, and the backend's Service."""
    pod = {"apiVersion": "v1", "kind": "Pod"}
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            **pod,
            "metadata": {"name": "client", "namespace": NAMESPACE, "labels": {"app": "client"}},
            "spec": {"nodeName": client_node, "containers": [{"name": "c", "image": "i"}]},
        },
        {
            **pod,
            "metadata": {"name": "backend", "namespace": NAMESPACE, "labels": {"app": "backend"}},
            "spec": {
                "nodeName": backend_node,
                "containers": [
                    {
                        "name": "c",
                        "image": "i",
                        "ports": [
                            {"name": "echo", "containerPort": TCP_PORT},
                            {"name": "dns", "containerPort": UDP_PORT, "protocol": "UDP"},
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "backend", "namespace": NAMESPACE},
            "spec": {
                "selector": {"app": "backend"},
                "ports": [
                    {"name": "echo", "port": FRONT_TCP, "targetPort": "echo"},
                    {"name": "dns", "port": FRONT_UDP, "protocol": "UDP", "targetPort": "dns"},
                ],
            },
        },
    ]
    return yaml.safe_dump_all(docs)


def _bound(netns: str, kind: int, port: int) -> socket.socket:
    s = in_netns(netns, socket.socket, socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.settimeout(3)
    return s


def _works(s: socket.socket) -> bool:
    """One exchange: the pod server greets a TCP connection then echoes, answers a datagram with its name."""
    try:
        if s.type == socket.SOCK_STREAM:
            msg = os.urandom(4).hex().encode() + b"\n"
            s.sendall(msg)
            data = b""
            while not data.endswith(msg):
                chunk = s.recv(256)
                if not chunk:
                    return False
                data += chunk
            return True
        s.send(b"?")
        return bool(s.recv(256))
    except OSError:
        return False


def _open(netns: str, kind: int, port: int, target: tuple[str, int]) -> socket.socket | None:
    s = _bound(netns, kind, port)
    try:
        s.connect(target)
    except OSError:
        s.close()
        return None
    return s


def alternate(netns: str, pod_ip: str, cluster_ip: str, rounds: int = 4) -> Counter[str]:
    """Counts of ``ok`` and ``failed`` exchanges (and one ``failed: ...`` key naming each failure),
    from one fresh client port per protocol, alternately through the ClusterIP and to the pod, each
    connection closed before the next and, in a second pass, the previous one kept open beside it."""
    counts: Counter[str] = Counter(ok=0, failed=0)

    def count(ok: bool, what: str) -> None:
        counts["ok" if ok else "failed"] += 1
        if not ok:
            counts[f"failed: {what}"] += 1

    for kind, direct, service in (
        (socket.SOCK_STREAM, (pod_ip, TCP_PORT), (cluster_ip, FRONT_TCP)),
        (socket.SOCK_DGRAM, (pod_ip, UDP_PORT), (cluster_ip, FRONT_UDP)),
    ):
        port = 20000 + secrets.randbelow(10000)
        proto = "tcp" if kind == socket.SOCK_STREAM else "udp"
        held: socket.socket | None = None  # second pass: the previous connection, still open
        for i in range(2 * rounds):
            path = ("clusterip", "direct")[i % 2]
            s = _open(netns, kind, port, (service, direct)[i % 2])
            count(s is not None and _works(s), f"{proto} from port {port}, #{i} {path}")
            if held is not None:
                count(_works(held), f"{proto} from port {port}, #{i - 1} kept open beside #{i}")
                close_to_time_wait(held)
                held = None
            if s is not None and i >= rounds:
                held = s
            elif s is not None:
                close_to_time_wait(s)
        if held is not None:
            close_to_time_wait(held)
    return counts
