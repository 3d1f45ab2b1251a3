"""deploy/: the image built and the compose stack started for real, driven from the host.

`make image` (scripts/image.sh) builds palisade:dev on the project's own engine
(scripts/engine.sh: Debian's dockerd on its own data root and socket), with local base,
NATS and etcd images where the public ones cannot be pulled; then docker-compose starts
deploy/compose/docker-compose.yml and the README walkthrough's commands run against it
from the host, and `down` must leave nothing on the host.

Cached: an image whose source digest matches is not rebuilt, and the engine keeps its
images between runs. Needs root (the engine, the datapath's BPF) or a DOCKER_HOST that
answers; skipped otherwise, saying which.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.datapath.endpoint import host_ifname, netns_name
from services.datapath.netns import NETNS_DIR
from testkit.harness import BIN, ROOT
from tests.deploy.engine import IMAGE, PROJECT, Engine
from tests.deploy.manifests import COMPOSE_FILE, load_yaml

pytestmark = [pytest.mark.timeout(3600)]

TLS_DIR = COMPOSE_FILE.parent / "tls"
BPFFS = Path("/sys/fs/bpf/palisade")
#: Up to all healthy: a bound, not an expectation (the datapath compiles its BPF first).
HEALTHY_WITHIN = 600.0
PROBE_MANIFESTS = ROOT / "tests" / "system" / "manifests" / "xyz.yaml"
PROBES = ["80/TCP", "81/UDP", "8080/TCP"]
CAPABILITIES_OVERRIDE = COMPOSE_FILE.parent / "docker-compose.capabilities.yml"
#: deploy/README.md's teardown: the datapath's own container cleans up after it.
TEARDOWN = ["run", "--rm", "--no-deps", "datapath", "python", "-m", "services.devstack.cleanup"]


def _in_image(engine: Engine, *command: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    args = ["docker", "run", "--rm", "--network", "none"]
    if user:
        args += ["--user", user]
    return engine.run(*args, IMAGE, *command, check=False, timeout=120)


def test_the_image_runs_bcc_from_its_interpreter(engine: Engine, image: str) -> None:
    result = _in_image(engine, "python", "-c", "import bcc, sys; print(sys.executable, bcc.__file__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("/opt/palisade/bin/python")


def test_the_image_holds_the_cli_the_cni_plugin_and_the_health_check(engine: Engine, image: str) -> None:
    # One container for every check: each `docker run` copies the image's layers on this engine.
    script = (
        "palisade --help >/dev/null && echo cli-ok; "
        "palisade-healthcheck --help >/dev/null && echo health-ok; "
        "palisade-cni 2>&1; echo; "
        "echo uid=$(id -u)"
    )
    result = _in_image(engine, "sh", "-c", script)
    out = result.stdout.splitlines()
    assert "cli-ok" in out and "health-ok" in out, result.stdout + result.stderr
    # palisade-cni speaks the CNI protocol: without CNI_COMMAND it says so (and does not crash).
    assert "CNI_COMMAND" in result.stdout, result.stdout + result.stderr
    assert "uid=10001" in out, result.stdout


def test_the_nats_and_etcd_images_compose_runs_are_there(engine: Engine, image: str) -> None:
    env_file = COMPOSE_FILE.parent / ".env"
    if env_file.exists():
        images = dict(
            line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#")
        )
        for key in ("PALISADE_NATS_IMAGE", "PALISADE_ETCD_IMAGE", "PALISADE_IMAGE"):
            assert engine.run("docker", "image", "inspect", images[key], check=False).returncode == 0, key


# ---------------------------------------------------------------------------
# the compose stack


#: Capability numbers as the kernel counts them (linux/capability.h), for CapBnd.
CAPABILITIES = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
]


def missing_capabilities() -> list[str]:
    """The capabilities this kernel knows that this machine's bounding set lacks (a container can't have them)."""
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    bounding = int(status["CapBnd"], 16)
    return [CAPABILITIES[bit] for bit in range(min(last + 1, len(CAPABILITIES))) if not bounding >> bit & 1]


def compose_files() -> list[str]:
    """The compose file, and deploy/README.md's override where the datapath cannot be privileged."""
    files = ["-f", str(COMPOSE_FILE)]
    missing = missing_capabilities()
    if missing:
        files += ["-f", str(CAPABILITIES_OVERRIDE)]
    return files


