"""Fixtures for real infrastructure: NATS, etcd, service processes, and privilege skips."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import EtcdServer, NatsServer, ServiceProcess


def _is_root() -> bool:
    return os.geteuid() == 0


def _bcc_problem() -> str | None:
    if not _is_root():
        return "needs root to load BPF programs (run `make test` as root)"
    try:
        import bcc  # noqa: F401
    except Exception as exc:  # ImportError, or libbcc missing
        return f"bcc is not importable ({exc}); `make setup` installs python3-bpfcc"
    if not Path(f"/lib/modules/{os.uname().release}/build").exists():
        return "no kernel headers at /lib/modules/$(uname -r)/build; `make setup` links them"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bcc_reason = _bcc_problem()
    for item in items:
        if "root" in item.keywords and not _is_root():
            item.add_marker(pytest.mark.skip(reason="needs root (network namespaces); run `make test` as root"))
        if "bcc" in item.keywords and bcc_reason:
            item.add_marker(pytest.mark.skip(reason=bcc_reason))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream on a free loopback port."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh single-member etcd on free loopback ports."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """Start ``python -m services.<name>`` processes; each is killed at teardown."""
    started: list[ServiceProcess] = []

    def start(name: str, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> ServiceProcess:
        proc = ServiceProcess(name, tmp_path, list(args), env)
        proc.start(wait=wait)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture
def bpffs() -> Iterator[str]:
    """A bpffs directory of its own for a datapath under test; everything pinned there is removed."""
    path = f"/sys/fs/bpf/palisade-test-{secrets.token_hex(4)}"
    yield path
    if os.path.exists(path):
        from services.datapath.datapath import teardown_all

        teardown_all(path)
