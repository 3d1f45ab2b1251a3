"""gRPC server bootstrap: health checking, reflection, status, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import prometheus_client
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from palisade.v1 import common_pb2, common_pb2_grpc
from services import __version__
from services.common.access import AccessInterceptor, wrap_handler
from services.common.errors import Code, PalisadeError, clip
from services.common.log import get_logger
from services.common.trust import Credentials

log = get_logger("grpc")

T = TypeVar("T")

#: Largest gRPC message sent or received, by servers and the CLI alike (a policy file of several MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Channel/server options that apply it.
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

StatusProvider = Callable[[common_pb2.ServiceStatus], None]
#: Why a dependency cannot be used right now; None when it can.
DependencyProbe = Callable[[], str | None]


class StatusServicer(common_pb2_grpc.StatusServiceServicer):
    """Serves ServiceStatus; the service fills in its own figures through ``provider``.

    Dependencies (the bus, ...) added with :meth:`add_dependency` show in ``details``
    as ``<name>=ok`` or what is wrong; while one is down the service is not ``synced``
    (it may still answer from what it knows, so health is left alone).
    """

    def __init__(self, service: str, node: str) -> None:
        self._service = service
        self._node = node
        self._started = Timestamp()
        self._started.FromNanoseconds(time.time_ns())
        self.provider: StatusProvider | None = None
        self._dependencies: dict[str, DependencyProbe] = {}
        self._members: list[Callable[[], list[common_pb2.Member]]] = []

    def add_dependency(self, name: str, probe: DependencyProbe) -> None:
        self._dependencies[name] = probe

    def add_members(self, members: Callable[[], list[common_pb2.Member]]) -> None:
        """Report cluster members this service sees (its replicas, the NATS servers, etcd members)."""
        self._members.append(members)

    def snapshot(self) -> common_pb2.ServiceStatus:
        status = common_pb2.ServiceStatus(service=self._service, version=__version__, node=self._node)
        status.started_at.CopyFrom(self._started)
        if self.provider is not None:
            self.provider(status)
        for name, probe in self._dependencies.items():
            problem = probe()
            status.details[name] = "ok" if problem is None else f"down: {problem}"
            if problem is not None:
                status.synced = False
        for members in self._members:
            status.members.extend(members())
        return status

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ServiceStatus:
        return self.snapshot()


#: A gRPC status: the code and the message the caller reads.
Status = tuple[grpc.StatusCode, str]
#: Turns an exception a servicer raised into a status, given the method's name; None: not this mapping's.
ErrorMapping = Callable[[Exception, str], Status | None]
#: Told of every call answered: the method's name, the status code's name ("OK", ...), and the seconds taken.
CallObserver = Callable[[str, str, float], None]


def palisade_status(exc: Exception, method: str) -> Status | None:
    """A :class:`PalisadeError` answers with its own code and message."""
    if isinstance(exc, PalisadeError):
        return getattr(grpc.StatusCode, exc.code.value), exc.message
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The one place where what a servicer raises becomes a gRPC status.

    Servicers raise :class:`PalisadeError` (or an exception a service-specific mapping
    knows, added with :meth:`add_mapping`); the interceptor aborts the call with the
    mapped code and the message, clipped to what gRPC carries. Anything no mapping
    knows propagates, and gRPC answers UNKNOWN. Observers (:meth:`add_observer`) see
    each call's method name, final code and duration.
    """

    def __init__(self) -> None:
        self._mappings: list[ErrorMapping] = [palisade_status]
        self._observers: list[CallObserver] = []

    def add_mapping(self, mapping: ErrorMapping) -> None:
        """Consulted, in the order added, for exceptions that are not a PalisadeError."""
        self._mappings.append(mapping)

    def add_observer(self, observer: CallObserver) -> None:
        self._observers.append(observer)

    def status(self, exc: Exception, method: str) -> Status | None:
        for mapping in self._mappings:
            status = mapping(exc, method)
            if status is not None:
                return status
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        return self.wrap(details.method, await continuation(details))

    def wrap(self, method: str, handler: grpc.RpcMethodHandler | None) -> Any:
        """``handler`` of ``method`` (``/pkg.Service/Method``) with its errors mapped to statuses."""
        name = method.rpartition("/")[2]
        return wrap_handler(handler, lambda behavior: self._wrap(name, behavior))

    def _wrap(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async with self._answering(method, context):
                    async for item in behavior(request, context):
                        yield item

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._answering(method, context):
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result

        return unary

    @contextlib.asynccontextmanager
    async def _answering(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Around one call: abort with the mapped status of what it raises, tell the observers."""
        started, code = time.perf_counter(), "UNKNOWN"
        try:
            yield
            code = "OK"
        except BaseException as exc:
            code, status = self._classify(exc, method, context)
            if status is None:
                raise
            await _abort(context, status)
        finally:
            self._observe(method, code, started)

    def _classify(
        self, exc: BaseException, method: str, context: grpc.aio.ServicerContext
    ) -> tuple[str, Status | None]:
        """The code a failed call ends with, and the status to abort with (None: let ``exc`` go on)."""
        if isinstance(exc, asyncio.CancelledError):
            return "CANCELLED", None
        if isinstance(exc, grpc.aio.AbortError):  # aborted by itself (no Palisade servicer does)
            aborted = context.code()
            return (aborted.name if isinstance(aborted, grpc.StatusCode) else "UNKNOWN"), None
        status = self.status(exc, method) if isinstance(exc, Exception) else None
        return (status[0].name if status is not None else "UNKNOWN"), status

    def _observe(self, method: str, code: str, started: float) -> None:
        if not self._observers:
            return
        seconds = time.perf_counter() - started
        for observer in self._observers:
            observer(method, code, seconds)


#: Wraps the handler of one method (``/pkg.Service/Method``) in what every call of it goes through.
HandlerWrap = Callable[[str, Any], Any]


class WrappedHandlers(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Interceptors as wraps of each method's handler, built once per method and kept.

    A grpc.aio interceptor runs for every call and would wrap the method's handler again
    each time; the wraps here depend on the method alone, so the wrapped handler of a
    method is built on its first call and answered from then on. ``wraps`` go outermost
    first. A method with no handler (unknown, or its service not added yet) is not kept.
    """

    def __init__(self, wraps: list[HandlerWrap]) -> None:
        self._wraps = wraps
        self._handlers: dict[str, Any] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        handler = self._handlers.get(method)
        if handler is not None:
            return handler
        handler = await continuation(details)
        if handler is None:
            return None
        for wrap in reversed(self._wraps):
            handler = wrap(method, handler)
        self._handlers[method] = handler
        return handler


async def _abort(context: grpc.aio.ServicerContext, status: Status) -> None:
    code, message = status
    await context.abort(code, clip(message))
    raise AssertionError("grpc abort returned")  # abort always raises


class GrpcServer:
    """One grpc.aio server with the standard Palisade extras.

    Health starts NOT_SERVING; the service calls :meth:`set_serving` once its upstreams
    are synced. :meth:`stop` flips health to NOT_SERVING first so load balancers and
    clients stop sending, then lets in-flight calls finish within ``grace`` seconds.
    """

    def __init__(self, service: str, node: str, listen: str, credentials: Credentials | None = None) -> None:
        self.service = service
        self.listen = listen
        self.credentials = credentials
        # Without credentials (--insecure) there is no caller name to judge: every call is let in.
        #: Maps what servicers raise to a gRPC status; services add their own mappings and observers.
        self.errors = ErrorInterceptor()
        wraps: list[HandlerWrap] = [AccessInterceptor().wrap] if credentials is not None else []
        wraps.append(self.errors.wrap)
        self.server = grpc.aio.server(options=MESSAGE_SIZE_OPTIONS, interceptors=[WrappedHandlers(wraps)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.status = StatusServicer(service, node)
        common_pb2_grpc.add_StatusServiceServicer_to_server(self.status, self.server)
        self._names: list[str] = [
            common_pb2.DESCRIPTOR.services_by_name["StatusService"].full_name,
        ]
        self.port = 0
        self._serving = False
        self._unix: list[str] = []

    def add_unix_socket(self, path: str) -> None:
        """Also listen on a unix socket, owner-only (a local API, like Cilium's agent socket)."""
        self._unix.append(path)

    def add_service(self, full_name: str) -> None:
        """Record a registered service for reflection and health (by its full name)."""
        self._names.append(full_name)

    async def start(self) -> int:
        if self.credentials is not None:
            self.port = self.server.add_secure_port(self.listen, self.credentials.server_credentials())
        else:
            log.warning("grpc without TLS (--insecure): anyone who reaches the port can call every method")
            self.port = self.server.add_insecure_port(self.listen)
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {self.listen}; is the port in use? set --grpc-listen")
        for path in self._unix:
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a previous run's; nobody listens on it any more
            old_umask = os.umask(0o077)  # the socket is created owner-only, never briefly open
            try:
                if self.server.add_insecure_port(f"unix:{path}") == 0:
                    raise OSError(f"cannot listen for gRPC on unix socket {path}; check the directory")
            finally:
                os.umask(old_umask)
        names = [*self._names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        await self.set_serving(self._serving)
        await self.server.start()
        for path in self._unix:
            os.chmod(path, 0o600)
            log.info("grpc listening", address=f"unix:{path}")
        host = self.listen.rpartition(":")[0]
        log.info("grpc listening", address=f"{host}:{self.port}", services=",".join(self._names))
        return self.port

    async def set_serving(self, serving: bool) -> None:
        self._serving = serving
        state = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", state)
        for name in self._names:
            await self.health.set(name, state)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def start_metrics(listen: str) -> int:
    """Serve Prometheus metrics over HTTP; returns the port (0 when disabled)."""
    if not listen:
        return 0
    host, _, port = listen.rpartition(":")
    server, _thread = prometheus_client.start_http_server(int(port), addr=host or "127.0.0.1")
    bound = int(server.server_port)
    log.info("metrics listening", address=f"{host}:{bound}")
    return bound


def grpc_target(endpoints: list[tuple[str, int]]) -> str:
    """One gRPC target for every endpoint: with several IP addresses the channel fails over
    between them by itself (pick-first); a name is resolved by DNS (a Kubernetes Service)."""
    if len(endpoints) > 1 and all(_is_ipv4(h) for h, _ in endpoints):
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in endpoints)
    host, port = endpoints[0]
    return f"{host}:{port}"


def _is_ipv4(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def parse_addresses(value: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` as (host, port) pairs; ValueError naming what is wrong."""
    out = []
    for item in value.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{item.strip()!r} is not host:port")
        out.append((host, int(port)))
    return out


def channel_args(service: str, credentials: Credentials | None) -> list[tuple[str, Any]]:
    """Options of a channel to ``service``: message sizes, and the name its certificate must carry."""
    options: list[tuple[str, Any]] = list(MESSAGE_SIZE_OPTIONS)
    if credentials is not None:
        # Whatever address is dialled (a pod IP, a node address), the server must prove it is ``service``.
        options.append(("grpc.ssl_target_name_override", service))
    return options


def open_channel(target: str, service: str, credentials: Credentials | None) -> grpc.aio.Channel:
    """An asyncio channel to ``service`` at ``target``: mutual TLS, or plain on a local unix socket."""
    if credentials is None or target.startswith("unix:"):
        return grpc.aio.insecure_channel(target, options=MESSAGE_SIZE_OPTIONS)
    return grpc.aio.secure_channel(
        target, credentials.channel_credentials(), options=channel_args(service, credentials)
    )


def open_sync_channel(target: str, service: str, credentials: Credentials | None) -> grpc.Channel:
    """The blocking twin of :func:`open_channel` (CLI, health probes)."""
    if credentials is None or target.startswith("unix:"):
        return grpc.insecure_channel(target, options=MESSAGE_SIZE_OPTIONS)
    options = channel_args(service, credentials)
    return grpc.secure_channel(target, credentials.channel_credentials(), options=options)


async def wait_for_channel(
    target: str, service: str, credentials: Credentials | None, timeout: float = 5.0
) -> grpc.aio.Channel:
    """A ready channel to ``service`` at ``target``, or raise TimeoutError naming it."""
    channel = open_channel(target, service, credentials)
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except TimeoutError:
        await channel.close()
        raise TimeoutError(f"no gRPC server answers at {target}") from None
    return channel


def unimplemented(servicer: type[T]) -> T:
    """An instance of a generated servicer whose every method answers UNIMPLEMENTED.

    Service shells register these for capabilities not built yet, so clients get a
    clear status instead of fake data.
    """

    def make(method: str) -> Callable[..., Any]:
        async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            raise PalisadeError(f"{servicer.__name__}.{method} is not implemented yet", Code.UNIMPLEMENTED)

        return handler

    methods = {m: make(m) for m in dir(servicer) if m[:1].isupper()}
    return type(f"Unimplemented{servicer.__name__}", (servicer,), methods)()  # type: ignore[no-any-return]
