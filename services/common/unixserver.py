"""A root-only unix socket server for the node's local APIs (the CNI plugin's, the DNS proxy's names).

One way to open and close them: a stale file of a killed run is removed, the socket is made under
umask 0177 (never a moment with a wider mode), and closing removes the file again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def start_unix_server(path: str, handler: Handler, *, limit: int = 2**16) -> asyncio.Server:
    """Serve ``handler`` on ``path``, readable and writable by root only; OSError if it cannot."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a previous run's: nobody listens on it
    old = os.umask(0o177)
    try:
        return await asyncio.start_unix_server(handler, path, limit=limit)
    finally:
        os.umask(old)


async def close_unix_server(server: asyncio.Server | None, path: str) -> None:
    if server is not None:
        server.close()
        await server.wait_closed()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
