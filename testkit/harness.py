"""Real infrastructure for tests: nats-server, etcd and Palisade service processes.

Everything listens on free loopback ports with temporary data dirs and is torn down
by the fixtures in ``conftest.py``. Nothing here mocks the bus or the store.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common import etcdconfig, natsconfig
from services.common.access import (
    BUS_ROLES,
    IDENTITY,
    IPCACHE,
    K8S,
    LARGE_OBJECTS,
    POLICY_API,
    POLICY_STATE,
    REGEN,
    BusRole,
)
from services.common.grpcserver import open_channel, open_sync_channel
from services.common.natsconfig import Cluster
from services.common.trust import COMPONENTS, Credentials, ensure_pki
from services.devstack.processes import binary

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

#: A test client's own bus user: it stands in for any publisher (a fake watcher, a fake policy
#: service) where a test feeds a service. Only the test NATS knows it; the services run as themselves.
TEST_IDENTITY = "test"
_ALL_STREAMS = (K8S, IDENTITY, IPCACHE, REGEN, f"KV_{POLICY_STATE}", f"OBJ_{LARGE_OBJECTS}", f"OBJ_{POLICY_API}")
TEST_ROLE = BusRole(
    publishes=("palisade.>", "$KV.>", "$O.>", "$JS.API.>", "$JS.ACK.>", "$JS.FC.>"),
    subscribes=(">",),
    provisions=_ALL_STREAMS,
    reads=_ALL_STREAMS,
    purges=(f"OBJ_{LARGE_OBJECTS}", f"OBJ_{POLICY_API}"),
)
_pki: list[Path] = []


def pki() -> Path:
    """This test session's installation: a CA and every component's certificate (made once)."""
    if not _pki:
        # A helper process of the session (an ipam worker) uses the session's, which it inherits.
        inherited = Path(os.environ.get("PALISADE_TLS_DIR", "/nonexistent"))
        if (inherited / f"{TEST_IDENTITY}.crt").is_file():
            _pki.append(inherited)
        else:
            made = Path(tempfile.mkdtemp(prefix="palisade-pki-"))
            # Gone with the process that made it (each test session, each worker): they piled up in /tmp.
            atexit.register(shutil.rmtree, made, ignore_errors=True)
            _pki.append(ensure_pki(made, (*COMPONENTS, TEST_IDENTITY)))
    return _pki[0]


def creds(name: str = TEST_IDENTITY) -> Credentials:
    """The session installation's credentials of component ``name`` (the test client by default)."""
    return Credentials.load(pki(), name)


def channel(address: str, service: str, as_: str = "cli") -> grpc.aio.Channel:
    """An asyncio mutual-TLS channel to ``service``, presenting the certificate of ``as_``."""
    return open_channel(address, service, creds(as_))


