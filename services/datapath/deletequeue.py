"""Deletions the CNI plugin could not hand over because the datapath was down (Cilium's deleteQueue).

A runtime must never be stuck on a pod it cannot remove, so ``palisade-cni DEL`` with no
datapath listening writes the request to ``<dir of the CNI socket>/delete-queue/<id>.json``
and succeeds; the datapath applies the queue when it starts and at every sweep after.
The plugin writes each file atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.log import get_logger

log = get_logger("deletequeue")

QUEUE_DIR = "delete-queue"


@dataclass(frozen=True, slots=True)
class QueuedDelete:
    path: Path
    container_id: str
    namespace: str
    pod: str


def queue_dir(cni_socket: str) -> Path:
    return Path(cni_socket).parent / QUEUE_DIR


def pending(directory: Path) -> list[QueuedDelete]:
    """The queued deletions, oldest first; unreadable files are logged and removed."""
    try:
        names = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
    except FileNotFoundError:
        return []
    out = []
    for path in names:
        try:
            data = json.loads(path.read_text())
            out.append(
                QueuedDelete(path, str(data["container_id"]), str(data.get("namespace", "")), str(data.get("pod", "")))
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("queued CNI deletion unreadable; dropped", file=str(path), error=str(exc))
            with_missing_ok(path)
    return out


def done(item: QueuedDelete) -> None:
    with_missing_ok(item.path)


def with_missing_ok(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
