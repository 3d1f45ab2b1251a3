"""The CLI's certificate: found without flags on a `make run` machine, and a clear error without one."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import client
from services.cli.client import CLIError
from testkit.harness import ROOT, free_port, pki


def palisade(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(tls_dir=kw.get("tls_dir"), insecure=kw.get("insecure"))


def test_the_run_directory_is_found_without_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PALISADE_TLS_DIR", raising=False)
    monkeypatch.setattr(client, "RUN_TLS_DIR", pki())
    monkeypatch.setattr(client, "SYSTEM_TLS_DIR", tmp_path / "none")
    found = client.credentials(_args())
    assert found is not None and found.directory == pki() and found.name == "cli"


def test_flag_over_environment_over_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(client, "RUN_TLS_DIR", tmp_path / "none")
    monkeypatch.setenv("PALISADE_TLS_DIR", str(tmp_path / "from-env"))
    with pytest.raises(CLIError, match="from-env"):
        client.credentials(_args())
    found = client.credentials(_args(tls_dir=str(pki())))
    assert found is not None and found.directory == pki()
    assert client.credentials(_args(insecure=True)) is None


def test_without_a_certificate_the_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PALISADE_TLS_DIR", raising=False)
    monkeypatch.setattr(client, "RUN_TLS_DIR", tmp_path / "run-tls")
    monkeypatch.setattr(client, "SYSTEM_TLS_DIR", tmp_path / "etc-tls")
    with pytest.raises(CLIError) as err:
        client.credentials(_args())
    message = str(err.value)
    assert "make run" in message and "--tls-dir" in message and "PALISADE_TLS_DIR" in message
    assert "palisade tls init" in message


def test_a_command_against_a_directory_without_the_cli_certificate_fails_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PALISADE_TLS_DIR": str(tmp_path)}
    out = palisade("status", "--policy-address", f"127.0.0.1:{free_port()}", env=env)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"no ca.crt in {tmp_path}" in lines[0] and "palisade tls init" in lines[0]


def test_tls_init_makes_owner_only_files_and_keeps_them(tmp_path: Path) -> None:
    target = tmp_path / "tls"
    first = palisade("tls", "init", "--dir", str(target), env=dict(os.environ))
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    keys = sorted(target.glob("*.key"))
    assert {k.stem for k in keys} >= {"ca", "cli", "policy", "ipam", "datapath", "watcher", "nats", "etcd"}
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)
    ca = (target / "ca.crt").read_bytes()
    cli = (target / "cli.crt").read_bytes()
    again = palisade("tls", "init", "--dir", str(target), env=dict(os.environ))
    assert again.returncode == 0
    assert (target / "ca.crt").read_bytes() == ca and (target / "cli.crt").read_bytes() == cli
    bad = palisade("tls", "init", "--dir", str(target), "--component", "kubelet", env=dict(os.environ))
    assert bad.returncode == 2 and "kubelet" in bad.stdout + bad.stderr


def test_tls_bundle_rejects_what_it_cannot_do_and_names_it(tmp_path: Path) -> None:
    env = {**os.environ}
    init = palisade("tls", "init", "--dir", str(tmp_path / "tls"), "--component", "watcher", env=env)
    assert init.returncode == 0, init.stderr
    bad_owner = palisade(
        "tls", "bundle", "--dir", str(tmp_path / "tls"), "--component", "watcher", "--owner", "palisade", env=env
    )
    assert bad_owner.returncode == 2 and "--owner" in bad_owner.stderr and "UID[:GID]" in bad_owner.stderr
    unknown = palisade("tls", "bundle", "--dir", str(tmp_path / "tls"), "--component", "web", "--owner", "1", env=env)
    assert unknown.returncode == 2 and "unknown component(s) web" in unknown.stderr
    missing = palisade("tls", "bundle", "--dir", str(tmp_path / "tls"), "--component", "ipam", "--owner", "1", env=env)
    assert missing.returncode == 1 and "no ipam.crt" in missing.stderr
    assert not (tmp_path / "tls" / "ipam").exists()
    made = palisade("tls", "bundle", "--dir", str(tmp_path / "tls"), "--component", "watcher", "--owner", "0", env=env)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (tmp_path / "tls" / "watcher").iterdir()) == ["ca.crt", "watcher.crt", "watcher.key"]
