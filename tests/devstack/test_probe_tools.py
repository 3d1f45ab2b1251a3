"""The dev node's pod servers and prober, over a plain veth between two namespaces (no policy)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from testkit.stack import pod_server, prober

pytestmark = pytest.mark.root


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def two_pods() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    a, b = f"pa{tag}", f"pb{tag}"
    sh("ip", "netns", "add", a)
    sh("ip", "netns", "add", b)
    try:
        sh("ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b)
        for ns, dev, ip, ip6 in (
            (a, f"va{tag}", "10.99.0.1/24", "fd99::1/64"),
            (b, f"vb{tag}", "10.99.0.2/24", "fd99::2/64"),
        ):
            # No duplicate address detection: the link-local address is usable at once.
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{dev}.accept_dad=0")
            sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            sh("ip", "-n", ns, "addr", "add", ip6, "dev", dev, "nodad")
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def test_servers_answer_and_prober_tells_open_from_closed(two_pods: tuple[str, str]) -> None:
    a, b = two_pods
    with pod_server(b, "x/b", "--tcp", "80", "--udp", "53", "--sctp", "80"):
        targets = [
            {"id": "tcp-open", "ip": "10.99.0.2", "port": 80, "protocol": "TCP"},
            {"id": "tcp-closed", "ip": "10.99.0.2", "port": 81, "protocol": "TCP"},
            {"id": "udp-open", "ip": "10.99.0.2", "port": 53, "protocol": "UDP"},
            {"id": "udp-closed", "ip": "10.99.0.2", "port": 54, "protocol": "UDP"},
            {"id": "tcp6-open", "ip": "fd99::2", "port": 80, "protocol": "TCP"},
            {"id": "udp6-open", "ip": "fd99::2", "port": 53, "protocol": "UDP"},
            {"id": "sctp-open", "ip": "10.99.0.2", "port": 80, "protocol": "SCTP"},
            {"id": "sctp-closed", "ip": "10.99.0.2", "port": 81, "protocol": "SCTP"},
            {"id": "sctp6-open", "ip": "fd99::2", "port": 80, "protocol": "SCTP"},
        ]
        assert prober(a, targets, timeout=3) == {
            "tcp-open": True,
            "tcp-closed": False,
            "udp-open": True,
            "udp-closed": False,
            "tcp6-open": True,
            "udp6-open": True,
            "sctp-open": True,
            "sctp-closed": False,
            "sctp6-open": True,
        }
