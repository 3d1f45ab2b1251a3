"""Fixtures for real infrastructure: NATS, etcd, service processes, and privilege skips."""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from hypothesis import settings

from testkit import leftovers
from testkit.harness import EtcdCluster, EtcdServer, NatsCluster, NatsServer, ServiceProcess, bcc_problem, is_root, pki

_LOCK = pytest.StashKey[IO[str]]()

# Tests assert behaviour, never wall-clock time: no example fails for being slow on a busy machine.
settings.register_profile("palisade", deadline=None)
settings.load_profile("palisade")


def pytest_configure(config: pytest.Config) -> None:
    # The session's installation (CA and certificates): every service, CLI and client a test
    # starts finds it here, as a deployment's components find their mounted secret.
    os.environ["PALISADE_TLS_DIR"] = str(pki())
    if is_root():
        handle, swept = leftovers.hold_lock()
        config.stash[_LOCK] = handle
        if swept:
            print(f"\nremoved what a killed test run left behind: {swept}")


def pytest_unconfigure(config: pytest.Config) -> None:
    handle = config.stash.get(_LOCK, None)
    if handle is not None:
        handle.close()


#: Test folders about the node: namespaces, links, BPF, routes, containers, whole dev stacks.
KERNEL_FOLDERS = {"bench", "cni", "datapath", "datapath_service", "deploy", "devstack", "system"}


def test_group(item: pytest.Item) -> str:
    """``make test`` runs two workers (pytest-xdist, ``--dist loadgroup``), each one of two groups.

    "kernel": what changes the host's kernel state shares names, addresses, pins and the checks that
    nothing is left behind, so those tests run in turn, in the order they are collected. "unit": the
    rest (real NATS, etcd and service processes on free loopback ports) runs beside them.
    """
    folder = item.path.relative_to(Path(__file__).parent).parts[0]
    kernel = folder in KERNEL_FOLDERS or "root" in item.keywords or "kernel" in item.keywords
    return "kernel" if kernel else "unit"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bcc_reason = bcc_problem()
    for item in items:
        item.add_marker(pytest.mark.xdist_group(test_group(item)))
        if "root" in item.keywords and not is_root():
            item.add_marker(pytest.mark.skip(reason="needs root (network namespaces); run `make test` as root"))
        if "bcc" in item.keywords and bcc_reason:
            item.add_marker(pytest.mark.skip(reason=bcc_reason))


@pytest.fixture(autouse=True)
def no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test that leaves asyncio tasks running: each one is a stop that was forgotten."""
    if not inspect.iscoroutinefunction(getattr(request, "function", None)):
        yield
        return
    request.getfixturevalue("_tasks_at_teardown")
    yield


@pytest.fixture
async def _tasks_at_teardown() -> AsyncIterator[None]:
    # Set up before the test's other fixtures, so torn down after them: what runs now was leaked.
    before = asyncio.all_tasks()
    yield
    for _ in range(5):  # let tasks that are already finishing (cancelled, closing) finish
        await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
    for task in leaked:
        task.cancel()
    if leaked:
        await asyncio.gather(*leaked, return_exceptions=True)
        names = ", ".join(sorted(f"{t.get_name()} ({t.get_coro()!r:.80})" for t in leaked))
        pytest.fail(f"the test left {len(leaked)} asyncio task(s) running: {names}", pytrace=False)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream on a free loopback port."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three nats-servers routed into one cluster, JetStream replicated across them."""
    with NatsCluster(tmp_path / "nats-cluster") as nats:
        nats.start()
        yield nats


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A three-member etcd cluster."""
    with EtcdCluster(tmp_path / "etcd-cluster") as etcd:
        yield etcd


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
