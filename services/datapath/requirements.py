"""What a node must give the datapath, checked once at start.

The datapath compiles its BPF program with bcc against the running kernel's headers,
pins maps in the BPF file system and attaches with tc; a node without one of these would
otherwise fail deep inside bcc or the loader with a message that names neither the
problem nor its fix. :func:`check_node` looks first and raises :class:`RequirementsError`,
one line naming everything missing and how to fix each (deploy/README.md lists the same).

The evaluation (:func:`problems`) is pure: it takes :class:`NodeFacts`, which
:func:`gather` reads from the node. Kernel headers may come from three places, in bcc's
order: ``BCC_KERNEL_SOURCE``, ``/lib/modules/<release>/build`` (or ``source``), or the
kernel's own archive ``/sys/kernel/kheaders.tar.xz`` (``CONFIG_IKHEADERS``; the
``kheaders`` module is loaded when it is one), which :func:`check_node` unpacks into the
datapath's state directory and hands to bcc through ``BCC_KERNEL_SOURCE``, so nodes without
header packages (kind on many hosts, COS, Bottlerocket) need nothing installed.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from pathlib import Path

from services.common.log import get_logger
from services.common.retry import StartupError

log = get_logger("datapath")

#: The oldest kernel the program runs on: bpf_ktime_get_coarse_ns (5.11), bpf_redirect_peer
#: (5.10) and the BPF ring buffer (5.8).
MIN_KERNEL = (5, 11)
#: Kernel options the datapath cannot do without, when the node's configuration can be read.
REQUIRED_OPTIONS = {
    "CONFIG_BPF_SYSCALL": "BPF system call",
    "CONFIG_NET_CLS_BPF": "tc BPF classifier",
    "CONFIG_NET_SCH_INGRESS": "clsact qdisc",
    "CONFIG_NET_CLS_ACT": "tc actions",
}
BPF_FS_MAGIC_TYPE = "bpf"
KHEADERS_ARCHIVE = Path("/sys/kernel/kheaders.tar.xz")
HEADERS_ENV = "BCC_KERNEL_SOURCE"


class RequirementsError(StartupError):
    """The node lacks something the datapath needs; the message says what and how to fix it."""


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What the node offers, as :func:`gather` found it."""

    #: ``uname -r``.
    kernel_release: str
    #: The file-system type of the mount holding the pin directory ("" when none was found).
    bpffs_type: str
    #: The pin directory (as configured).
    bpffs: str
    #: A kernel headers tree found (BCC_KERNEL_SOURCE, /lib/modules/<release>/build or source), or "".
    headers: str
    #: Whether the kernel offers its headers as /sys/kernel/kheaders.tar.xz (after loading the module).
    kheaders_archive: bool
    #: The kernel's configuration (option -> value) when readable, else None (not checked).
    kernel_config: Mapping[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """One unmet requirement: what is missing, and how to fix it."""

    missing: str
    fix: str

    def __str__(self) -> str:
        return f"{self.missing} ({self.fix})"


def kernel_version(release: str) -> tuple[int, int] | None:
    """(major, minor) of a release string such as ``6.1.0-18-amd64``; None when it has none."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match[1]), int(match[2])) if match else None


def problems(facts: NodeFacts) -> list[Problem]:
    """Every requirement ``facts`` do not meet (pure)."""
    out: list[Problem] = []
    version = kernel_version(facts.kernel_release)
    if version is not None and version < MIN_KERNEL:
        out.append(
            Problem(
                f"kernel {facts.kernel_release} is older than {MIN_KERNEL[0]}.{MIN_KERNEL[1]}",
                "run the node on a kernel 5.11 or newer (the program uses bpf_ktime_get_coarse_ns and "
                "bpf_redirect_peer)",
            )
        )
    if facts.bpffs_type != BPF_FS_MAGIC_TYPE:
        where = f"a {facts.bpffs_type} file system" if facts.bpffs_type else "no file system"
        out.append(
            Problem(
                f"{facts.bpffs} is on {where}, not the BPF file system",
                "mount it on the node: `mount -t bpf bpf /sys/fs/bpf && mount --make-shared /sys/fs/bpf`, and "
                "give the datapath /sys/fs/bpf with Bidirectional propagation",
            )
        )
    if not facts.headers and not facts.kheaders_archive:
        out.append(
            Problem(
                f"no kernel headers for {facts.kernel_release}",
                f"install them on the node so /lib/modules/{facts.kernel_release}/build exists (Debian, Ubuntu: "
                f"`apt-get install linux-headers-{facts.kernel_release}`; Fedora, RHEL: kernel-devel) and mount "
                "/lib/modules and /usr/src into the datapath, or run a kernel built with CONFIG_IKHEADERS "
                f"(/sys/kernel/kheaders.tar.xz), or set {HEADERS_ENV} to a headers tree",
            )
        )
    if facts.kernel_config is not None:
        absent = [f"{name} ({what})" for name, what in REQUIRED_OPTIONS.items() if name not in facts.kernel_config]
        if absent:
            out.append(
                Problem(
                    f"the kernel lacks {', '.join(absent)}",
                    "use a kernel built with these options (every major distribution's is)",
                )
            )
    return out


# ---------------------------------------------------------------------------
# reading the node


def mount_type(path: str, mountinfo: str) -> str:
    """The type of the file system mounted at the longest mount point holding ``path``."""
    best, kind = "", ""
    target = os.path.normpath(path)
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best) and after:
            best, kind = point, after[0]
    return kind


def read_kernel_config(release: str, proc: Path = Path("/proc"), boot: Path = Path("/boot")) -> dict[str, str] | None:
    """The running kernel's configuration from /proc/config.gz or /boot/config-<release>; None if neither."""
    text = ""
    try:
        text = gzip.decompress((proc / "config.gz").read_bytes()).decode()
    except OSError:
        try:
            text = (boot / f"config-{release}").read_text()
        except OSError:
            return None
    out = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.startswith("CONFIG_") and value in ("y", "m"):
            out[name] = value
    return out


def headers_tree(release: str, env: Mapping[str, str], modules: Path = Path("/lib/modules")) -> str:
    """A kernel headers tree bcc would use, or ""."""
    candidates = [env[HEADERS_ENV]] if env.get(HEADERS_ENV) else []
    candidates += [str(modules / release / "build"), str(modules / release / "source")]
    for candidate in candidates:
        if (Path(candidate) / "include").is_dir():
            return candidate
    return ""


def load_kheaders(archive: Path, release: str, modules: Path = Path("/lib/modules")) -> bool:
    """Whether ``archive`` is there, loading the ``kheaders`` module first when the kernel has it as one."""
    if archive.is_file():
        return True
    if not any((modules / release).glob("kernel/kernel/kheaders.ko*")):
        return False
    modprobe = shutil.which("modprobe")
    if modprobe is not None:
        subprocess.run([modprobe, "kheaders"], capture_output=True, check=False, timeout=30)
    return archive.is_file()


def unpack_kheaders(archive: Path, into: Path) -> Path:
    """Unpack the kernel's headers archive into ``into`` (once: kept while the file is the same)."""
    stamp = into / ".archive-size"
    size = str(archive.stat().st_size)
    if stamp.is_file() and stamp.read_text() == size and (into / "include").is_dir():
        return into
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(into, filter="data")
    stamp.write_text(size)
    return into


def gather(
    bpffs: str,
    env: Mapping[str, str] | None = None,
    archive: Path = KHEADERS_ARCHIVE,
    modules: Path = Path("/lib/modules"),
) -> NodeFacts:
    """Read the node's facts (the pin directory need not exist yet: its nearest parent is judged)."""
    env = os.environ if env is None else env
    release = os.uname().release
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        mountinfo = ""
    headers = headers_tree(release, env, modules)
    return NodeFacts(
        kernel_release=release,
        bpffs_type=mount_type(bpffs, mountinfo),
        bpffs=bpffs,
        headers=headers,
        kheaders_archive=not headers and load_kheaders(archive, release, modules),
        kernel_config=read_kernel_config(release),
    )


def check_node(
    bpffs: str, work_dir: Path, archive: Path = KHEADERS_ARCHIVE, modules: Path = Path("/lib/modules")
) -> NodeFacts:
    """Check the node; RequirementsError (one line) when something is missing.

    Headers found only in the kernel's archive are unpacked under ``work_dir`` and given to bcc
    through ``BCC_KERNEL_SOURCE``.
    """
    facts = gather(bpffs, archive=archive, modules=modules)
    found = problems(facts)
    if found:
        raise RequirementsError(
            "this node cannot run the datapath: " + "; ".join(map(str, found)) + " (see deploy/README.md, "
            "'Node requirements')"
        )
    if not facts.headers:
        tree = unpack_kheaders(archive, work_dir / f"kheaders-{facts.kernel_release}")
        os.environ[HEADERS_ENV] = str(tree)
        log.info("kernel headers from the kernel's archive", archive=str(archive), into=str(tree))
    if facts.kernel_config is None:
        log.warning("kernel configuration not readable; kernel options not checked", release=facts.kernel_release)
    return facts
