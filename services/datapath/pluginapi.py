"""The CNI plugin's endpoint: the datapath's node API as JSON lines on a root-only unix socket.

The runtime starts ``palisade-cni`` once per pod event, so the plugin's start-up is part of every
pod's start: importing gRPC and protobuf alone cost it about 150 ms, more than the rest of an
ADD. Cilium's plugin speaks REST to its agent's socket for the same reason. Here the plugin
writes one line, ``{"method": "CreateEndpoint", "request": {...}}``, and reads one line back,
``{"response": {...}}`` or ``{"error": {"code": "NOT_FOUND", "message": "..."}}``; the
requests and responses are the node API's own messages in protobuf's JSON mapping (field names
as in the .proto), answered by the same servicer and error mapping as gRPC, so the two ways in
can never disagree. It listens beside the gRPC node socket (``plugin.sock`` in its directory).

The executable the runtime starts (services/cni/shim.c) is not Python: a Python interpreter's
start alone costs 30-40 ms. It sends a whole CNI call instead, framed so that it needs no JSON:

    request:  b"PALISADE-CNI 1 <env bytes> <stdin bytes>\n" + b"KEY=VALUE\0..." + stdin
    answer:   b"exit <status> <stdout bytes>\n" + stdout     or     b"handoff\n"

and the plugin's own code (services/cni/plugin.py's ``run``: the specification's checks, results
and error objects) runs here, in a thread, calling this servicer in the loop. "handoff" asks the
executable to run the Python plugin itself, for what only the node's side does (queueing a
deletion on the node's file system while this datapath cannot delete).
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from palisade.v1 import datapath_pb2
from services.cni import plugin, spec
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
#: The first line of a whole CNI call (services/cni/shim.c), before its two lengths.
CNI_CALL = b"PALISADE-CNI 1 "
#: CNI calls run at once; more wait their turn. A burst's calls arrive within milliseconds of each
#: other and contend for the kernel's rtnl lock and the cores: 100 ADDs at once were enforced in
#: 6.5 s, 4 at a time in 4.8 s (bench_cni --burst 100).
CNI_CALLS = 4
#: Seconds a CNI call's thread waits for the servicer beyond the configuration's timeout.
CALL_GRACE = 20.0


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: asyncio.Semaphore | None = None
        #: CNI calls waiting for their turn (at most CNI_CALLS run at once).
        self.queued = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._calls = asyncio.Semaphore(CNI_CALLS)
        self._server = await start_unix_server(self.path, self._serve, limit=MAX_REQUEST)
        log.info("serving the CNI plugin", socket=self.path)

    async def stop(self) -> None:
        await close_unix_server(self._server, self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if line.startswith(CNI_CALL):
                writer.write(await self._cni_call(line, reader))
            else:
                answer = await self.answer(line)
                writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
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

    async def _cni_call(self, line: bytes, reader: asyncio.StreamReader) -> bytes:
        """The answer to a whole CNI call; ValueError if the request is not one."""
        env_len, stdin_len = (int(n) for n in line[len(CNI_CALL) :].split())
        if not (0 <= env_len <= MAX_REQUEST and 0 <= stdin_len <= MAX_REQUEST):
            raise ValueError(f"a CNI call of {env_len} + {stdin_len} bytes")
        env_block = await reader.readexactly(env_len)
        stdin = await reader.readexactly(stdin_len)
        env = {}
        for entry in env_block.split(b"\0"):
            key, sep, value = entry.partition(b"=")
            if sep:
                env[key.decode(errors="surrogateescape")] = value.decode(errors="surrogateescape")
        assert self._calls is not None
        self.queued += 1
        try:
            await self._calls.acquire()
        finally:
            self.queued -= 1
        try:
            status, out = await self._in_thread(env, stdin)
        finally:
            self._calls.release()
        if status is None:
            return b"handoff\n"
        data = out.encode(errors="surrogateescape")
        return b"exit %d %d\n" % (status, len(data)) + data

    async def _in_thread(self, env: Mapping[str, str], stdin: bytes) -> tuple[int | None, str]:
        """:meth:`run_cni` in a thread of its own. A daemon thread: one waiting on a loop that is
        gone (the datapath stopping) must not hold the process's exit, as a pool's threads would."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[int | None, str]] = loop.create_future()

        def settle(result: tuple[int | None, str] | None, exc: BaseException | None) -> None:
            if done.done():  # the connection's task was cancelled meanwhile
                return
            if exc is not None:
                done.set_exception(exc)
            else:
                assert result is not None
                done.set_result(result)

        def work() -> None:
            try:
                result = self.run_cni(env, stdin)
            except BaseException as exc:  # handed to the loop, which logs it with the connection
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        threading.Thread(target=work, name="cni-call", daemon=True).start()
        return await done

    def run_cni(self, env: Mapping[str, str], stdin: bytes) -> tuple[int | None, str]:
        """One CNI call by the plugin's code (in a worker thread): (exit status, stdout), or
        (None, "") when the plugin's own process must make it."""
        out = io.StringIO()
        try:
            return plugin.run(env, stdin, out, _InProcessApi(self)), out.getvalue()
        except plugin.Handoff:
            return None, ""
        except Exception as exc:  # a defect of the plugin's code: the runtime still gets an error object
            log.error("CNI call failed", command=env.get("CNI_COMMAND", ""), error=repr(exc))
            error = spec.CniError(spec.DATAPATH_ERROR, "palisade-cni failed in the datapath", clip(repr(exc)))
            return 1, json.dumps(error.to_json(spec.CURRENT_VERSION)) + "\n"

    def call(self, method: str, request: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """One call of the node API from a CNI call's thread, answered in the loop."""
        assert self._loop is not None
        line = json.dumps({"method": method, "request": request}).encode()
        try:
            future = asyncio.run_coroutine_threadsafe(self.answer(line), self._loop)
        except RuntimeError as exc:  # the loop is closed: the datapath is stopping
            raise plugin.ApiError("UNAVAILABLE", f"the datapath did not answer {method}: {exc}") from None
        try:
            answer = future.result(timeout)
        except TimeoutError as exc:
            future.cancel()
            raise plugin.ApiError("UNAVAILABLE", f"the datapath did not answer {method}: {exc!r}") from None
        return plugin.answer_to_response(answer)


class _InProcessApi:
    """:class:`services.cni.plugin.NodeApi` for a CNI call this datapath runs."""

    def __init__(self, api: PluginApi) -> None:
        self._api = api

    def call(self, conf: spec.NetConf, method: str, request: Mapping[str, Any], *, wait: float) -> dict[str, Any]:
        return self._api.call(method, request, conf.timeout + CALL_GRACE)

    def check_reachable(self, conf: spec.NetConf, wait: float) -> None:
        return None  # it answers this very call

    def queue_delete(self, conf: spec.NetConf, env: spec.Environment) -> None:
        raise plugin.Handoff()


def _error(code: Code, message: str) -> dict[str, Any]:
    return {"error": {"code": code.value, "message": clip(message)}}
