"""The CNI plugin's endpoint: the datapath's node API as JSON lines on a root-only unix socket.

The runtime starts ``palisade-cni`` once per pod event, so the plugin's start-up is part of every
pod's start: importing gRPC and protobuf alone cost it about 150 ms, more than the rest of an
ADD. Cilium's plugin speaks REST to its agent's socket for the same reason. Here the plugin
writes one line, ``{"method": "CreateEndpoint", "request": {...}}``, and reads one line back,
``{"response": {...}}`` or ``{"error": {"code": "NOT_FOUND", "message": "..."}}``; the
requests and responses are the node API's own messages in protobuf's JSON mapping (field names
as in the .proto), answered by the same servicer and error mapping as gRPC, so the two ways in
can never disagree. It listens beside the gRPC node socket (``plugin.sock`` in its directory).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from palisade.v1 import datapath_pb2
from services.cni.spec import plugin_socket
from services.common.errors import Code, clip
from services.common.grpcserver import ErrorInterceptor
from services.common.log import get_logger
from services.common.unixserver import close_unix_server, start_unix_server
from services.datapath.servicer import DatapathServicer

__all__ = ["PluginApi", "plugin_socket"]

log = get_logger("pluginapi")

#: A request larger than this is refused: the plugin's requests are a few hundred bytes.
MAX_REQUEST = 1 << 20


Method = Callable[[Any, Any], Awaitable[Message]]


class PluginApi:
    """Serves the plugin's calls on ``path`` until :meth:`stop`."""

    def __init__(self, servicer: DatapathServicer, errors: ErrorInterceptor, path: str) -> None:
        self._errors = errors
        self.path = path
        self._methods: dict[str, tuple[type[Message], Method]] = {
            "CreateEndpoint": (datapath_pb2.CreateEndpointRequest, servicer.CreateEndpoint),
            "DeleteEndpoint": (datapath_pb2.DeleteEndpointRequest, servicer.DeleteEndpoint),
            "ListEndpoints": (datapath_pb2.ListEndpointsRequest, servicer.ListEndpoints),
        }
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await start_unix_server(self.path, self._serve, limit=MAX_REQUEST)
        log.info("serving the CNI plugin", socket=self.path)

    async def stop(self) -> None:
        await close_unix_server(self._server, self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            answer = await self.answer(line)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, ValueError, asyncio.LimitOverrunError) as exc:
            log.warning("plugin connection failed", error=str(exc))
        finally:
            writer.close()

    async def answer(self, line: bytes) -> dict[str, Any]:
        """The answer to one request line."""
        try:
            call = json.loads(line)
            method, request = call["method"], call.get("request", {})
            request_type, handler = self._methods[method]
            message = json_format.ParseDict(request, request_type())
        except (ValueError, KeyError, TypeError, json_format.ParseError) as exc:
            known = ", ".join(self._methods)
            return _error(Code.INVALID_ARGUMENT, f"not a request this socket serves ({known}): {exc}")
        try:
            response = await handler(message, None)
        except Exception as exc:
            status = self._errors.status(exc, method)
            if status is None:
                log.error("plugin call failed", method=method, error=repr(exc))
                return _error(Code.INTERNAL, f"{method}: {exc!r}")
            code, text = status
            return _error(Code(code.name), text)
        return {"response": json_format.MessageToDict(response, preserving_proto_field_name=True)}


def _error(code: Code, message: str) -> dict[str, Any]:
    return {"error": {"code": code.value, "message": clip(message)}}
