"""The datapath's check of its node: what is missing, in one line, with the fix."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from services.datapath import requirements
from services.datapath.requirements import NodeFacts, RequirementsError, check_node, mount_type, problems
from testkit.harness import ROOT, is_root

GOOD = NodeFacts(
    kernel_release="6.1.0-18-amd64",
    bpffs_type="bpf",
    bpffs="/sys/fs/bpf/palisade",
    headers="/lib/modules/6.1.0-18-amd64/build",
    kheaders_archive=False,
    kernel_config={name: "y" for name in requirements.REQUIRED_OPTIONS},
)


def _with(**changes: object) -> NodeFacts:
    values = {**GOOD.__dict__, **changes}
    return NodeFacts(**values)


def test_a_good_node_has_no_problems() -> None:
    assert problems(GOOD) == []
    # Headers from the kernel's own archive are as good as a headers package.
    assert problems(_with(headers="", kheaders_archive=True)) == []
    # A configuration that cannot be read is not checked (most distributions ship one; some do not).
    assert problems(_with(kernel_config=None)) == []


@pytest.mark.parametrize(
    ("facts", "missing", "fix"),
    [
        (_with(kernel_release="5.4.0-150-generic"), "older than 5.11", "5.11 or newer"),
        (_with(bpffs_type="tmpfs"), "on a tmpfs file system, not the BPF file system", "mount -t bpf bpf /sys/fs/bpf"),
        (_with(bpffs_type=""), "no file system", "Bidirectional"),
        (_with(headers=""), "no kernel headers for 6.1.0-18-amd64", "linux-headers-6.1.0-18-amd64"),
        (_with(headers=""), "no kernel headers", "CONFIG_IKHEADERS"),
        (_with(kernel_config={"CONFIG_BPF_SYSCALL": "y"}), "CONFIG_NET_CLS_BPF (tc BPF classifier)", "kernel built"),
    ],
)
def test_each_missing_requirement_is_named_with_its_fix(facts: NodeFacts, missing: str, fix: str) -> None:
    (problem,) = problems(facts)
    assert missing in problem.missing
    assert fix in problem.fix


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw
33 25 0:29 / /sys/fs/bpf rw,nosuid shared:14 - bpf bpf rw,mode=700
40 22 0:35 / /tmp rw shared:20 - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/sys/fs/bpf/palisade", "bpf"),  # need not exist yet: its mount decides
        ("/sys/fs/bpf", "bpf"),
        ("/sys/fs/bpfx", "sysfs"),  # a prefix of a name is not a parent
        ("/tmp/pins", "tmpfs"),
        ("/var/run/palisade", "ext4"),
    ],
)
def test_the_pin_directory_is_judged_by_the_mount_holding_it(path: str, kind: str) -> None:
    assert mount_type(path, MOUNTINFO) == kind


def _kheaders_archive(path: Path) -> None:
    with tarfile.open(path, "w:xz") as tar:
        data = b"#define LINUX_VERSION_CODE 1\n"
        info = tarfile.TarInfo("include/generated/uapi/linux/version.h")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_headers_from_the_kernels_archive_are_unpacked_for_bcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A node with no headers package (an empty /lib/modules) whose kernel offers kheaders.tar.xz.
    archive = tmp_path / "kheaders.tar.xz"
    _kheaders_archive(archive)
    modules = tmp_path / "modules"
    modules.mkdir()
    monkeypatch.setenv(requirements.HEADERS_ENV, "")
    bpf_dir = "/sys/fs/bpf/palisade-requirements-test"
    if mount_type(bpf_dir, Path("/proc/self/mountinfo").read_text()) != "bpf":
        pytest.skip("/sys/fs/bpf is not a BPF file system on this machine")
    facts = check_node(bpf_dir, tmp_path / "state", archive=archive, modules=modules)
    assert facts.kheaders_archive and not facts.headers
    tree = Path(os.environ[requirements.HEADERS_ENV])
    assert tree.is_relative_to(tmp_path / "state")
    assert (tree / "include/generated/uapi/linux/version.h").read_text().startswith("#define")
    # Without the archive either, the check refuses with the fix.
    monkeypatch.setenv(requirements.HEADERS_ENV, "")
    with pytest.raises(RequirementsError, match=r"no kernel headers.*CONFIG_IKHEADERS"):
        check_node(bpf_dir, tmp_path / "state", archive=tmp_path / "absent.tar.xz", modules=modules)


@pytest.mark.skipif(not is_root(), reason="needs root (the datapath opens BPF maps)")
def test_a_datapath_on_a_node_without_a_bpf_file_system_says_so_in_one_line(tmp_path: Path) -> None:
    pins = tmp_path / "not-bpffs"
    out = subprocess.run(
        [sys.executable, "-m", "services.datapath", "--bpffs", str(pins), "--state-dir", str(tmp_path / "state"),
         "--grpc-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--nats-url", "nats://127.0.0.1:1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, out.stderr
    assert "not the BPF file system" in lines[0] and "mount -t bpf bpf /sys/fs/bpf" in lines[0]
    assert not pins.exists(), "nothing was pinned on the wrong file system"
