"""Install (or remove) palisade-cni on a node: the plugin, its Python runtime, and the network configuration.

Run by the datapath DaemonSet's init container with the node's CNI folders mounted:

    python -m services.cni.install --bin-dir /host/opt/cni/bin --conf-dir /host/etc/cni/net.d \\
        --runtime-dir /host/opt/palisade-cni --runtime-path /opt/palisade-cni [--chain]

``<bin-dir>/palisade`` is the plugin executable the runtime starts (services/cni/shim.c, static:
it asks nothing of the node), which has the datapath run the Python plugin's code in-process.
What it hands to the Python plugin itself (no datapath answering, VERSION, input it cannot read)
runs ``<bin-dir>/palisade-python``, a small launcher of the image's interpreter and packages,
copied beside it (``--runtime-dir``, seen by the node as ``--runtime-path``; each install into a
folder of its own there, as that folder is the node's, mounted, and cannot itself be replaced);
the node needs a glibc at least as new as the image's (Debian 12: 2.36) for that one.

Standalone (the default) writes ``05-palisade.conflist`` with Palisade as the only plugin.
``--chain`` puts Palisade after the plugins of the node's existing configuration (the first
other ``*.conflist``/``*.conf`` file, e.g. kindnet's or flannel's): the same network name,
written as ``05-palisade.conflist`` so the runtime picks it first. ``--uninstall`` removes the
configuration, the plugin, its launcher and the runtime (a chained node is left with its own plugin's
configuration, as before the install), and with ``--bpffs``/``--state-dir`` also detaches the
datapath's programs from the pods' veths, removes its pinned maps and its endpoint state: what
``palisade uninstall`` runs on every node (deploy/kubernetes/uninstall).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

CONFLIST = "05-palisade.conflist"
PLUGIN = "palisade"
#: The Python plugin's launcher, beside the plugin: the name services/cni/shim.c runs.
FALLBACK = PLUGIN + "-python"
#: The plugin executable, built by scripts/setup.sh (and the image) beside the interpreter.
SHIM = Path(sys.executable).parent / "palisade-cni"
DEFAULT_SOCKET = "/var/run/palisade/datapath/cni.sock"


class InstallError(RuntimeError):
    """What the operator must fix; the message says what."""


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=f".{path.name}.") as f:
        f.write(text)
    os.chmod(f.name, mode)
    os.replace(f.name, path)


def shim_binary(path: Path = SHIM) -> bytes:
    """The plugin executable as built; :class:`InstallError` if it is not there or not one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InstallError(f"the plugin executable {path} is missing ({exc}); `make setup` builds it") from None
    if not data.startswith(b"\x7fELF"):
        raise InstallError(f"{path} is not the built plugin executable (services/cni/shim.c); `make setup` builds it")
    return data


def _atomic_write_bytes(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=path.parent, delete=False, prefix=f".{path.name}.") as f:
        f.write(data)
    os.chmod(f.name, mode)
    os.replace(f.name, path)


