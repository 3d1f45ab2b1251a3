"""The DNS proxy's read-only socket: the datapath asks it what the proxy learned.

The proxy owns the learned names; the datapath answers the CLI (``ListFqdnCache``,
``ListFqdnSelectors``, names in ``Observe``) from the proxy's own view, never from a copy it
would have to keep in step. The proxy listens on a root-only unix socket in the state dir the
two processes share (``dnsproxy.sock``); a client connects and reads one JSON document
(:meth:`~services.datapath.fqdnview.NamesView.to_json`) up to end of file. Nothing is written
through it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable

from services.common.errors import Code, PalisadeError
from services.common.log import get_logger
from services.common.unixserver import close_unix_server, start_unix_server
from services.datapath.fqdnview import NamesView

log = get_logger("dnsproxy")

SOCKET = "dnsproxy.sock"


def socket_path(state_dir: str) -> str:
    return os.path.join(state_dir, SOCKET)


class NamesUnavailable(PalisadeError):
    """The proxy did not answer."""

    code = Code.UNAVAILABLE


class NamesApi:
    """The proxy's side: ``async with``, serving ``view()`` to every client."""

    def __init__(self, path: str, view: Callable[[], NamesView]) -> None:
        self.path = path
        self._view = view
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> NamesApi:
        try:
            self._server = await start_unix_server(self.path, self._serve)
        except OSError as exc:
            # DNS goes on: only the CLI's view of the learned names is missing (and says why).
            log.error("learned names not served to the datapath", path=self.path, error=str(exc))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await close_unix_server(self._server, self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(json.dumps(self._view().to_json(), separators=(",", ":")).encode() + b"\n")
            await writer.drain()
        except ConnectionError:
            pass
        except Exception as exc:  # one client's failure is logged, the proxy keeps serving DNS
            log.error("learned names not served", error=str(exc))
        finally:
            writer.close()


async def read_names(path: str, timeout: float = 5.0) -> NamesView:
    """The proxy's view; :class:`NamesUnavailable` naming the socket and what to check."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                raw = await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError) as exc:
        reason = "no answer in time" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise NamesUnavailable(
            f"the node's DNS proxy does not answer at {path} ({reason}): is its process "
            "(palisade-dnsproxy, the DNS proxy container) running with the datapath's --state-dir?"
        ) from None
    try:
        return NamesView.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise NamesUnavailable(
            f"the node's DNS proxy at {path} answered what this datapath cannot read ({exc}): "
            "run the proxy and the datapath of one version"
        ) from None


__all__ = ["NamesApi", "NamesUnavailable", "read_names", "socket_path"]
