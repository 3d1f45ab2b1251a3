"""The NATS JetStream helper: connect, provision streams, publish protobufs, follow subjects.

Every Palisade subject starts with ``palisade.``. State subjects (k8s objects,
identities, ipcache) live in compacted streams that keep one message per subject,
so a consumer that (re)starts replays exactly the current state; deletions are
tombstones. Regeneration orders keep a bounded history.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

import nats
from google.protobuf.message import Message
from nats.aio.client import Client as NATSClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from services.common.backoff import Backoff
from services.common.log import get_logger
from services.common.retry import tcp_probe, with_retries

log = get_logger("bus")

M = TypeVar("M", bound=Message)


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """A JetStream stream Palisade uses."""

    name: str
    subjects: tuple[str, ...]
    #: Keep only the last message per subject (current-state streams).
    compacted: bool = True
    #: For history streams: messages kept per subject.
    history: int = 10_000
    #: For history streams: seconds a message is kept (0 = forever).
    max_age: float = 0.0


K8S_STREAM = StreamSpec("PALISADE_K8S", ("palisade.k8s.>",))
IDENTITY_STREAM = StreamSpec("PALISADE_IDENTITY", ("palisade.identity.>",))
IPCACHE_STREAM = StreamSpec("PALISADE_IPCACHE", ("palisade.ipcache.>",))
REGEN_STREAM = StreamSpec("PALISADE_REGEN", ("palisade.regen.>",), compacted=False, history=10_000, max_age=3600.0)
ALL_STREAMS = (K8S_STREAM, IDENTITY_STREAM, IPCACHE_STREAM, REGEN_STREAM)

SYNCED_SUBJECT = "palisade.k8s.synced"


def token(value: str) -> str:
    """One subject token for a name or address (dots are not allowed inside a token)."""
    if not value:
        return "_"
    return value.replace(".", "_").replace(" ", "_").replace("*", "_").replace(">", "_")


def k8s_subject(kind_token: str, namespace: str, name: str) -> str:
    return f"palisade.k8s.{kind_token}.{token(namespace)}.{token(name)}"


def identity_subject(identity: int) -> str:
    return f"palisade.identity.{identity}"


def ipcache_subject(prefix: str) -> str:
    return f"palisade.ipcache.{token(prefix.replace('/', '_'))}"


def regen_subject(node: str) -> str:
    return f"palisade.regen.{token(node)}"


def _stream_config(spec: StreamSpec) -> jsapi.StreamConfig:
    return jsapi.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        storage=jsapi.StorageType.FILE,
        retention=jsapi.RetentionPolicy.LIMITS,
        max_msgs_per_subject=1 if spec.compacted else spec.history,
        max_age=spec.max_age or None,
        discard=jsapi.DiscardPolicy.OLD,
    )


class Follower:
    """A running ordered consumer that replays a subject filter, then follows it.

    ``caught_up`` is set once everything that was in the stream when following
    began has been handed to the callback (immediately if there was nothing).
    """

    def __init__(self, sub: Any, caught_up: asyncio.Event) -> None:
        self._sub = sub
        self.caught_up = caught_up

    async def stop(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # already closed with the connection
            pass


class Bus:
    """A NATS connection with JetStream, used as ``async with await Bus.connect(...)``."""

    def __init__(self, nc: NATSClient, js: JetStreamContext, name: str) -> None:
        self.nc = nc
        self.js = js
        self.name = name

    @classmethod
    async def connect(
        cls,
        servers: list[str],
        *,
        name: str,
        retries: int = 10,
        backoff: float = 0.2,
    ) -> Bus:
        """Connect, retrying at startup; afterwards the client reconnects forever with backoff."""
        address = ",".join(servers)

        async def probe() -> None:
            errors = []
            for url in servers:
                u = urlparse(url if "://" in url else "nats://" + url)
                try:
                    await tcp_probe(u.hostname or "127.0.0.1", u.port or 4222)
                    return
                except OSError as exc:
                    errors.append(exc)
            raise errors[-1] if errors else OSError("no NATS servers configured")

        await with_retries(
            "NATS",
            address,
            probe,
            retries=retries,
            backoff=backoff,
            hint="start nats-server (with -js) or set --nats-url / PALISADE_NATS_URL",
        )

        async def on_error(exc: Exception) -> None:
            log.warning("nats error", error=str(exc))

        async def on_disconnect() -> None:
            log.warning("nats disconnected", servers=address)

        async def on_reconnect() -> None:
            log.info("nats reconnected", servers=address)

        nc = await nats.connect(
            servers,
            name=name,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            # Keep publishes made while disconnected instead of failing them at once.
            pending_size=64 * 1024 * 1024,
        )
        log.info("nats connected", servers=address, client=name)
        return cls(nc, nc.jetstream(), name)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 5)
        except Exception:
            await self.nc.close()

    async def ensure_stream(self, spec: StreamSpec) -> None:
        """Create the stream, or bring an existing one to this config; idempotent."""
        config = _stream_config(spec)
        try:
            await self.js.stream_info(spec.name)
        except NotFoundError:
            try:
                await self.js.add_stream(config)
                log.info("stream created", stream=spec.name)
                return
            except Exception as exc:  # created concurrently by another service
                if "already in use" not in str(exc):
                    raise
        await self.js.update_stream(config)

    async def ensure_streams(self, *specs: StreamSpec) -> None:
        for spec in specs or ALL_STREAMS:
            await self.ensure_stream(spec)

    async def publish(
        self,
        subject: str,
        message: Message,
        *,
        headers: dict[str, str] | None = None,
        attempts: int = 0,
        timeout: float = 5.0,
    ) -> int:
        """Publish to JetStream and wait for the ack; retry with backoff (forever when attempts=0).

        Returns the stream sequence. Retrying makes publishing survive a NATS restart:
        nothing is silently dropped, the caller waits instead.
        """
        data = message.SerializeToString()
        backoff = Backoff(0.05, 2.0)
        n = 0
        while True:
            n += 1
            try:
                ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
                return int(ack.seq)
            except Exception as exc:
                if attempts and n >= attempts:
                    raise
                if n == 1 or n % 20 == 0:
                    log.warning("publish failed, retrying", subject=subject, attempt=n, error=str(exc))
                await backoff.sleep()

    async def follow(
        self,
        subject: str,
        message_type: type[M],
        handler: Callable[[str, M], Awaitable[None]],
        *,
        deliver_new: bool = False,
    ) -> Follower:
        """Replay ``subject`` (a filter such as ``palisade.k8s.>``) from the stream and keep following.

        The handler gets (subject, decoded message) in stream order; a handler error is
        logged and the message skipped, so one bad payload never stops a consumer.
        """
        caught_up = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            decoded = message_type()
            try:
                decoded.ParseFromString(msg.data)
                await handler(msg.subject, decoded)
            except Exception as exc:
                log.error("message handler failed", subject=msg.subject, error=str(exc), exc_info=True)
            if not caught_up.is_set():
                try:
                    if msg.metadata.num_pending == 0:
                        caught_up.set()
                except Exception:
                    pass

        policy = jsapi.DeliverPolicy.NEW if deliver_new else jsapi.DeliverPolicy.ALL
        sub = await self.js.subscribe(
            subject,
            cb=on_msg,
            ordered_consumer=True,
            config=jsapi.ConsumerConfig(deliver_policy=policy),
        )
        if deliver_new:
            caught_up.set()
        else:
            info = await sub.consumer_info()
            # consumer_seq, not stream_seq: with a filter that matches nothing, the server
            # reports the stream's position as delivered while this consumer got nothing.
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if (info.num_pending or 0) == 0 and not delivered:
                caught_up.set()
        return Follower(sub, caught_up)
