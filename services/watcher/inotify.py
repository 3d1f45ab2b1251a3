"""File-system notifications for the manifest folder: Linux inotify, through libc, on every subfolder.

The manifest source scans the folder when this says something changed, instead of waiting
for its next poll: a file written and closed, created, moved in or out, or deleted, and
folders appearing (which are watched from then on). It reacts to the close of a write,
not to each write, so a file is read once its writer is done with it. Where inotify is
not available (another OS, a file system without it, the per-user watch limit reached)
:meth:`FolderWatch.open` returns None and the source keeps polling.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
from pathlib import Path

from services.common.log import get_logger

log = get_logger("watcher.inotify")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

#: What counts as a change of the folder's manifests (IN_MODIFY is left out: the close follows).
MASK = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ATTRIB
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, name length


class FolderWatch:
    """inotify watches on ``root`` and its subfolders; :meth:`changed` waits for the next change."""

    def __init__(self, fd: int, root: Path, libc: ctypes.CDLL) -> None:
        self._fd = fd
        self._root = root
        self._libc = libc
        self._dirs: dict[int, Path] = {}
        self._event = asyncio.Event()
        self._reading = False

    @classmethod
    def open(cls, root: Path) -> FolderWatch | None:
        """A watch on ``root``, or None where inotify cannot be used (the caller polls)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            log.warning("inotify unavailable; polling the manifest folder", error=os.strerror(ctypes.get_errno()))
            return None
        watch = cls(fd, root, libc)
        watch._add_tree(root)
        return watch

    def _add(self, path: Path) -> None:
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err != errno.ENOENT:
                log.warning("cannot watch a manifest folder; it is polled", folder=str(path), error=os.strerror(err))
            return
        self._dirs[wd] = path

    def _add_tree(self, root: Path) -> None:
        if not root.is_dir():
            return
        self._add(root)
        for dirpath, dirnames, _ in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for d in dirnames:
                self._add(Path(dirpath, d))

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self._fd, self._read)
        self._reading = True

    def _read(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                self._event.set()  # events were lost: the scan finds what changed anyway
                continue
            folder = self._dirs.get(wd)
            if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO) and folder is not None and name:
                self._add_tree(folder / os.fsdecode(name))  # a new subfolder: watch it (and what it holds)
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and folder == self._root:
                self._dirs.pop(wd, None)  # the folder itself went away; re-added when it returns
            self._event.set()

    async def changed(self, timeout: float) -> bool:
        """Wait until something changed (True) or ``timeout`` seconds passed (False)."""
        if self._root not in self._dirs.values():
            self._add_tree(self._root)  # the folder (re)appeared since
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return False
        self._event.clear()
        return True

    def close(self) -> None:
        if self._reading:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._reading = False
        os.close(self._fd)