def launcher(runtime_path: str) -> str:
    """The Python plugin the executable hands to: the copied interpreter on the copied packages."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return (
        "#!/bin/sh\n"
        "# palisade-cni, installed by the Palisade datapath; see services/cni/install.py.\n"
        f'export PYTHONHOME="{runtime_path}/python" PYTHONPATH="{runtime_path}/site-packages"\n'
        f'export LD_LIBRARY_PATH="{runtime_path}/python/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"\n'
        f'exec "{runtime_path}/python/bin/{version}" -s -m services.cni.plugin "$@"\n'
    )


#: Each install's runtime is a folder of its own in the runtime directory, named so.
RELEASE_PREFIX = "runtime-"


def copy_runtime(runtime_dir: Path) -> str:
    """The running interpreter (its standard library and shared library) and its packages, into a new
    folder of ``runtime_dir``; returns that folder's name.

    ``runtime_dir`` is the node's folder as mounted (a mount point: it cannot itself be replaced),
    so each install copies into a folder of its own beside the previous ones, built under a
    temporary name and renamed when complete; the launcher then names it, and
    :func:`prune_runtimes` removes the others. A plugin running meanwhile keeps the runtime its
    launcher named.
    """
    base = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    runtime_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=runtime_dir, prefix=".partial-"))
    (staging / "python" / "bin").mkdir(parents=True)
    shutil.copy2(Path(sys.executable).resolve(), staging / "python" / "bin" / version)
    shutil.copytree(
        base / "lib" / version,
        staging / "python" / "lib" / version,
        ignore=shutil.ignore_patterns("test", "tests", "site-packages", "__pycache__", "idlelib", "tkinter"),
        symlinks=True,
    )
    for lib in (base / "lib").glob("libpython3*.so*"):
        shutil.copy2(lib, staging / "python" / "lib" / lib.name)
    shutil.copytree(
        sysconfig.get_paths()["purelib"], staging / "site-packages", ignore=shutil.ignore_patterns("__pycache__")
    )
    staging.chmod(0o755)
    release = RELEASE_PREFIX + staging.name.removeprefix(".partial-")
    os.replace(staging, runtime_dir / release)
    return release


def prune_runtimes(runtime_dir: Path, keep: str) -> None:
    """Remove everything in ``runtime_dir`` (Palisade's own folder) but ``keep``: earlier installs'
    runtimes, unfinished copies, and the single-runtime layout of older versions."""
    for path in runtime_dir.iterdir():
        if path.name != keep:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _existing(conf_dir: Path) -> Path | None:
    files = sorted(p for p in conf_dir.glob("*") if p.suffix in (".conflist", ".conf") and p.name != CONFLIST)
    return files[0] if files else None


def conflist(conf_dir: Path, *, chain: bool, socket: str) -> dict[str, Any]:
    """The configuration to write: Palisade alone, or after the node's existing plugins."""
    ours = {"type": PLUGIN, "socket": socket}
    if not chain:
        return {"cniVersion": "1.0.0", "name": "palisade", "plugins": [ours]}
    existing = _existing(conf_dir)
    if existing is None:
        raise InstallError(
            f"--chain: no other CNI configuration in {conf_dir} to chain after; install the primary plugin "
            "first, or run standalone"
        )
    try:
        data = json.loads(existing.read_text())
    except ValueError as exc:
        raise InstallError(f"--chain: {existing} is not JSON ({exc})") from None
    plugins = data.get("plugins") if existing.suffix == ".conflist" else [data]
    if not isinstance(plugins, list) or not plugins:
        raise InstallError(f"--chain: {existing} has no plugins")
    plugins = [p for p in plugins if p.get("type") != PLUGIN] + [ours]
    return {"cniVersion": data.get("cniVersion", "1.0.0"), "name": data.get("name", "palisade"), "plugins": plugins}


def install(args: argparse.Namespace) -> None:
    bin_dir, conf_dir = Path(args.bin_dir), Path(args.conf_dir)
    runtime_path, release = args.runtime_path, ""
    if not args.no_runtime:
        release = copy_runtime(Path(args.runtime_dir))
        runtime_path = f"{args.runtime_path.rstrip('/')}/{release}"
    shim = shim_binary()
    # The launcher first: the plugin, once in place, may hand to it at once.
    _atomic_write(bin_dir / FALLBACK, launcher(runtime_path), mode=0o755)
    _atomic_write_bytes(bin_dir / PLUGIN, shim, mode=0o755)
    _atomic_write(conf_dir / CONFLIST, json.dumps(conflist(conf_dir, chain=args.chain, socket=args.socket), indent=2))
    if release:
        prune_runtimes(Path(args.runtime_dir), keep=release)
    mode = "chained" if args.chain else "standalone"
    print(f"palisade-cni installed: {bin_dir / PLUGIN}, {conf_dir / CONFLIST} ({mode})")


def uninstall(args: argparse.Namespace) -> None:
    for path in (Path(args.conf_dir) / CONFLIST, Path(args.bin_dir) / PLUGIN, Path(args.bin_dir) / FALLBACK):
        path.unlink(missing_ok=True)
    runtime_dir = Path(args.runtime_dir)
    if runtime_dir.is_dir():
        # Its contents: the folder itself may be the node's, mounted (it cannot go then).
        prune_runtimes(runtime_dir, keep="")
        with contextlib.suppress(OSError):
            runtime_dir.rmdir()
    print("palisade-cni removed")
    if args.bpffs:
        # The datapath's programs off every pod veth and its pinned maps gone (its own teardown).
        from services.datapath.datapath import teardown_all

        found = teardown_all(args.bpffs)
        if os.path.isdir(args.bpffs):
            shutil.rmtree(args.bpffs, ignore_errors=True)
        done = "datapath programs detached and maps removed" if found else "no datapath"
        print(f"{done} ({args.bpffs})")
        from services.datapath import dnsrouting

        dnsrouting.remove()  # the DNS proxy's policy routing on the node
        print("DNS proxy routing removed")
    if args.state_dir:
        shutil.rmtree(args.state_dir, ignore_errors=True)
        print(f"endpoint state removed ({args.state_dir})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.cni.install", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--bin-dir", default="/host/opt/cni/bin", help="the node's CNI plugin folder, as mounted")
    p.add_argument("--conf-dir", default="/host/etc/cni/net.d", help="the node's CNI configuration folder, as mounted")
    p.add_argument(
        "--runtime-dir", default="/host/opt/palisade-cni", help="where the plugin's runtime goes, as mounted"
    )
    p.add_argument("--runtime-path", default="/opt/palisade-cni", help="the same folder as the node sees it")
    p.add_argument("--socket", default=DEFAULT_SOCKET, help="the datapath's CNI socket on the node")
    p.add_argument(
        "--chain",
        action="store_true",
        default=os.environ.get("PALISADE_CNI_MODE", "standalone") == "chained",
        help="after the node's existing plugins, instead of standalone (env PALISADE_CNI_MODE=chained)",
    )
    p.add_argument("--uninstall", action="store_true", help="remove what an install put on the node")
    p.add_argument("--bpffs", default="", help="with --uninstall: the datapath's pin directory, to detach and remove")
    p.add_argument("--state-dir", default="", help="with --uninstall: the datapath's state directory, to remove")
    p.add_argument("--no-runtime", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        uninstall(args) if args.uninstall else install(args)
    except (InstallError, OSError) as exc:
        print(f"palisade-cni install: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
