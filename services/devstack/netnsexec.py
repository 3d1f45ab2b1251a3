"""Enter a network namespace from inside a fresh process (setns), before any sockets exist."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter(netns: str) -> None:
    """Join the network namespace at ``netns`` (a path, or a name under /run/netns)."""
    path = netns if netns.startswith("/") else f"/run/netns/{netns}"
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
