"""deploy/compose's certificates, without an engine: each container reads its own and no other key.

The tls-init service's script is run as compose runs it (as root, into a fresh directory),
then each container's view is recreated: its trust mount's source directory, read as the
user the container runs as, from inside (the mount is the container's root of it; nothing
above it is reachable there).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.common.trust import Owner
from testkit.harness import BIN
from tests.deploy.manifests import COMPOSE_FILE, DOCKERFILE, compose_mounts, image_of, load_yaml

TRUST_TARGET = "/etc/palisade/tls"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="tls-init gives files to uid 10001 with chown, which needs root"
)


@dataclass(frozen=True)
class Container:
    service: str
    owner: Owner
    bundle: Path
    #: Keys its health check presents besides its own (etcd's: ipam's, the one client etcd admits).
    health_keys: frozenset[str]


def _image_user() -> Owner:
    users = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER ")]
    return Owner.parse(users[-1])


def _health_keys(svc: dict[str, Any], service: str) -> frozenset[str]:
    test = " ".join(str(a) for a in (svc.get("healthcheck") or {}).get("test", []))
    return frozenset(m for m in re.findall(rf"{TRUST_TARGET}/(\w+)\.key", test) if m != service)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return dict(load_yaml(COMPOSE_FILE)["services"])


@pytest.fixture(scope="module")
def tls_dir(services: dict[str, dict[str, Any]]) -> Iterator[Path]:
    """The directory compose mounts at tls-init's /tls, after tls-init's script ran."""
    init = services["tls-init"]
    assert init["command"][:2] == ["sh", "-c"], init["command"]
    assert compose_mounts(init)["/tls"]["source"] == "./tls"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tls"
        script = re.sub(r"(?<![\w/])/tls\b", str(root), init["command"][2])
        env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
        result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        yield root


def _containers(services: dict[str, dict[str, Any]], tls_dir: Path) -> list[Container]:
    out = []
    for name, svc in services.items():
        mount = compose_mounts(svc).get(TRUST_TARGET)
        if mount is None:
            continue
        source = str(mount["source"])
        assert source.startswith("./tls"), f"{name} mounts {source} as its trust directory"
        if "user" in svc:
            owner = Owner.parse(str(svc["user"]))
        elif image_of(svc).startswith("palisade:"):
            owner = _image_user()
        else:
            owner = Owner(0, 0)  # the NATS and etcd images run as root
        out.append(Container(name, owner, tls_dir / source.removeprefix("./tls").lstrip("/"), _health_keys(svc, name)))
    return out


# Runs as the container's user with the bundle as its working directory (set before the
# switch, as a mount's root would be): which of the named files it can read. A shell, not
# this interpreter: the container's user need not reach the test's Python.
_READER = 'for f; do if cat -- "$f" >/dev/null 2>&1; then echo "$f 1"; else echo "$f 0"; fi; done'


def _readable_as(owner: Owner, directory: Path, files: list[str]) -> dict[str, bool]:
    result = subprocess.run(
        ["/bin/sh", "-c", _READER, "reader", *files],
        cwd=directory,
        user=owner.uid,
        group=owner.gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    readable = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    assert set(readable) == set(files), result.stdout
    return {f: ok == "1" for f, ok in readable.items()}


def test_every_service_that_speaks_tls_has_a_bundle(services: dict[str, dict[str, Any]], tls_dir: Path) -> None:
    names = {c.service for c in _containers(services, tls_dir)}
    assert names == {"watcher", "policy", "ipam", "datapath", "nats", "etcd", "devnode"}


def test_each_container_reads_the_ca_and_its_own_pair_as_its_user(
    services: dict[str, dict[str, Any]], tls_dir: Path
) -> None:
    for c in _containers(services, tls_dir):
        assert c.bundle.is_dir(), f"{c.service}: tls-init made no {c.bundle}"
        wanted = ["ca.crt", f"{c.service}.crt", f"{c.service}.key"]
        readable = _readable_as(c.owner, c.bundle, wanted)
        unreadable = [f for f, ok in readable.items() if not ok]
        assert not unreadable, f"{c.service} as {c.owner}: cannot read {unreadable}"


def test_each_container_holds_no_other_key(services: dict[str, dict[str, Any]], tls_dir: Path) -> None:
    for c in _containers(services, tls_dir):
        keys = {p.stem for p in c.bundle.glob("*.key")}
        assert keys == {c.service} | c.health_keys, f"{c.service} holds keys {sorted(keys)}"
        assert "ca" not in keys
    unprivileged = [c for c in _containers(services, tls_dir) if c.owner.uid != 0]
    assert {c.service for c in unprivileged} == {"watcher", "policy", "ipam"}
    assert all(not c.health_keys for c in unprivileged)


def test_keys_are_owner_only_and_belong_to_the_container_user(
    services: dict[str, dict[str, Any]], tls_dir: Path
) -> None:
    for c in _containers(services, tls_dir):
        for key in c.bundle.glob("*.key"):
            st = key.stat()
            assert (st.st_uid, st.st_gid) == (c.owner.uid, c.owner.gid), f"{key}: {st.st_uid}:{st.st_gid}"
            assert stat.S_IMODE(st.st_mode) & 0o077 == 0, f"{key}: mode {stat.S_IMODE(st.st_mode):o}"
    # The full set (with the CA's key) stays root's and owner-only: only the host's CLI reads it.
    assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((tls_dir / "ca.key").stat().st_mode) == 0o600


def test_another_uid_reads_no_key_of_a_bundle(services: dict[str, dict[str, Any]], tls_dir: Path) -> None:
    for c in _containers(services, tls_dir):
        stranger = Owner(c.owner.uid + 1, c.owner.gid + 1)
        readable = _readable_as(stranger, c.bundle, [f"{c.service}.key"])
        assert not any(readable.values()), f"{c.service}'s key is readable by uid {stranger.uid}"


def test_bundles_follow_a_rerun_and_drop_keys_they_no_longer_name(
    services: dict[str, dict[str, Any]], tls_dir: Path
) -> None:
    """tls-init runs on every `up`: a stray key in a bundle (an older layout's) is removed."""
    stray = tls_dir / "watcher" / "policy.key"
    stray.write_bytes((tls_dir / "policy.key").read_bytes())
    script = re.sub(r"(?<![\w/])/tls\b", str(tls_dir), services["tls-init"]["command"][2])
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not stray.exists()
    assert (tls_dir / "watcher" / "watcher.key").read_bytes() == (tls_dir / "watcher.key").read_bytes()