def _compose(engine: Engine, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = ["docker-compose", "-p", PROJECT, *compose_files(), *args]
    missing = missing_capabilities()
    env = {**engine.env(), **isolation(), **({"PALISADE_MISSING_CAPS": missing[0]} if missing else {})}
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{' '.join(command)}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def _isolated_examples() -> Path:
    """The examples with namespaces of their own (cshop, ctools), for the stack's watcher.

    A dev-node pod's network namespace and host veth are named after its namespace and name,
    and its address is routed on the host: another Palisade on this machine (a `make run`, a
    test's stack) serving the examples would share them. Same files otherwise.
    """
    folder = Path(tempfile.mkdtemp(prefix="palisade-compose-examples-"))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        text = re.sub(r"\b(shop|tools)\b", r"c\1", path.read_text())
        (folder / path.name).write_text(text)
        (folder / path.name).chmod(0o644)
    folder.chmod(0o755)  # the watcher reads it as uid 10001
    return folder


@functools.cache
def isolation() -> dict[str, str]:
    """What the test's stack runs with besides the defaults: its own examples and pod range."""
    return {"PALISADE_MANIFESTS_DIR": str(_isolated_examples()), "PALISADE_CLUSTER_CIDRS": "10.250.0.0/16"}


def _bpffs_shared() -> None:
    """deploy/README.md's host requirement: /sys/fs/bpf a shared mount (the datapath's mount is rshared)."""
    found = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE,PROPAGATION", "/sys/fs/bpf"], capture_output=True, text=True
    ).stdout.split()
    if not found:
        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
    if "shared" not in found:
        subprocess.run(["mount", "--make-shared", "/sys/fs/bpf"], check=True)


def _health(engine: Engine) -> dict[str, str]:
    """Service -> health status (or state, for containers without a health check)."""
    ids = _compose(engine, "ps", "-q").stdout.split()
    if not ids:
        return {}
    out = engine.run("docker", "inspect", *ids).stdout
    status = {}
    for c in json.loads(out):
        service = c["Config"]["Labels"]["com.docker.compose.service"]
        state = c["State"]
        status[service] = state["Health"]["Status"] if state.get("Health") else state["Status"]
    return status


def _probe_manifests() -> str:
    """The system tests' file with namespaces of its own (cpx, cpy): pods named as another stack's on
    this host would share their network namespaces and veths."""
    return re.sub(r"\bp([xy])\b", r"cp\1", PROBE_MANIFESTS.read_text())


def _probe_pods() -> list[tuple[str, str]]:
    docs = [d for d in yaml.safe_load_all(_probe_manifests()) if d and d.get("kind") == "Pod"]
    return [(d["metadata"].get("namespace", "default"), d["metadata"]["name"]) for d in docs]


def _pod_objects(key: str) -> list[str]:
    """The host objects of a dev-node pod that exist now: its network namespace and host veth."""
    namespace, pod = key.split("/")
    found = []
    netns = Path(NETNS_DIR) / netns_name(namespace, pod)
    if netns.exists():
        found.append(f"netns {netns.name}")
    if Path("/sys/class/net", host_ifname(namespace, pod)).exists():
        found.append(f"veth {host_ifname(namespace, pod)}")
    return found


