"""What a test run that was killed left in the kernel, removed before the next run starts.

Every run removes what it made when it ends; a run that is killed (a timeout, a closed
terminal) cannot. Its pods' namespaces keep their global names (``pal_x_a``), its dev nodes
keep the dev subnet's addresses and its orphaned servers keep running, so the next run
collides with them ("network namespace pal_x_a already exists"; a node address answered by
a dead stack's router).

Every run holds the machine's test lock shared for its whole life; a run sweeps only when it
can take the lock exclusively, that is when no other run is alive, then keeps it shared. A dev
stack or benchmark started outside pytest holds it shared too (``flock -s LOCK_PATH cmd``).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

LOCK_PATH = Path("/run/lock/palisade-tests.lock")

#: Namespaces the tests and dev stacks name: pods (``pal_<ns>_<pod>``), dev nodes and routers
#: (``pal-<tag>-...``), the datapath tests' pods (``pt<4 hex><letter>``).
NETNS = re.compile(r"^(pal_|pal-|pt[0-9a-f]{4}[a-z]$)")
#: Root-namespace links of dev stacks: bridges and node/router legs (``pb``/``pn``/``pr`` + tag).
LINKS = re.compile(r"^p[bnr][0-9a-f]{6}\d+$")
#: Pin directories of test runs (never the default ``/sys/fs/bpf/palisade`` of ``make run``).
BPFFS = re.compile(r"^palisade-.+")
#: Processes of a test run carry its pytest temporary folder on their command line.
TEST_TMP = "/tmp/pytest-of-"


@dataclass
class Swept:
    processes: list[int] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    pins: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.netns or self.links or self.pins)

    def __str__(self) -> str:
        parts = [
            f"{len(self.processes)} processes",
            f"namespaces {' '.join(self.netns) or '-'}",
            f"links {' '.join(self.links) or '-'}",
            f"pin folders {' '.join(self.pins) or '-'}",
        ]
        return "; ".join(parts)


def hold_lock() -> tuple[IO[str], Swept | None]:
    """The machine's test lock, held shared until the file is closed, and what was swept.

    None for what was swept: another run is alive, so nothing was touched.
    """
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    handle = LOCK_PATH.open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fcntl.flock(handle, fcntl.LOCK_SH)  # waits only while a starting run sweeps
        return handle, None
    try:
        swept = sweep()
    finally:
        fcntl.flock(handle, fcntl.LOCK_SH)
    return handle, swept


def _orphans(own: int, only: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(TEST_TMP.encode() in a for a in args) and any(only.encode() in a for a in args):
            pids.append(int(entry.name))
    return pids


def sweep(only: str = "") -> Swept:
    """Remove a killed run's processes, namespaces, links and pins; only with the lock held exclusively.

    ``only``: just what has this in its name (its command line, for processes).
    """
    swept = Swept()
    for pid in _orphans(os.getpid(), only):
        try:
            os.kill(pid, signal.SIGKILL)
            swept.processes.append(pid)
        except ProcessLookupError:
            pass
    netns_dir = Path("/run/netns")
    for name in sorted(os.listdir(netns_dir)) if netns_dir.is_dir() else []:
        if NETNS.match(name) and only in name:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            swept.netns.append(name)
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        if LINKS.match(name) and only in name:
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
            swept.links.append(name)
    bpffs = Path("/sys/fs/bpf")
    for entry in sorted(bpffs.iterdir()) if bpffs.is_dir() else []:
        if entry.is_dir() and BPFFS.match(entry.name) and only in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
            swept.pins.append(entry.name)
    return swept
