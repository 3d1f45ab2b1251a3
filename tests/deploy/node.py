"""A Kubernetes node on this machine for the pod specs of deploy/kubernetes: containerd in a dev node's namespaces.

The node is a dev node of a `make run` stack (a network namespace on the stack's bridge,
made by ``--no-datapath``: the stack runs the control plane and no datapath) plus a mount
namespace of its own, in which containerd runs with CRI, as a node's runtime does:

- its host network is the dev node's network namespace (``hostNetwork`` pods share it);
- the node's own directories are per-test folders bound at the paths a real node has
  (``/opt/cni/bin``, ``/etc/cni/net.d``, ``/opt/palisade-cni``, ``/run/palisade``, and
  ``/sys/fs/bpf`` a directory of this machine's BPF file system), so that a manifest's
  ``hostPath`` volumes, the installed plugin and the conflist it names are used exactly as
  written; the rest (``/lib/modules``, ``/usr/src``, ``/run/netns``) is the machine's;
- ``/opt/cni/bin`` starts with the standard CNI plugins a node's distribution installs
  (containerd's CRI needs ``loopback``); nothing Palisade's is there until an installer puts it.

Images cannot be pulled here: the image `make image` built is saved once per image id
(cached under $PALISADE_CACHE) and imported under the name the manifests give.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from testkit import containerd
from testkit.containerd import CNI_PLUGINS, SANDBOX_IMAGE, build_pause_image, cri_config

#: Node paths that are the node's own (a per-test folder each), bound in its mount namespace.
NODE_DIRS = ("/opt/cni/bin", "/etc/cni/net.d", "/opt/palisade-cni", "/run/palisade")
BPFFS = "/sys/fs/bpf"


def normalized(image: str) -> str:
    """An image reference as containerd names it (docker.io/library/NAME:TAG)."""
    name, _, tag = image.partition(":")
    if "/" not in name:
        name = f"library/{name}"
    if "." not in name.split("/")[0] and ":" not in name.split("/")[0] and name.split("/")[0] != "localhost":
        name = f"docker.io/{name}"
    return f"{name}:{tag or 'latest'}"


@dataclass
class NodeRuntime:
    """containerd with CRI in a dev node's network namespace and a mount namespace holding the node's folders."""

    root: Path
    #: The dev node's network namespace (a name under /run/netns).
    netns: str
    #: The directory of this machine's BPF file system that is the node's /sys/fs/bpf.
    bpffs: Path
    proc: subprocess.Popen[bytes] | None = None
    _made: list[Path] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.root / "c.sock"

    @property
    def pid(self) -> int:
        """containerd's process: its namespaces are the node's."""
        assert self.proc is not None
        return self.proc.pid

    def host_view(self, node_path: str) -> Path:
        """Where a node path is for this process (outside the node's mount namespace)."""
        for own in (*NODE_DIRS, BPFFS):
            if node_path == own or node_path.startswith(own + "/"):
                base = self.bpffs if own == BPFFS else self.root / "node" / own.lstrip("/")
                return base / node_path[len(own) :].lstrip("/")
        return Path(node_path)

    def on_node(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        """Run a command in the node's network namespace (kubelet's network probes)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *command], capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.bpffs.mkdir(parents=True, exist_ok=True)
        binds = []
        for own in NODE_DIRS:
            source = self.root / "node" / own.lstrip("/")
            source.mkdir(parents=True, exist_ok=True)
            if not Path(own).exists():
                # The mount point; removed again at stop (a real node has these folders). Nodes
                # started side by side may race to make it.
                try:
                    Path(own).mkdir(parents=True)
                    self._made.append(Path(own))
                except FileExistsError:
                    pass
            binds.append(f"mount --bind {source} {own}")
        for plugin in CNI_PLUGINS.iterdir():
            (self.host_view("/opt/cni/bin") / plugin.name).symlink_to(plugin)
        config = cri_config(self.root, self.socket, "/opt/cni/bin", "/etc/cni/net.d")
        (self.root / "config.toml").write_text(config)
        # A private mount namespace: the binds stay the node's. The mounts a pod asks to share
        # both ways (Bidirectional) must be shared mounts, as on a node.
        script = " && ".join(
            [
                *binds,
                # Both the machine's mount and the node's on top of it: the runtime may check either.
                f"mount --make-shared {BPFFS}",
                f"mount --bind {self.bpffs} {BPFFS}",
                f"mount --make-shared {BPFFS}",
                "mount --make-shared /run/netns",
                f"exec containerd --config {self.root / 'config.toml'}",
            ]
        )
        self.proc = containerd.start_containerd(
            ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--propagation", "private",
             "sh", "-c", script],
            self.root, self.socket, 60,
        )  # fmt: skip
        self.ctr("images", "import", "--no-unpack", str(build_pause_image(self.root / "pause")))
        self.wait_image(SANDBOX_IMAGE)

    def ctr(self, *args: str, timeout: float = 600) -> None:
        done = subprocess.run(
            ["ctr", "-a", str(self.socket), "-n", "k8s.io", *args], capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {done.stdout}{done.stderr}")

    def import_image(self, archive: Path, saved_as: str, names: list[str]) -> None:
        """Import a `docker save` archive (of image ``saved_as``), unpacked, and tag it as each of ``names``."""
        self.ctr("images", "import", "--snapshotter", "native", str(archive))
        for name in names:
            if normalized(name) != normalized(saved_as):
                self.ctr("images", "tag", "--force", normalized(saved_as), normalized(name))
            self.wait_image(name)

    def wait_image(self, image: str) -> None:
        """Until the CRI plugin sees ``image`` (it learns of imports from events)."""
        containerd.wait_image(self.socket, image, 60)

    def log_tail(self, lines: int = 30) -> str:
        return containerd.log_tail(self.root, lines)

    def stop(self) -> None:
        containerd.stop_containerd(self.proc, self.socket, 30)
        for path in reversed(self._made):
            try:
                path.rmdir()
                if path.parent.is_dir() and not any(path.parent.iterdir()) and path.parent != Path("/opt"):
                    path.parent.rmdir()
            except OSError:
                pass
        self._made.clear()
        # The unpacked image is large (the native snapshotter copies every layer).
        shutil.rmtree(self.root / "root", ignore_errors=True)