def _leftovers(engine: Engine, pods: set[str]) -> list[str]:
    """What the stack could leave on the host: pins, its pods' namespaces and veths (with their tc
    programs), compose containers, networks and volumes."""
    found = [f"pinned {p}" for p in BPFFS.rglob("*")] if BPFFS.exists() else []
    if BPFFS.exists():
        found.append(f"directory {BPFFS}")
    for key in sorted(pods):
        found += _pod_objects(key)
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in ("container", "network", "volume"):
        listed = engine.run("docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label)
        found += [f"{kind} {name}" for name in listed.stdout.split()]
    return found


@dataclass(frozen=True)
class Stack:
    engine: Engine
    started_in: float
    #: Every pod the stack's datapath was seen to hold (what teardown must remove).
    made: set[str]

    def palisade_env(self) -> dict[str, str]:
        """The CLI on the host: the installation's certificates, the ports compose publishes."""
        return {
            **os.environ,
            "PALISADE_TLS_DIR": str(TLS_DIR),
            "PALISADE_WATCHER_ADDRESS": "127.0.0.1:9401",
            "PALISADE_POLICY_ADDRESS": "127.0.0.1:9402",
            "PALISADE_IPAM_ADDRESS": "127.0.0.1:9403",
            "PALISADE_DATAPATH_ADDRESS": "127.0.0.1:9404",
        }

    def palisade(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "palisade"), *args],
            env=self.palisade_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def stack(engine: Engine, image: str) -> Iterator[Stack]:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is missing: `make setup` installs Debian's docker-compose")
    missing = missing_capabilities()
    if len(missing) > 1:
        pytest.fail(f"this machine cannot give containers {', '.join(missing)}: the override drops only one")
    _bpffs_shared()
    _compose(engine, "down", "-v", "--remove-orphans")
    started = time.monotonic()
    _compose(engine, "up", "-d", "--no-build")
    services = set(load_yaml(COMPOSE_FILE)["services"]) - {"tls-init"}
    try:
        while True:
            health = _health(engine)
            # "running": a container without a health check (the devnode).
            if all(health.get(s) in ("healthy", "running") for s in services):
                break
            broken = {s: h for s, h in health.items() if s in services and h in ("unhealthy", "exited", "dead")}
            if broken or time.monotonic() - started > HEALTHY_WITHIN:
                logs = _compose(engine, "logs", "--no-color", "--tail", "40", check=False).stdout
                pytest.fail(f"the stack is not healthy: {health}\n{logs[-6000:]}")
            time.sleep(2)
        elapsed = time.monotonic() - started
        print(f"compose stack healthy {elapsed:.1f} s after up")
        yield Stack(engine, elapsed, set())
    finally:  # the teardown test's steps again: no-ops when it ran
        _compose(engine, "stop", "devnode", check=False)
        _compose(engine, "stop", "datapath", check=False)
        _compose(engine, *TEARDOWN, check=False)
        _compose(engine, "down", "-v", "--remove-orphans", check=False)
        shutil.rmtree(isolation()["PALISADE_MANIFESTS_DIR"], ignore_errors=True)


def test_every_service_becomes_healthy(stack: Stack) -> None:
    health = _health(stack.engine)
    for service in ("nats", "etcd", "watcher", "policy", "ipam", "datapath"):
        assert health.get(service) == "healthy", health
    assert health.get("devnode") == "running", health
    assert health.get("dns-proxy") == "running", health  # no health endpoint: it serves or exits
    assert health.get("tls-init") == "exited"


#: The Pods of examples/ (in the stack's copy, see manifests()), all placed on dev-node.
EXAMPLE_PODS = {"cshop/frontend", "cshop/backend", "cshop/db", "ctools/debug"}


