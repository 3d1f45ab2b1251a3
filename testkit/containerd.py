"""A real container runtime in kubelet's place: containerd's CRI plugin with runc, driven over CRI.

:class:`Containerd` runs Debian's containerd on a private root, state and socket, with the
CNI binary and configuration folders of the test. The sandbox ("pause") image is built
here: a static C program that waits for a signal, packed as an OCI image archive and
imported under the configured sandbox image name, since nothing can be pulled.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc

SANDBOX_IMAGE = "palisade.local/pause:1"
CNI_PLUGINS = Path("/usr/lib/cni")

PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, stop);
    signal(SIGTERM, stop);
    for (;;) pause();
}
"""


def missing() -> str | None:
    """Why a containerd test cannot run here (None: it can), with what to do about it."""
    for tool in ("containerd", "ctr", "runc", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed; `make setup` installs containerd, runc and the CNI plugins"
    if not (CNI_PLUGINS / "ptp").exists():
        return "the CNI plugins are missing from /usr/lib/cni; `make setup` installs containernetworking-plugins"
    return None


def _blob(root: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def build_pause_image(work: Path) -> Path:
    """An OCI image archive of a static pause program, tagged :data:`SANDBOX_IMAGE`."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "pause.c").write_text(PAUSE_C)
    subprocess.run(["gcc", "-static", "-Os", "-o", str(work / "pause"), str(work / "pause.c")], check=True)
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        tar.add(work / "pause", arcname="pause")
    layer_bytes = layer.getvalue()
    oci = work / "oci"
    layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_blob(oci, layer_bytes)}
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
    }
    config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json", **_blob(oci, json.dumps(config).encode())}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer_desc],
    }
    manifest_desc = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **_blob(oci, json.dumps(manifest).encode()),
        "annotations": {"io.containerd.image.name": SANDBOX_IMAGE, "org.opencontainers.image.ref.name": "1"},
    }
    (oci / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}))
    (oci / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    archive = work / "pause.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(oci.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(oci)), recursive=False)
    return archive


def cri_config(root: Path, socket: Path, cni_bin: Path | str, cni_conf: Path | str) -> str:
    """containerd's configuration with CRI on a private root, state and socket: runc, the native
    snapshotter, no cgroups of its own, and CNI from ``cni_bin`` and ``cni_conf``."""
    return f"""
version = 2
root = "{root / "root"}"
state = "{root / "state"}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{root / "t.sock"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{SANDBOX_IMAGE}"
  restrict_oom_score_adj = true
  disable_cgroup = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"""


def start_containerd(command: list[str], root: Path, socket: Path, timeout: float) -> subprocess.Popen[bytes]:
    """Run ``command`` (containerd, or a wrapper that execs it) writing ``root``/containerd.log, until
    its CRI ``socket`` exists; RuntimeError with the log's tail if it exits or ``timeout`` passes first."""
    log = open(root / "containerd.log", "wb")  # noqa: SIM115 - the process writes it until stop
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"containerd did not start: {log_tail(root)}")
        time.sleep(0.05)
    return proc


def wait_image(socket: Path, image: str, timeout: float) -> None:
    """Until the CRI plugin on ``socket`` sees ``image``: it learns of imports from events, and until
    then would try to pull it."""
    request = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=image))
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        images = api_pb2_grpc.ImageServiceStub(channel)  # type: ignore[no-untyped-call]
        while not images.ImageStatus(request, timeout=10).image.id:
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd's CRI does not see the imported {image}")
            time.sleep(0.05)


def log_tail(root: Path, lines: int = 30) -> str:
    """The last ``lines`` of the containerd log under ``root``."""
    try:
        return "\n".join((root / "containerd.log").read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def stop_containerd(proc: subprocess.Popen[bytes] | None, socket: Path, grace: float) -> None:
    """Stop containerd (SIGTERM, SIGKILL after ``grace`` seconds) and its sandboxes' shims, which
    outlive it: the ones whose command line names its ``socket``, this test's only."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid in _shims_of(socket):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _shims_of(socket: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "containerd-shim" in cmdline and str(socket) in cmdline:
            found.append(int(entry.name))
    return found


@dataclass
class Containerd:
    """containerd with CRI on a private socket; CNI from ``cni_bin`` and ``cni_conf``."""

    root: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "c.sock"

    @property
    def cni_bin(self) -> Path:
        return self.root / "cni-bin"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni-conf"

    def start(self, plugin: str) -> None:
        """Start it; ``plugin`` is the palisade-cni executable installed as type ``palisade``."""
        self.cni_bin.mkdir(parents=True, exist_ok=True)
        self.cni_conf.mkdir(parents=True, exist_ok=True)
        for binary in CNI_PLUGINS.iterdir():
            (self.cni_bin / binary.name).symlink_to(binary)
        (self.cni_bin / "palisade").symlink_to(plugin)
        config = cri_config(self.root, self.socket, self.cni_bin, self.cni_conf)
        (self.root / "config.toml").write_text(config)
        self.proc = start_containerd(
            ["containerd", "--config", str(self.root / "config.toml")], self.root, self.socket, 30
        )
        archive = build_pause_image(self.root / "image")
        subprocess.run(
            ["ctr", "-a", str(self.socket), "-n", "k8s.io", "images", "import", "--no-unpack", str(archive)],
            check=True,
            capture_output=True,
        )
        wait_image(self.socket, SANDBOX_IMAGE, 30)

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.root, lines)

    def stop(self) -> None:
        stop_containerd(self.proc, self.socket, 20)

    def write_conflist(self, plugins: list[dict[str, Any]], name: str = "palisade") -> None:
        for old in self.cni_conf.glob("*"):
            old.unlink()
        conflist = {"cniVersion": "1.0.0", "name": name, "plugins": plugins}
        (self.cni_conf / "05-palisade.conflist").write_text(json.dumps(conflist))

    def cri(self) -> Cri:
        return Cri(grpc.insecure_channel(f"unix:{self.socket}"))


class Cri:
    """The CRI RuntimeService calls kubelet makes for a pod sandbox."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.runtime = api_pb2_grpc.RuntimeServiceStub(channel)  # type: ignore[no-untyped-call]

    def run_sandbox(self, namespace: str, name: str, uid: str, log_dir: Path) -> str:
        config = api_pb2.PodSandboxConfig(
            metadata=api_pb2.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            hostname=name,
            log_directory=str(log_dir),
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace},
            linux=api_pb2.LinuxPodSandboxConfig(),
        )
        response = self.runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=120)
        return str(response.pod_sandbox_id)

    def netns(self, sandbox_id: str) -> str:
        """The sandbox's network namespace path (from the verbose status containerd gives)."""
        status = self.runtime.PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=30
        )
        info = json.loads(status.info["info"])
        for ns in info["runtimeSpec"]["linux"]["namespaces"]:
            if ns["type"] == "network":
                return str(ns["path"])
        raise AssertionError(f"sandbox {sandbox_id} has no network namespace")

    def ip(self, sandbox_id: str) -> str:
        status = self.runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=30)
        return str(status.status.network.ip)

    def remove(self, sandbox_id: str) -> None:
        self.runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120)
        self.runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120)

    def close(self) -> None:
        self.channel.close()
