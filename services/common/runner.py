"""Process lifecycle shared by the four services.

    def main() -> None:
        run_service("policy", PolicyConfig, setup)

``setup(ctx)`` connects what the service needs (through ``ctx.bus()``/``ctx.etcd()``,
which close themselves on exit), registers gRPC servicers and spawns its long-running
tasks with ``ctx.spawn``. Shutdown on SIGTERM/SIGINT: health NOT_SERVING ->
``server.stop(grace)`` (in-flight calls finish) -> tasks cancelled -> NATS drained ->
etcd closed. A dependency that cannot be reached ends the process with exit code 1 and
one line naming the address; a bad flag with exit code 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import aetcd

from services.common.bus import Bus
from services.common.config import DEFAULT_GRPC_PORTS, CommonConfig, ConfigError, load_config
from services.common.grpcserver import GrpcServer, start_metrics
from services.common.log import Logger, get_logger, setup_logging
from services.common.retry import StartupError
from services.common.store import connect_etcd
from services.common.trust import Credentials, TrustError

C = TypeVar("C", bound=CommonConfig)


@dataclasses.dataclass
class ServiceContext(Generic[C]):
    """What a service's setup gets: its config, the gRPC server and lifecycle hooks."""

    name: str
    config: C
    server: GrpcServer
    stack: contextlib.AsyncExitStack
    log: Logger
    _tg: asyncio.TaskGroup
    _tasks: list[asyncio.Task[Any]] = dataclasses.field(default_factory=list)

    @property
    def credentials(self) -> Credentials | None:
        """This service's certificate (None when --insecure)."""
        return self.server.credentials

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run a root task for the life of the service; if it fails, the service exits 1."""
        task = self._tg.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def bus(self) -> Bus:
        bus = await Bus.connect(
            self.config.nats_servers(),
            name=f"palisade-{self.name}",
            retries=self.config.connect_retries,
            backoff=self.config.connect_backoff,
            tls=self.credentials,
        )
        self.stack.push_async_callback(bus.close)
        self.server.status.add_dependency("bus", bus.problem)
        return bus

    async def etcd(self) -> aetcd.Client:
        client = await connect_etcd(
            self.config.etcd_endpoint_list(),
            retries=self.config.connect_retries,
            backoff=self.config.connect_backoff,
            tls=self.credentials,
        )
        self.stack.push_async_callback(client.close)
        return client


Setup = Callable[[ServiceContext[C]], Awaitable[None]]


def _listen(cfg: CommonConfig, name: str) -> str:
    return cfg.grpc_listen or f"127.0.0.1:{DEFAULT_GRPC_PORTS.get(name, 0)}"


async def _serve(name: str, cfg: C, setup: Setup[C]) -> int:
    log = get_logger(name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = GrpcServer(name, cfg.node_name, _listen(cfg, name), cfg.credentials(name))
    async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tg:
        ctx = ServiceContext(name=name, config=cfg, server=server, stack=stack, log=log, _tg=tg)
        await setup(ctx)
        await server.start()
        start_metrics(cfg.metrics_listen)
        log.info("service started", node=cfg.node_name, grpc_port=server.port)
        await stop.wait()
        log.info("shutting down", grace=cfg.shutdown_grace)
        await server.stop(cfg.shutdown_grace)
        for task in ctx._tasks:
            task.cancel()
    log.info("stopped")
    return 0


def _first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def run_service(name: str, config_type: type[C], setup: Setup[C], argv: list[str] | None = None) -> int:
    """Parse config, run the service until SIGTERM/SIGINT, and return the exit code."""
    prog = f"python -m services.{name}"
    try:
        cfg = load_config(config_type, argv, prog=prog)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        return asyncio.run(_serve(name, cfg, setup))
    except BaseException as exc:
        err = _first_error(exc)
        if isinstance(err, KeyboardInterrupt):
            return 0
        if isinstance(err, (StartupError, ConfigError, OSError, TrustError)):
            print(f"palisade-{name}: error: {err}", file=sys.stderr)
            return 1
        get_logger(name).error("service failed", error=repr(err), exc_info=True)
        print(f"palisade-{name}: error: {err!r}", file=sys.stderr)
        return 1
