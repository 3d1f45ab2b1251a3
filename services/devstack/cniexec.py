"""The dev node as a container runtime: each pod's sandbox is a network namespace the node makes,
joined to the datapath by exec'ing palisade-cni per the CNI specification (ADD on start, DEL on stop).

This is the path real pods take (kubelet -> runtime -> CNI), run by `make run --cni` every day.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.cni.spec import CniError
from services.common.log import get_logger

log = get_logger("devnode")

PLUGIN = str(Path(sys.executable).parent / "palisade-cni")
NETNS_DIR = "/run/netns"


class CniRuntime:
    """Sandboxes (network namespaces) and palisade-cni ADD/DEL for them, against one datapath socket."""

    def __init__(self, socket: str, plugin: str = PLUGIN) -> None:
        self.socket = socket
        self.plugin = plugin

    def sandbox(self, namespace: str, pod: str) -> tuple[str, str]:
        """(container id, netns path) of a pod's sandbox: stable for this stack, apart from other stacks'."""
        digest = hashlib.sha256(f"{self.socket}|{namespace}/{pod}".encode()).hexdigest()
        return f"dev{digest[:29]}", f"{NETNS_DIR}/cni-dev-{digest[:12]}"

    async def _exec(self, command: str, namespace: str, pod: str, netns: str, container_id: str) -> dict[str, Any]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_NETNS": netns,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": str(Path(self.plugin).parent),
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod}",
        }
        config = {"cniVersion": "1.0.0", "name": "palisade", "type": "palisade", "socket": self.socket}
        proc = await asyncio.create_subprocess_exec(
            self.plugin, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await proc.communicate(json.dumps(config).encode())
        text = out.decode().strip()
        result: dict[str, Any] = json.loads(text) if text else {}
        if proc.returncode != 0:
            # The plugin's error object, with the call it answered named in the message.
            detail = result.get("details") or err.decode().strip()[-500:]
            message = f"palisade-cni {command} for {namespace}/{pod}: {result.get('msg', 'failed')} ({detail})"
            raise CniError(int(result.get("code", 0)), message, detail)
        return result

    async def add(self, namespace: str, pod: str) -> dict[str, Any]:
        """Make the pod's sandbox and ADD it; returns the plugin's result."""
        container_id, netns = self.sandbox(namespace, pod)
        await asyncio.to_thread(_netns, "add", netns)
        try:
            return await self._exec("ADD", namespace, pod, netns, container_id)
        except BaseException:
            await self.remove(namespace, pod)
            raise

    async def remove(self, namespace: str, pod: str) -> None:
        """DEL the pod's sandbox, then remove its namespace (as a runtime does)."""
        container_id, netns = self.sandbox(namespace, pod)
        try:
            await self._exec("DEL", namespace, pod, netns, container_id)
        except CniError as exc:
            log.warning("CNI DEL failed", pod=f"{namespace}/{pod}", error=str(exc))
        await asyncio.to_thread(_netns, "del", netns)


def _netns(action: str, path: str) -> None:
    """``ip netns add`` (when missing) or ``del`` (when present) the sandbox namespace at ``path``."""
    if os.path.exists(path) == (action == "del"):
        subprocess.run(["ip", "netns", action, os.path.basename(path)], check=action == "add", capture_output=True)
