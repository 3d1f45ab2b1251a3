"""Typed etcd access for ipam: reads, transactions and leases, retried through etcd outages.

This is the only ipam module that talks to etcd. It speaks etcd's v3 protocol
through the stubs of the connected aetcd client rather than aetcd's convenience
wrappers, because allocation needs what those drop: the response header's
revision and the results of the reads inside a failed transaction, in the same
round trip.

Concurrent transactions are sent together (see :mod:`services.ipam.batch`): those
that arrive while one is in flight go as the nested transactions of one, when their
keys are disjoint, so a burst of allocations costs one round trip and one raft
proposal instead of one each. Every caller still gets its own transaction's result.

Transient failures (etcd restarting, leader elections, a closed channel) are
retried with backoff for up to ``patience`` seconds, then raised as
:class:`StoreUnavailable`. A retried transaction may already have been applied;
every transaction ipam sends is guarded by compares, so a repeat fails instead of
doing the work twice, and callers re-read to find out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import aetcd
import grpc
from aetcd import rpc

from services.common.log import get_logger
from services.common.retry import retry
from services.ipam import metrics
from services.ipam.batch import Coalescer, Interval, point

log = get_logger("etcd")

T = TypeVar("T")

_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


class StoreError(Exception):
    """etcd refused a request (not an outage)."""


class StoreUnavailable(StoreError):
    """etcd did not answer within the patience window."""


class _Transient(Exception):
    """An etcd failure worth retrying (unreachable, or a transient status); says what happened."""


class LeaseNotFound(StoreError):
    """A put named a lease that has expired or was revoked."""


@dataclasses.dataclass(frozen=True, slots=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One watched change: a key written (``deleted`` False, ``kv`` its new value) or deleted.

    For a deletion ``kv.mod_revision`` is the revision of the deletion and ``kv.value`` is empty.
    """

    kv: KV
    deleted: bool

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


class Compacted(StoreError):
    """The revision a watch asked to start from was compacted away: reload, then watch from there."""


class Target(enum.StrEnum):
    VALUE = "value"
    CREATE = "create"
    MOD = "mod"
    VERSION = "version"


class Cmp(enum.StrEnum):
    EQUAL = "=="
    NOT_EQUAL = "!="
    LESS = "<"
    GREATER = ">"


@dataclasses.dataclass(frozen=True, slots=True)
class Compare:
    """One transaction guard. With ``prefix`` (or ``end``) it must hold for every key under ``key``
    (or in [key, end)); for an empty range, ``create == 0`` means "nothing there")."""

    key: bytes
    target: Target
    cmp: Cmp
    operand: int | bytes
    prefix: bool = False
    end: bytes = b""


@dataclasses.dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    prefix: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Get:
    key: bytes
    prefix: bool = False
    #: Only count the keys (:attr:`TxnResult.counts`); reads nothing.
    count_only: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Txn:
    """A nested transaction (its reads are not reported)."""

    compares: tuple[Compare, ...]
    success: tuple[Put | Delete | Txn, ...] = ()
    failure: tuple[Put | Delete | Txn, ...] = ()


Op = Put | Delete | Get | Txn


@dataclasses.dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    #: The store revision after the transaction (the mod revision of whatever it wrote).
    revision: int
    #: One list per Get of the branch that ran, in order.
    reads: tuple[tuple[KV, ...], ...]
    #: An earlier attempt failed in transit, so it may have been applied already.
    retried: bool = False
    #: One count per Get of the branch that ran (keys in its range), in order.
    counts: tuple[int, ...] = ()

    def first(self, index: int) -> KV | None:
        found = self.reads[index]
        return found[0] if found else None


def value_is(key: bytes, value: bytes) -> Compare:
    return Compare(key, Target.VALUE, Cmp.EQUAL, value)


def absent(key: bytes) -> Compare:
    return Compare(key, Target.CREATE, Cmp.EQUAL, 0)


