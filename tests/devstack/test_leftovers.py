"""A killed test run's leftovers are removed before the next run, and only when no run is alive."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import leftovers

pytestmark = pytest.mark.root


def test_the_sweep_removes_a_killed_runs_namespaces_links_pins_and_processes(tmp_path: Path) -> None:
    tag = secrets.token_hex(3)
    netns = f"pal_{tag}_a"
    link = f"pb{tag}9"
    pins = Path(f"/sys/fs/bpf/palisade-{tag}")
    subprocess.run(["ip", "netns", "add", netns], check=True)
    subprocess.run(["ip", "link", "add", link, "type", "bridge"], check=True)
    pins.mkdir()
    assert str(tmp_path).startswith(leftovers.TEST_TMP)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    orphan = subprocess.Popen([*sleeper, str(tmp_path / tag)])
    other = subprocess.Popen([*sleeper, str(tmp_path / "another-run")])
    try:
        for proc in (orphan, other):  # until each has exec'd (before, its command line is ours)
            while str(tmp_path).encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                os.sched_yield()
        swept = leftovers.sweep(only=tag)
        assert swept.netns == [netns] and swept.links == [link] and swept.pins == [pins.name]
        assert swept.processes == [orphan.pid]
        assert orphan.wait(timeout=10) == -9
        assert other.poll() is None, "a process without the name was killed"
        assert not Path(f"/run/netns/{netns}").exists() and not pins.exists()
        assert subprocess.run(["ip", "link", "show", link], capture_output=True).returncode != 0
    finally:
        other.kill()
        orphan.kill()
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", link], capture_output=True)
        if pins.exists():
            pins.rmdir()


def test_a_run_starting_while_another_is_alive_sweeps_nothing(tmp_path: Path) -> None:
    # This session holds the lock shared (tests/conftest.py), as every live run does.
    code = "from testkit import leftovers; h, swept = leftovers.hold_lock(); print(swept is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.stdout.strip() == "True", out.stderr
