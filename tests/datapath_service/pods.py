"""Traffic helpers for tests that run the datapath service against real namespaces."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PROBE = str(Path(__file__).with_name("netprobe.py"))


class Pods:
    """Traffic helpers inside the namespaces the datapath created."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.procs: list[subprocess.Popen[str]] = []

    def netns(self, pod: str) -> str:
        return f"pal_{self.namespace}_{pod}"

    def spawn(self, pod: str, *args: str) -> subprocess.Popen[str]:
        cmd = ["ip", "netns", "exec", self.netns(pod), sys.executable, PROBE, *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def serve(self, pod: str, *ports: int) -> subprocess.Popen[str]:
        proc = self.spawn(pod, "serve", *(str(p) for p in ports))
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    def connects(self, pod: str, ip: str, port: int, timeout: float = 1.0) -> bool:
        cmd = ["ip", "netns", "exec", self.netns(pod), sys.executable, PROBE, "connect", ip, str(port), str(timeout)]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0

    def close(self) -> None:
        """Stop the helpers and delete any namespace of this run the datapath left."""
        for proc in self.procs:
            proc.kill()
            proc.wait(5)
        for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
            if name.startswith(f"pal_{self.namespace}_"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def pods() -> Iterator[Pods]:
    """Helpers for pods in a Kubernetes namespace unique to this test."""
    p = Pods("t" + secrets.token_hex(3))
    yield p
    p.close()