def mod_is(key: bytes, revision: int) -> Compare:
    """The key's last write was at ``revision`` (0: the key is absent)."""
    return Compare(key, Target.MOD, Cmp.EQUAL, revision)


def none_under(prefix: bytes) -> Compare:
    return Compare(prefix, Target.CREATE, Cmp.EQUAL, 0, prefix=True)


def none_between(start: bytes, end: bytes) -> Compare:
    """No key in [start, end)."""
    return Compare(start, Target.CREATE, Cmp.EQUAL, 0, end=end)


def range_end(prefix: bytes) -> bytes:
    """The end of the key range of every key starting with ``prefix``."""
    s = bytearray(prefix)
    for i in reversed(range(len(s))):
        if s[i] < 0xFF:
            s[i] += 1
            return bytes(s[: i + 1])
    return b"\0"


_CMP = {Cmp.EQUAL: 0, Cmp.GREATER: 1, Cmp.LESS: 2, Cmp.NOT_EQUAL: 3}
_TARGET = {Target.VERSION: 0, Target.CREATE: 1, Target.MOD: 2, Target.VALUE: 3}


def _compare(c: Compare) -> Any:
    msg = rpc.Compare(key=c.key, result=_CMP[c.cmp], target=_TARGET[c.target])
    if c.prefix:
        msg.range_end = range_end(c.key)
    elif c.end:
        msg.range_end = c.end
    if c.target == Target.VALUE:
        msg.value = c.operand if isinstance(c.operand, bytes) else str(c.operand).encode()
    elif c.target == Target.CREATE:
        msg.create_revision = int(c.operand)
    elif c.target == Target.MOD:
        msg.mod_revision = int(c.operand)
    else:
        msg.version = int(c.operand)
    return msg


def _range(key: bytes, prefix: bool, *, keys_only: bool = False, count_only: bool = False) -> Any:
    req = rpc.RangeRequest(key=key, keys_only=keys_only, count_only=count_only)
    if prefix:
        req.range_end = range_end(key)
    return req


def _request(op: Op) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        req = rpc.DeleteRangeRequest(key=op.key)
        if op.prefix:
            req.range_end = range_end(op.key)
        return rpc.RequestOp(request_delete_range=req)
    if isinstance(op, Get):
        return rpc.RequestOp(request_range=_range(op.key, op.prefix, count_only=op.count_only))
    return rpc.RequestOp(request_txn=_txn_request(op.compares, op.success, op.failure))