def sync_channel(address: str, service: str, as_: str = "cli") -> grpc.Channel:
    return open_sync_channel(address, service, creds(as_))


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A free loopback port (the first of ``count`` consecutive ones) for a server to bind.

    Chosen outside the kernel's ephemeral range: a port from that range (what binding
    port 0 gives) can be taken by any outgoing connection between this check and the
    server's bind, and a server that then cannot bind fails a test at random. Never the
    same port twice in one process, so servers not yet listening keep theirs.
    """
    low, high = _ephemeral_range()
    first, last = (10000, low - 1) if low - 10000 > 1000 else (high + 1, 65535)
    for _ in range(1000):
        base = random.randrange(first, last - count + 1)
        ports = range(base, base + count)
        if not _handed_out.intersection(ports) and all(port_free(p) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {count} free consecutive ports in {first}-{last}")


def wait_tcp(port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class _Server:
    """A server subprocess that can be stopped and restarted on the same port and data dir."""

    name = "server"

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.wait_ready()

    def wait_ready(self) -> None:
        wait_tcp(self.port, proc=self.proc)

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self) -> None:
        self.stop()
        self.start()


class NatsServer(_Server):
    """nats-server with JetStream on a free loopback port: TLS and the components' users, or
    (``secure=False``, for benchmarks that price TLS) plaintext without users."""

    name = "nats"

    def __init__(self, data_dir: Path, secure: bool = True, cluster: Cluster | None = None) -> None:
        super().__init__(data_dir)
        self.secure = secure
        self.cluster = cluster

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = natsconfig.write(
            self.data_dir / "nats.conf",
            listen=f"127.0.0.1:{self.port}",
            store_dir=str(self.data_dir / "js"),
            tls=creds("nats") if self.secure else None,
            roles={**BUS_ROLES, TEST_IDENTITY: TEST_ROLE},
            cluster=self.cluster,
        )
        return [binary("nats-server"), "-c", str(conf)]


class NatsCluster:
    """Three (or ``size``) nats-servers routed into one cluster, JetStream replicated across them."""

    def __init__(self, data_dir: Path, size: int = 3) -> None:
        routes = tuple(f"127.0.0.1:{free_port()}" for _ in range(size))
        self.members = [
            NatsServer(data_dir / f"nats-{i}", cluster=Cluster(f"nats-{i}", routes[i], routes)) for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    @property
    def url(self) -> str:
        """Every member's URL, comma-separated, as a --nats-url."""
        return ",".join(self.urls)

    def start(self) -> None:
        for member in self.members:
            member.start()

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> NatsCluster:
        """The cluster, its members started by the caller (all: :meth:`start`); every one stopped after."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _RetryLogged(logging.Handler):
    def __init__(self, what: str, event: asyncio.Event) -> None:
        super().__init__()
        self.what = what
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "palisade_fields", {})
        if record.getMessage() == "bus call failed, retrying" and fields.get("what") == self.what:
            self.event.set()


@contextlib.contextmanager
def bus_call_failed(what: str) -> Iterator[asyncio.Event]:
    """An event set once the bus logs a failed attempt of the call ``what`` (e.g. "ensure stream")."""
    event = asyncio.Event()
    handler = _RetryLogged(what, event)
    logger = logging.getLogger("palisade.bus")
    logger.addHandler(handler)
    try:
        yield event
    finally:
        logger.removeHandler(handler)


class EtcdServer(_Server):
    """A single-member etcd on free loopback ports."""

    name = "etcd"

    def __init__(self, data_dir: Path, name: str = "test", members: dict[str, str] | None = None) -> None:
        super().__init__(data_dir)
        self.peer_port = free_port()
        self.member = name
        #: name -> peer address of every member, when this one is part of a cluster.
        self.members = members

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            binary("etcd"),
            "--name",
            self.member,
            "--data-dir",
            str(self.data_dir / "data"),
            "--log-level",
            "warn",
            *etcdconfig.flags(creds("etcd"), self.member, self.endpoint, f"127.0.0.1:{self.peer_port}", self.members),
        ]

    def wait_ready(self) -> None:
        wait_tcp(self.port, proc=self.proc)
        # TCP accepts before the member has elected itself; ask etcdctl until it answers.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            rc = subprocess.run(
                [
                    binary("etcdctl"),
                    "--endpoints",
                    f"https://{self.endpoint}",
                    *etcdconfig.ctl_flags(creds("ipam")),
                    "endpoint",
                    "health",
                ],
                capture_output=True,
            ).returncode
            if rc == 0:
                return
            time.sleep(0.1)
        raise TimeoutError("etcd did not become healthy")


class EtcdCluster:
    """Three (or ``size``) etcd members in one cluster."""

    def __init__(self, data_dir: Path, size: int = 3) -> None:
        self.members = [EtcdServer(data_dir / f"etcd-{i}", f"etcd-{i}") for i in range(size)]
        peers = {m.member: f"127.0.0.1:{m.peer_port}" for m in self.members}
        for m in self.members:
            m.members = peers

    @property
    def endpoints(self) -> str:
        """Every member's client address, comma-separated, as --etcd-endpoints."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        # Each member waits for a quorum of the others: start them all, then wait.
        for m in self.members:
            m.data_dir.mkdir(parents=True, exist_ok=True)
            with open(m.log_path, "ab") as log:
                m.proc = subprocess.Popen(m.command(), stdout=log, stderr=subprocess.STDOUT)
        for m in self.members:
            m.wait_ready()

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        """The cluster, started; every member stopped after."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def health_status(address: str, server: str, service: str = "", timeout: float = 1.0, secure: bool = True) -> int:
    """The gRPC health status of ``server`` (the component's name) at ``address``; -1 if unreachable.

    ``secure=False`` asks a service started with --insecure, in plaintext.
    """
    with sync_channel(address, server) if secure else grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return -1
        return int(resp.status)


class Metrics:
    """One scrape of a service's Prometheus endpoint."""

    def __init__(self, text: str) -> None:
        self.samples = [
            (sample.name, sample.labels, float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def get(self, name: str, **labels: str) -> float:
        """The sum of the samples ``name`` whose labels include ``labels`` (0 when there are none)."""
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample ``name``, by its sorted labels."""
        return {tuple(sorted(have.items())): value for sample, have, value in self.samples if sample == name}


def scrape(port: int) -> Metrics:
    """GET /metrics on the loopback ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return Metrics(resp.read().decode())


def datapath_flags(policy: str, ipam: str, state_dir: Path, bpffs: str) -> list[str]:
    """A datapath's flags naming its upstreams (PolicyService's and IPAMService's addresses), its
    state directory and its folder of the BPF file system."""
    return ["--policy-address", policy, "--ipam-address", ipam, "--state-dir", str(state_dir), "--bpffs", bpffs]


class ServiceProcess:
    """A Palisade service run as ``python -m services.<name>`` with its own ports."""

    def __init__(self, name: str, log_dir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.grpc_port = free_port()
        self.metrics_port = free_port()
        self.args = args
        self.env = env or {}
        self.log_path = log_dir / f"{name}-{self.grpc_port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, wait: bool = True, timeout: float = 30.0) -> None:
        cmd = [
            sys.executable,
            "-m",
            f"services.{self.name}",
            "--grpc-listen",
            self.address,
            "--metrics-listen",
            f"127.0.0.1:{self.metrics_port}",
            *self.args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PALISADE_TLS_DIR": str(pki()), **self.env},
        )
        log.close()
        if wait:
            self.wait_serving(timeout)

    def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.logs()[-3000:]}")
            if (
                health_status(self.address, self.name, secure="--insecure" not in self.args)
                == health_pb2.HealthCheckResponse.SERVING
            ):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not SERVING after {timeout}s:\n{self.logs()[-3000:]}")

    def metrics(self) -> Metrics:
        return scrape(self.metrics_port)

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def terminate(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def is_root() -> bool:
    return os.geteuid() == 0


def bcc_problem() -> str | None:
    """Why the BPF tests cannot run here (None: they can), with what to do about it."""
    if not is_root():
        return "needs root to load BPF programs (run `make test` as root)"
    try:
        import bcc  # noqa: F401
    except Exception as exc:  # ImportError, or libbcc missing
        return f"bcc is not importable ({exc}); `make setup` installs python3-bpfcc"
    if not Path(f"/lib/modules/{os.uname().release}/build").exists():
        return "no kernel headers at /lib/modules/$(uname -r)/build; `make setup` links them"
    return None