def _endpoints(stack: Stack) -> set[str]:
    listed = stack.palisade("endpoint", "list", "-o", "json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    found = {f"{e['namespace']}/{e['pod']}" for e in json.loads(listed.stdout)["endpoints"]}
    stack.made.update(found)
    return found


def test_the_devnode_makes_the_walkthrough_pods(stack: Stack) -> None:
    deadline = time.monotonic() + 120
    while not _endpoints(stack) >= EXAMPLE_PODS:
        if time.monotonic() > deadline:
            logs = _compose(stack.engine, "logs", "--no-color", "--tail", "60", "devnode", "datapath", check=False)
            pytest.fail(f"the devnode made {sorted(_endpoints(stack))} of {sorted(EXAMPLE_PODS)}\n{logs.stdout}")
        time.sleep(1)
    policy = stack.palisade("bpf", "policy", "get", "cshop/db")
    assert policy.returncode == 0, policy.stdout + policy.stderr


def test_status_from_the_host_shows_every_service(stack: Stack) -> None:
    result = stack.palisade("status")
    assert result.returncode == 0, result.stdout + result.stderr
    for service in ("watcher", "policy", "ipam", "datapath"):
        assert service in result.stdout


def test_policy_get_and_trace_from_the_host(stack: Stack) -> None:
    got = stack.palisade("policy", "get")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "cshop" in got.stdout
    trace = stack.palisade("policy", "trace", "--src", "ctools/debug", "--dst", "cshop/db", "--port", "5432")
    # As in the walkthrough: denied by the clusterwide ingressDeny (a denied trace exits 1).
    assert trace.returncode == 1, trace.stdout + trace.stderr
    assert "Final verdict: DENIED" in trace.stdout
    assert "CiliumClusterwideNetworkPolicy no-ctools-to-data: spec.ingressDeny[0] (DENY)" in trace.stdout
    allowed = stack.palisade("policy", "trace", "--src", "cshop/backend", "--dst", "cshop/db", "--port", "5432")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def _matrices(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(result.stdout)
    return {f"{p['port']}/{p['protocol']}": p["matrix"] for p in payload["probes"]}


def test_probe_from_the_host_enforces_what_analyze_says_and_observe_sees_the_drops(
    stack: Stack, tmp_path: Path
) -> None:
    """Pods made on the host by the stack's datapath: real packets, judged by its programs."""
    manifests = tmp_path / "cxyz.yaml"
    manifests.write_text(_probe_manifests())
    # The system tests' file in namespaces cpx, cpy: the examples' policies (served by the stack's
    # watcher) do not select them, so analyze on the file alone says what the stack must enforce.
    files = ["-f", str(manifests), *(a for p in PROBES for a in ("--probe", p))]
    observe = subprocess.Popen(
        [str(BIN / "palisade"), "observe", "--verdict", "dropped", "--limit", "1"],
        env=stack.palisade_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stack.made.update(f"{ns}/{pod}" for ns, pod in _probe_pods())
        probed = stack.palisade("connectivity", "probe", *files, "-o", "json", timeout=900)
        analyzed = stack.palisade("analyze", *files, "-o", "json")
        expected = _matrices(analyzed)
        assert _matrices(probed) == expected
        cells = [v for m in expected.values() for row in m.values() for v in row.values()]  # type: ignore[attr-defined]
        assert True in cells and False in cells
        out, err = observe.communicate(timeout=120)
    finally:
        if observe.poll() is None:
            observe.kill()
            observe.wait()
    assert observe.returncode == 0, err
    assert "dropped" in out.lower(), out
    listed = stack.palisade("endpoint", "list")
    assert listed.returncode == 0, listed.stdout + listed.stderr


def test_teardown_and_down_leave_nothing_on_the_host(stack: Stack) -> None:
    """`down` keeps the datapath's pins (kernel state outlives a restart, as on a node); the
    documented teardown (deploy/README.md) removes them first, then `down -v` the rest."""
    assert BPFFS.is_dir(), "the stack's datapath pinned nothing"
    _compose(stack.engine, "stop", "devnode")  # removes its pods through the datapath
    _compose(stack.engine, "stop", "datapath")
    cleaned = _compose(stack.engine, *TEARDOWN)
    assert "nothing left behind" in cleaned.stdout, cleaned.stdout + cleaned.stderr
    _compose(stack.engine, "down", "-v", "--remove-orphans")
    assert _leftovers(stack.engine, stack.made) == []