def _txn_request(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> Any:
    return rpc.TxnRequest(
        compare=[_compare(c) for c in compares],
        success=[_request(op) for op in success],
        failure=[_request(op) for op in failure],
    )


def _kv(msg: Any) -> KV:
    return KV(bytes(msg.key), bytes(msg.value), int(msg.create_revision), int(msg.mod_revision), int(msg.lease))


def _extent(key: bytes, prefix: bool, end: bytes = b"") -> Interval:
    if prefix:
        return key, range_end(key)
    return (key, end) if end else point(key)


def footprint(compares: Sequence[Compare], ops: Iterable[Op]) -> list[Interval]:
    """Every key range a transaction compares, reads or writes (nested transactions included)."""
    out = [_extent(c.key, c.prefix, c.end) for c in compares]
    for op in ops:
        if isinstance(op, Txn):
            out += footprint(op.compares, (*op.success, *op.failure))
        elif isinstance(op, Put):
            out.append(point(op.key))
        else:
            out.append(_extent(op.key, op.prefix))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _TxnCall:
    compares: Sequence[Compare]
    success: Sequence[Op]
    failure: Sequence[Op]


def _result(resp: Any, revision: int, retried: bool) -> TxnResult:
    """A (possibly nested) transaction's response as a result; ``revision`` from the outer header."""
    ranges = [r.response_range for r in resp.responses if r.WhichOneof("response") == "response_range"]
    return TxnResult(
        bool(resp.succeeded),
        revision,
        tuple(tuple(_kv(kv) for kv in r.kvs) for r in ranges),
        retried=retried,
        counts=tuple(int(r.count) for r in ranges),
    )


#: Transactions sent together at most (etcd refuses more than 128 operations in one, by default).
MAX_BATCH = 64


class Store:
    """ipam's handle on etcd (shared by every allocator of the process).

    ``batch``: at most this many concurrent transactions go as one (1: each alone).
    """

    def __init__(
        self, client: aetcd.Client, *, patience: float = 30.0, call_timeout: float = 5.0, batch: int = MAX_BATCH
    ) -> None:
        self._client = client
        self.patience = patience
        self._timeout = call_timeout
        self._batcher: Coalescer[_TxnCall, TxnResult] = Coalescer(self._send, max_batch=max(1, batch))

    @property
    def batching(self) -> tuple[int, int]:
        """(batches sent, transactions in them) so far."""
        return self._batcher.batches, self._batcher.requests

    async def _call(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        async def once() -> T:
            try:
                await self._client.connect()
                return await attempt()
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (exc.details() or ""):
                    raise LeaseNotFound(exc.details()) from None
                if code not in _TRANSIENT:
                    raise StoreError(f"etcd refused {what}: {code.name} {exc.details()}") from None
                raise _Transient(f"{code.name} {exc.details()}") from None
            except (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError) as exc:
                raise _Transient(str(exc)) from None
            except TimeoutError:
                raise _Transient("connect timed out") from None

        def unavailable(exc: Exception, attempts: int) -> StoreUnavailable:
            return StoreUnavailable(
                f"etcd did not answer {what} for {self.patience:.0f}s ({exc}); check that etcd is up"
            )

        return await retry(
            what,
            once,
            deadline=self.patience,
            initial=0.05,
            maximum=1.0,
            only=(_Transient,),
            give_up=unavailable,
            log_every=20,
            message="etcd call failed, retrying",
            logger=log,
        )

    @property
    def _meta(self) -> Any:
        return self._client.metadata

    async def get(self, key: bytes) -> KV | None:
        async def attempt() -> KV | None:
            resp = await self._client.kvstub.Range(_range(key, False), timeout=self._timeout, metadata=self._meta)
            return _kv(resp.kvs[0]) if resp.kvs else None

        return await self._call("get", attempt)

    async def get_prefix(self, prefix: bytes, *, keys_only: bool = False) -> tuple[list[KV], int]:
        """Every key under ``prefix`` (sorted by key) and the store revision of the read."""

        async def attempt() -> tuple[list[KV], int]:
            req = _range(prefix, True, keys_only=keys_only)
            resp = await self._client.kvstub.Range(req, timeout=self._timeout, metadata=self._meta)
            return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

        return await self._call("get prefix", attempt)

    async def count(self, prefix: bytes) -> int:
        async def attempt() -> int:
            req = _range(prefix, True, count_only=True)
            resp = await self._client.kvstub.Range(req, timeout=self._timeout, metadata=self._meta)
            return int(resp.count)

        return await self._call("count", attempt)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        async def attempt() -> int:
            req = rpc.PutRequest(key=key, value=value, lease=lease)
            resp = await self._client.kvstub.Put(req, timeout=self._timeout, metadata=self._meta)
            return int(resp.header.revision)

        return await self._call("put", attempt)

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete a key (or every key under a prefix); returns how many went."""

        async def attempt() -> int:
            req = rpc.DeleteRangeRequest(key=key)
            if prefix:
                req.range_end = range_end(key)
            resp = await self._client.kvstub.DeleteRange(req, timeout=self._timeout, metadata=self._meta)
            return int(resp.deleted)

        return await self._call("delete", attempt)

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """One transaction; sent together with others in flight when their keys are disjoint."""
        call = _TxnCall(compares, success, failure)
        return await self._batcher.submit(call, footprint(compares, (*success, *failure)))

    async def _send(self, calls: Sequence[_TxnCall]) -> Sequence[TxnResult | BaseException]:
        metrics.ETCD_BATCHES.inc()
        metrics.ETCD_TRANSACTIONS.inc(len(calls))
        if len(calls) == 1:
            return [await self._txn(calls[0])]
        try:
            return await self._txn_batch(calls)
        except StoreUnavailable:
            raise
        except StoreError:
            # One of them makes etcd refuse the whole (a lease expired): each alone gets its own answer.
            outcomes = await asyncio.gather(*(self._txn(call) for call in calls), return_exceptions=True)
            return list(outcomes)

    async def _txn(self, call: _TxnCall) -> TxnResult:
        request = _txn_request(call.compares, call.success, call.failure)
        attempts = 0

        async def attempt() -> TxnResult:
            nonlocal attempts
            attempts += 1
            resp = await self._client.kvstub.Txn(request, timeout=self._timeout, metadata=self._meta)
            return _result(resp, int(resp.header.revision), attempts > 1)

        return await self._call("transaction", attempt)

    async def _txn_batch(self, calls: Sequence[_TxnCall]) -> list[TxnResult]:
        """The transactions as the nested ones of one transaction without compares (so all of them run)."""
        request = rpc.TxnRequest(
            success=[rpc.RequestOp(request_txn=_txn_request(c.compares, c.success, c.failure)) for c in calls]
        )
        attempts = 0

        async def attempt() -> list[TxnResult]:
            nonlocal attempts
            attempts += 1
            resp = await self._client.kvstub.Txn(request, timeout=self._timeout, metadata=self._meta)
            revision = int(resp.header.revision)
            return [_result(r.response_txn, revision, attempts > 1) for r in resp.responses]

        return await self._call("transactions", attempt)

    async def revision(self) -> int:
        """The store's current revision."""

        async def attempt() -> int:
            req = _range(b"/palisade/", True, count_only=True)
            resp = await self._client.kvstub.Range(req, timeout=self._timeout, metadata=self._meta)
            return int(resp.header.revision)

        return await self._call("revision", attempt)

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[Change]:
        """Every change under ``prefix`` from ``start_revision`` on, in revision order, until the stream breaks.

        Raises :class:`Compacted` when ``start_revision`` is no longer in etcd's history; a broken
        stream (etcd restarting) ends with an exception: watch again from the next revision.
        """
        await self._client.connect()
        try:
            watch = await self._client.watch_prefix(prefix, start_revision=start_revision)
        except aetcd.exceptions.RevisionCompactedError as exc:
            raise Compacted(f"revision {start_revision} was compacted (below {exc.compacted_revision})") from None
        try:
            async for event in watch:
                kv = event.kv
                yield Change(
                    # aetcd's watch events carry no lease; nothing here needs it.
                    KV(bytes(kv.key), bytes(kv.value or b""), int(kv.create_revision), int(kv.mod_revision), 0),
                    deleted=event.kind == "DELETE",
                )
        except aetcd.exceptions.RevisionCompactedError as exc:
            raise Compacted(f"revision {start_revision} was compacted (below {exc.compacted_revision})") from None
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""

        async def attempt() -> int:
            req = rpc.LeaseGrantRequest(TTL=ttl)
            resp = await self._client.leasestub.LeaseGrant(req, timeout=self._timeout, metadata=self._meta)
            if resp.error:
                raise StoreError(f"etcd refused a lease: {resp.error}")
            return int(resp.ID)

        return await self._call("lease grant", attempt)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns its new TTL, 0 when the lease no longer exists."""

        async def attempt() -> int:
            stream = self._client.leasestub.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self._timeout, metadata=self._meta
            )
            async for reply in stream:
                return int(reply.TTL)
            return 0

        return await self._call("lease keepalive", attempt)

    async def revoke(self, lease_id: int) -> None:
        async def attempt() -> None:
            req = rpc.LeaseRevokeRequest(ID=lease_id)
            await self._client.leasestub.LeaseRevoke(req, timeout=self._timeout, metadata=self._meta)

        try:
            await self._call("lease revoke", attempt)
        except LeaseNotFound:
            pass
