"""The persisted revision and per-node order sequences, in a JetStream key-value bucket.

Saved before the orders that use them are published, so a restarted service
always continues above anything a datapath has seen: the revision never goes
back and a node's sequence never repeats. Writes are compare-and-set on the
bucket entry's own revision, so a second policy service writing the same bucket
is detected instead of silently interleaving sequences.

A new leader's first write is a claim (:meth:`RevisionStore.claim`): the state it read,
written back under its own writer name once it has confirmed it still holds the lease.
From then on a deposed leader's next write fails, and a deposed leader whose takeover reads
the state only later finds the lease another's: it never continues, and so never repeats,
the sequences of the leader that replaced it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from services.common.log import get_logger
from services.common.retry import retry
from services.policy.engine.orders import PolicyEpoch

log = get_logger("revision")

#: The bucket key of the epoch (named "state" in buckets written before the rename: kept).
EPOCH_KEY = "state"


class EpochConflictError(RuntimeError):
    """Someone else wrote the state bucket: two policy services share it."""


class EpochCorruptError(RuntimeError):
    """The stored state cannot be read."""


def encode_epoch(epoch: PolicyEpoch, writer: str = "") -> bytes:
    """``writer`` names the leader (and its claim) that wrote it: no two leaders write the same bytes."""
    record: dict[str, Any] = {"revision": epoch.revision, "sequences": dict(sorted(epoch.sequences.items()))}
    if writer:
        record["writer"] = writer
    return json.dumps(record).encode()


def decode_epoch(data: bytes, *, where: str) -> PolicyEpoch:
    try:
        raw: Any = json.loads(data)
        revision = raw["revision"]
        sequences = raw["sequences"]
        if not isinstance(revision, int) or revision < 0 or not isinstance(sequences, dict):
            raise ValueError("revision must be a non-negative integer and sequences an object")
        for node, seq in sequences.items():
            if not isinstance(seq, int) or seq < 0:
                raise ValueError(f"sequence of node {node!r} must be a non-negative integer")
    except (ValueError, KeyError, TypeError) as exc:
        raise EpochCorruptError(
            f"{where} holds no valid policy state ({exc}); restore it from a backup, or delete it "
            "knowing that revisions then restart from 0 and every datapath must resync"
        ) from None
    return PolicyEpoch(revision, {str(k): int(v) for k, v in sequences.items()})


class RevisionStore:
    """The policy revision and per-node order sequences (:class:`PolicyEpoch`), under one key of a KV bucket."""

    def __init__(self, kv: KeyValue, bucket: str, *, pause: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._kv = kv
        self._bucket = bucket
        #: Waits between retries; the bus's pause ends early when NATS comes back.
        self._pause = pause
        self._last = 0
        self._saved: PolicyEpoch | None = None
        #: Written with every save after a claim (see :meth:`claim`).
        self._writer = ""

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str,
        *,
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
        replicas: int = 1,
    ) -> RevisionStore:
        """Bind to the bucket, creating it on first use (with ``replicas`` copies on a cluster)."""
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                jsapi.KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    storage=jsapi.StorageType.FILE,
                    replicas=replicas,
                    description="Palisade policy revision and per-node order sequences",
                )
            )
            log.info("state bucket created", bucket=bucket)
        return cls(kv, bucket, pause=pause)

    @property
    def where(self) -> str:
        return f"key {EPOCH_KEY!r} of bucket {self._bucket}"

    async def load(self) -> PolicyEpoch:
        try:
            entry = await self._kv.get(EPOCH_KEY)
        except KeyNotFoundError:
            self._last = 0
            self._saved = PolicyEpoch()
            return self._saved
        self._last = int(entry.revision or 0)
        self._saved = decode_epoch(entry.value or b"", where=self.where)
        log.info("state loaded", revision=self._saved.revision, nodes=len(self._saved.sequences))
        return self._saved

    async def claim(self, member: str) -> None:
        """Write back the state just loaded, under this claim's name: a new leader's first write.

        It moves the entry's revision, so the compare-and-set of a leader deposed meanwhile
        fails from now on; EpochConflictError if somebody wrote since the load (read again).
        The writer's name (member and a claim id) makes the entry's bytes this claim's own:
        a retried write whose ack was lost is recognised as ours, another leader's never is.
        """
        assert self._saved is not None, "claim() follows load()"
        self._writer = f"{member}/{secrets.token_hex(6)}"
        await self._write(self._saved)

    async def save(self, epoch: PolicyEpoch) -> None:
        """Write ``epoch``; retries until NATS answers, raises EpochConflictError on a foreign write."""
        if epoch != self._saved:
            await self._write(epoch)

    async def _write(self, epoch: PolicyEpoch) -> None:
        data = encode_epoch(epoch, self._writer)

        async def once() -> None:
            try:
                self._last = await self._kv.update(EPOCH_KEY, data, last=self._last)
            except KeyWrongLastSequenceError:
                if not await self._written_by_us(data):
                    raise EpochConflictError(
                        f"{self.where} was changed by another writer; run one policy service per state "
                        "bucket (set --state-bucket) and restart this one"
                    ) from None
            self._saved = epoch

        async def wait(delay: float) -> bool:
            await self._pause(delay)
            return False

        await retry(
            "save policy state",
            once,
            initial=0.05,
            maximum=2.0,
            final=(EpochConflictError,),
            log_every=20,
            message="state save failed, retrying",
            logger=log,
            wait=wait,
        )

    async def _written_by_us(self, data: bytes) -> bool:
        """A retried write whose first attempt landed (its ack got lost) is not a conflict."""
        try:
            entry = await self._kv.get(EPOCH_KEY)
        except KeyNotFoundError:
            return False
        if entry.value == data:
            self._last = int(entry.revision or 0)
            return True
        return False
