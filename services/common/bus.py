"""The NATS JetStream helper: connect, provision streams, publish protobufs, follow subjects.

Every Palisade subject starts with ``palisade.``. State subjects (k8s objects,
identities, ipcache) live in compacted streams that keep one message per subject,
so a consumer that (re)starts replays exactly the current state; deletions are
tombstones. Regeneration orders keep a bounded history.

The connection reconnects forever. While it is down :attr:`Bus.connected` is false
(the status plumbing shows it); when it comes back every :class:`Follower` re-creates
its consumer at once from the last message it handled (an ordered consumer would
otherwise notice the server lost it only after missed heartbeats, seconds later), and
:meth:`Bus.retry` loops waiting out the outage retry immediately.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse

import nats
from google.protobuf.message import Message
from nats.aio.client import Client as NATSClient
from nats.aio.msg import Msg
from nats.errors import (
    ConnectionReconnectingError,
    MaxPayloadError,
    NoRespondersError,
    StaleConnectionError,
)
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.object_store import ObjectStore

from services.common.access import INBOX_PREFIX
from services.common.log import get_logger
from services.common.retry import StartupError, reach, retry, tcp_probe

# Subject names live in services.common.subjects; these stay importable from here.
from services.common.subjects import IDENTITY_ALL, IPCACHE_ALL, REGEN_ALL, k8s_filter
from services.common.subjects import SYNCED_SUBJECT as SYNCED_SUBJECT
from services.common.subjects import identity_subject as identity_subject
from services.common.subjects import ipcache_subject as ipcache_subject
from services.common.subjects import k8s_subject as k8s_subject
from services.common.subjects import regen_subject as regen_subject
from services.common.subjects import token as token
from services.common.trust import Credentials

log = get_logger("bus")

#: Errors of a NATS call that time cures: a clustered stream electing a new leader after losing
#: its server (the call times out or finds no responder meanwhile), the client moving to another
#: server. Startup calls retry on these alone; any other error is a real one and is raised.
TRANSIENT: tuple[type[Exception], ...] = (
    asyncio.TimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    ConnectionReconnectingError,
    StaleConnectionError,
)

#: JetStream API error codes of a cluster whose servers have not all joined yet: 10005, "no
#: suitable peers for placement" (a leader is elected, but too few peers are known to place
#: three replicas). A management call retries them like :data:`TRANSIENT`.
FORMING: frozenset[int] = frozenset({10005})


class ClusterForming(Exception):
    """JetStream cannot place replicas yet: the servers of the cluster are still joining it."""


#: Seconds a JetStream management call (streams, consumers, buckets) keeps retrying the
#: errors of :data:`TRANSIENT`, as while the servers of a cluster form it and elect its leader,
#: before it fails with a :class:`StartupError` that says what to check.
MANAGEMENT_PATIENCE = 60.0

M = TypeVar("M", bound=Message)
T = TypeVar("T")

#: Seconds between a consumer's idle heartbeats (see Follower._config).
HEARTBEAT = 1.0

#: Consumers a stream allows. Every datapath holds an ordered consumer on each stream it follows
#: (its orders, the ipcache, identities, Services), so a stream has about one per node, and
#: briefly two while a re-created one replaces its predecessor. nats-server 2.15 caps a stream
#: that sets no limit at 1,000 consumers (``default_max_consumers``): the 1,001st node of a
#: cluster could not follow its orders. Set on every stream, far above the nodes of a cluster
#: but bounded, so a consumer leak still meets a limit.
MAX_CONSUMERS = 100_000

#: What a raw follower hands each message to: (subject, payload).
MsgHandler = Callable[[str, bytes], Awaitable[None]]


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


K8S_STREAM = StreamSpec("PALISADE_K8S", (k8s_filter(),))
IDENTITY_STREAM = StreamSpec("PALISADE_IDENTITY", (IDENTITY_ALL,))
IPCACHE_STREAM = StreamSpec("PALISADE_IPCACHE", (IPCACHE_ALL,))
REGEN_STREAM = StreamSpec("PALISADE_REGEN", (REGEN_ALL,), compacted=False, history=10_000, max_age=3600.0)
ALL_STREAMS = (K8S_STREAM, IDENTITY_STREAM, IPCACHE_STREAM, REGEN_STREAM)


def replicas_for(servers: Sequence[str]) -> int:
    """JetStream replicas for a bus of ``servers``: 3 on a cluster of three or more, else 1.

    R3 survives the loss of any one server (a quorum of two keeps the stream writable).
    """
    return 3 if len(servers) >= 3 else 1


def _stream_config(spec: StreamSpec, replicas: int = 1) -> jsapi.StreamConfig:
    return jsapi.StreamConfig(
        name=spec.name,
        num_replicas=replicas,
        subjects=list(spec.subjects),
        storage=jsapi.StorageType.FILE,
        retention=jsapi.RetentionPolicy.LIMITS,
        max_msgs_per_subject=1 if spec.compacted else spec.history,
        max_age=spec.max_age or None,
        discard=jsapi.DiscardPolicy.OLD,
        max_consumers=MAX_CONSUMERS,
    )


class Follower:
    """A running ordered consumer that replays a subject filter, then follows it.

    ``caught_up`` is set once everything that was in the stream when following
    began has been handed to the callback (immediately if there was nothing).
    After a reconnect, :meth:`restart` re-creates the consumer from the stream
    sequence after the last message handled, so nothing is lost or repeated.
    """

    def __init__(self, bus: Bus, filters: Sequence[str], handler: MsgHandler, *, deliver_new: bool = False) -> None:
        self._bus = bus
        self._filters = list(filters)
        self._handler = handler
        self._deliver_new = deliver_new
        self._sub: Any = None
        #: Stream sequence of the last message handled (or known to be before the first one wanted).
        self._last = 0
        self._stopped = False
        self._restarting: asyncio.Task[None] | None = None
        self.caught_up = asyncio.Event()

    @property
    def subject(self) -> str:
        return ",".join(self._filters)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            meta = msg.metadata
            seq = int(meta.sequence.stream)
            pending = int(meta.num_pending)
        except Exception:  # not a JetStream message; hand it over anyway
            seq, pending = 0, -1
        if seq and seq <= self._last:
            return  # already handled before the consumer was re-created
        try:
            await self._handler(msg.subject, msg.data)
        except Exception as exc:
            log.error("message handler failed", subject=msg.subject, error=str(exc), exc_info=True)
        if seq:
            self._last = seq
        if pending == 0:
            self.caught_up.set()

    def _config(self) -> jsapi.ConsumerConfig:
        config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL)
        if self._last:
            config = jsapi.ConsumerConfig(
                deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._last + 1
            )
        elif self._deliver_new:
            config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.NEW)
        if len(self._filters) > 1:
            config.filter_subjects = list(self._filters)
        # The client re-creates an ordered consumer after two missed heartbeats: on a cluster
        # that lost the server holding the consumer, this bounds the pause to about 2 s.
        config.idle_heartbeat = HEARTBEAT
        return config

    async def _subscribe(self) -> Any:
        return await self._bus.js.subscribe(
            self._filters[0], cb=self._on_msg, ordered_consumer=True, config=self._config()
        )

    async def start(self) -> None:
        # A stream that lost its leader with a server answers again once the cluster elects another.
        self._sub = await self._bus.manage("create consumer", self._subscribe, subject=self.subject)
        sub = self._sub
        info = await self._bus.manage("read consumer", sub.consumer_info, subject=self.subject)
        delivered = info.delivered
        if self._deliver_new:
            # Restarting from here loses nothing: the consumer starts after this stream position.
            self._last = max(self._last, int(delivered.stream_seq or 0) if delivered else 0)
            self.caught_up.set()
            return
        # consumer_seq, not stream_seq: with a filter that matches nothing, the server
        # reports the stream's position as delivered while this consumer got nothing.
        if (info.num_pending or 0) == 0 and not (delivered.consumer_seq if delivered else 0):
            self.caught_up.set()

    def restart_soon(self) -> None:
        """Re-create the consumer in the background (called on reconnect)."""
        if self._stopped or (self._restarting is not None and not self._restarting.done()):
            return
        self._restarting = asyncio.get_running_loop().create_task(self.restart(), name=f"follow {self.subject}")

    async def restart(self) -> None:
        old, self._sub = self._sub, None
        if old is not None:
            try:
                await old.unsubscribe()
            except Exception:  # the old consumer went with the server
                pass
        if self._stopped:
            return
        self._sub = await self._bus.retry("re-create consumer", self._subscribe, subject=self.subject)
        log.info("consumer re-created", subject=self.subject, after=self._last)

    async def stop(self) -> None:
        self._stopped = True
        self._bus.unregister(self)
        if self._restarting is not None:
            self._restarting.cancel()
        try:
            if self._sub is not None:
                await self._sub.unsubscribe()
        except Exception:  # already closed with the connection
            pass


class Bus:
    """A NATS connection with JetStream, used as ``async with await Bus.connect(...)``."""

    def __init__(
        self,
        nc: NATSClient,
        js: JetStreamContext,
        name: str,
        replicas: int = 1,
        *,
        patience: float = MANAGEMENT_PATIENCE,
    ) -> None:
        self.nc = nc
        self.js = js
        self.name = name
        #: Replicas of the streams and buckets this bus creates (by the number of servers it was given).
        self.replicas = replicas
        #: Seconds a JetStream management call waits out a cluster that is forming or electing.
        self.patience = patience
        #: Set while connected; cleared on disconnect.
        self._up = asyncio.Event()
        self._up.set()
        #: Wall-clock time the connection went down (None while connected).
        self.down_since: float | None = None
        #: Bumped on every reconnect, so retry loops know to start their backoff over.
        self.reconnects = 0
        self._followers: list[Follower] = []

    @property
    def connected(self) -> bool:
        return self.down_since is None and not self.nc.is_closed

    def problem(self) -> str | None:
        """Why the bus cannot be used right now (None when it can), for status answers."""
        if self.nc.is_closed:
            return "closed"
        if self.down_since is not None:
            return f"down for {time.time() - self.down_since:.0f}s, reconnecting"
        return None

    def _disconnected(self) -> None:
        if self.down_since is None:
            self.down_since = time.time()
        self._up.clear()

    def _reconnected(self) -> None:
        self.down_since = None
        self.reconnects += 1
        self._up.set()
        for follower in list(self._followers):
            follower.restart_soon()

    def unregister(self, follower: Follower) -> None:
        if follower in self._followers:
            self._followers.remove(follower)

    async def pause(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less if the connection comes back meanwhile."""
        if self._up.is_set():
            await asyncio.sleep(delay)
            return
        try:
            await asyncio.wait_for(self._up.wait(), delay)
        except TimeoutError:
            pass

    async def retry(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        *,
        attempts: int = 0,
        final: tuple[type[Exception], ...] = (),
        only: tuple[type[Exception], ...] = (Exception,),
        **fields: object,
    ) -> T:
        """:func:`services.common.retry.retry` with the bus's settings, for calls over the bus.

        Exceptions of the ``final`` types, or of none of the ``only`` types (:data:`TRANSIENT`
        for the calls a service makes to start), are raised at once: retrying cannot help them.
        The wait ends early when the connection comes back, and the backoff starts over, so a
        bus outage costs no more than the outage itself.
        """
        return await self._retry(what, call, attempts=attempts, final=final, only=only, fields=fields)

    def _waiter(self) -> Callable[[float], Awaitable[bool]]:
        """A wait between attempts that ends when the connection comes back (then the backoff starts over)."""
        seen = self.reconnects

        async def wait(delay: float) -> bool:
            nonlocal seen
            if self.reconnects == seen:
                await self.pause(delay)
            restart, seen = self.reconnects != seen, self.reconnects
            return restart

        return wait

    async def _retry(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        *,
        attempts: int = 0,
        deadline: float | None = None,
        final: tuple[type[Exception], ...] = (),
        only: tuple[type[Exception], ...] = (Exception,),
        give_up: Callable[[Exception, int], BaseException] | None = None,
        fields: Mapping[str, object],
    ) -> T:
        return await retry(
            what,
            call,
            attempts=attempts,
            deadline=deadline,
            initial=0.05,
            maximum=2.0,
            final=final,
            only=only,
            give_up=give_up,
            log_every=20,
            message="bus call failed, retrying",
            logger=log,
            wait=self._waiter(),
            fields=fields,
        )

    async def manage(self, what: str, call: Callable[[], Awaitable[T]], **fields: object) -> T:
        """A JetStream management call (stream, consumer, bucket): retried on :data:`TRANSIENT` errors
        for :attr:`patience` seconds, then a :class:`StartupError` naming it and what to check.

        A cluster whose servers are still forming it answers with timeouts and "JetStream
        unavailable" until they elect a leader, then "no suitable peers for placement" until
        enough of them have joined (:data:`FORMING`); any other error is raised at once.
        """

        def unavailable(exc: Exception, attempts: int) -> StartupError:
            named = ", ".join(f"{k} {v}" for k, v in fields.items())
            return StartupError(
                f"NATS JetStream did not answer {what!r}{f' ({named})' if named else ''} within {self.patience:.0f}s "
                f"({attempts} attempts, last: {type(exc).__name__} {exc}); check that the NATS servers are up, "
                "run with JetStream (-js) and, on a cluster, have formed it (their logs name the routes they miss)"
            )

        async def once() -> T:
            try:
                return await call()
            except APIError as exc:
                if exc.err_code in FORMING:
                    raise ClusterForming(f"{exc.description} (JetStream error {exc.err_code})") from exc
                raise

        return await self._retry(
            what, once, only=(*TRANSIENT, ClusterForming), deadline=self.patience, give_up=unavailable, fields=fields
        )

    @classmethod
    async def connect(
        cls,
        servers: list[str],
        *,
        name: str,
        retries: int = 10,
        backoff: float = 0.2,
        tls: Credentials | None = None,
        patience: float = MANAGEMENT_PATIENCE,
    ) -> Bus:
        """Connect, retrying at startup; afterwards the client reconnects forever with backoff.

        With ``tls`` the client proves its component name with its certificate (NATS maps it
        to the user of that name) and checks that the server is ``nats``; it receives on its
        own inbox prefix, the only subjects its user may subscribe to.
        """
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

        await reach(
            "NATS",
            address,
            probe,
            retries=retries,
            backoff=backoff,
            hint="start nats-server (with -js) or set --nats-url / PALISADE_NATS_URL",
        )

        async def on_error(exc: Exception) -> None:
            log.warning("nats error", error=str(exc))

        holder: list[Bus] = []

        async def on_disconnect() -> None:
            log.warning("nats disconnected", servers=address)
            for bus in holder:
                bus._disconnected()

        async def on_reconnect() -> None:
            log.info("nats reconnected", servers=address)
            for bus in holder:
                bus._reconnected()

        secure: dict[str, Any] = {}
        if tls is not None:
            secure = {
                "tls": tls.client_ssl_context(),
                "tls_hostname": "nats",
                "inbox_prefix": INBOX_PREFIX + tls.name,
            }
        nc = await nats.connect(
            servers,
            name=name,
            **secure,
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
        bus = cls(nc, nc.jetstream(), name, replicas_for(servers), patience=patience)
        holder.append(bus)
        return bus

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        # Unsubscribe the followers first: a JetStream ordered consumer's heartbeat and flow-control
        # tasks outlive a drained connection otherwise.
        for follower in list(self._followers):
            await follower.stop()
        try:
            await asyncio.wait_for(self.nc.drain(), 5)
        except Exception:
            await self.nc.close()
        await self._settle_consumer_recreations()

    async def _settle_consumer_recreations(self) -> None:
        """Let the consumer re-creations nats-py started for this connection end with it.

        nats-py re-creates an ordered consumer (after missed heartbeats, as when a cluster
        loses the consumer's server) in a task it does not keep; once the connection is
        closed its request fails at once, so nothing of this bus outlives close().
        """
        mine = []
        for task in asyncio.all_tasks():
            coro = task.get_coro()
            frame = getattr(coro, "cr_frame", None)
            if getattr(coro, "__qualname__", "").endswith("_JSI.recreate_consumer") and frame is not None:
                owner = frame.f_locals.get("self")
                if getattr(owner, "_conn", None) is self.nc:
                    mine.append(task)
        if mine:
            await asyncio.wait(mine, timeout=5)

    async def ensure_stream(self, spec: StreamSpec) -> None:
        """Create the stream, or bring an existing one to this config; idempotent; once (no retry).

        Services call :meth:`ensure_streams`, which waits out a cluster that is forming.
        """
        config = _stream_config(spec, self.replicas)
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
        """Each stream as :meth:`ensure_stream`, through :meth:`manage`: a cluster that is forming or
        electing its leader is waited out for :attr:`patience` seconds."""
        for spec in specs or ALL_STREAMS:
            await self.manage("ensure stream", functools.partial(self.ensure_stream, spec), stream=spec.name)

    async def object_store(self, bucket: str, description: str) -> ObjectStore:
        """Bind to a JetStream object store bucket (which chunks what it stores), creating it on first use;
        waits out a cluster that is electing the bucket's leader."""
        return await self.manage("open object store", lambda: self._object_store(bucket, description), bucket=bucket)

    async def _object_store(self, bucket: str, description: str) -> ObjectStore:
        try:
            return await self.js.object_store(bucket)
        except BucketNotFoundError:
            try:
                config = jsapi.ObjectStoreConfig(
                    description=description, storage=jsapi.StorageType.FILE, replicas=self.replicas
                )
                store = await self.js.create_object_store(bucket, config)
            except Exception as exc:  # created concurrently by another process
                if "already in use" not in str(exc):
                    raise
                return await self.js.object_store(bucket)
            log.info("object store created", bucket=bucket)
            return store

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
        nothing is silently dropped, the caller waits instead. A message larger than the
        server's max payload raises MaxPayloadError at once (no retry can send it).
        """
        data = message.SerializeToString()

        async def once() -> int:
            ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
            return int(ack.seq)

        return await self.retry("publish", once, attempts=attempts, final=(MaxPayloadError,), subject=subject)

    @property
    def max_payload(self) -> int:
        """The largest message the server accepts, bytes."""
        return int(self.nc.max_payload)

    async def holds(self, spec: StreamSpec, subject_filter: str) -> bool:
        """Whether the stream currently holds any message on ``subject_filter`` (through :meth:`manage`)."""
        info = await self.manage(
            "read stream", lambda: self.js.stream_info(spec.name, subjects_filter=subject_filter), stream=spec.name
        )
        return bool(info.state.subjects)

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

        async def decoded(msg_subject: str, data: bytes) -> None:
            message = message_type()
            message.ParseFromString(data)
            await handler(msg_subject, message)

        return await self.follow_raw([subject], decoded, deliver_new=deliver_new)

    async def follow_raw(self, filters: Sequence[str], handler: MsgHandler, *, deliver_new: bool = False) -> Follower:
        """Like :meth:`follow`, for several filters of one stream in one stream order, undecoded.

        For consumers that need the order between subjects carrying different messages
        (policy deltas and the synced marker).
        """
        if not filters:
            raise ValueError("follow_raw needs at least one subject filter")
        follower = Follower(self, filters, handler, deliver_new=deliver_new)
        await follower.start()
        self._followers.append(follower)
        return follower
