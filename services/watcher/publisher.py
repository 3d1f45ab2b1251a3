"""Buffered, ordered, retrying publishing to JetStream.

The reconciler hands messages over without waiting (``submit``), so the sources
keep reading while NATS is slow or restarting. Up to ``max_inflight`` subjects
are published concurrently for throughput; messages of one subject go one after
the other, each retried until acked, so per-subject order (what a compacted
stream keeps) is never inverted. A *barrier* (the synced marker) is published
only after everything submitted before it is acked.

A message may be handed over as a function that builds it: serialising a large
initial list then happens as publishing proceeds, overlapping with waiting for
acks, instead of in one block before the first message leaves.

A message that can never be sent (the sender raised instead of retrying, e.g. it is
larger than the server accepts even after storing its body aside) is dropped and
reported through ``on_failed`` with the reason; it never holds up other subjects,
and a later message of the same subject that goes through clears the report.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import Message

from services.common.log import get_logger
from services.common.retry import raise_if_cancelled

log = get_logger("watcher.publish")

Done = Callable[[], None]
#: Told (subject, reason) when a message of subject cannot be sent, and (subject, "") once one is.
Failed = Callable[[str, str], None]
#: A message, or a function building it when it is about to be sent.
Payload = Message | Callable[[], Message]


class Sender(Protocol):
    """Publishes one message and returns once the stream acked it, retrying as long as needed.

    ``services.common.bus.Bus.publish`` is one.
    """

    async def __call__(self, subject: str, message: Message) -> int: ...


@dataclass(frozen=True, slots=True)
class _Item:
    subject: str
    payload: Payload
    on_done: Done | None
    barrier: bool


class Publisher:
    """Owns the outgoing queue; run :meth:`run` as a task for the life of the watcher."""

    def __init__(self, send: Sender, *, max_inflight: int = 256) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self._send = send
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._chains: dict[str, collections.deque[_Item]] = {}
        self._slots = asyncio.Semaphore(max_inflight)
        self._idle = asyncio.Event()
        self._idle.set()
        self._acked_all = asyncio.Event()
        self._acked_all.set()
        self._pending = 0
        self.published = 0
        #: Subjects whose last message could not be sent, and why.
        self.failed: dict[str, str] = {}
        self.on_failed: Failed | None = None

    @property
    def pending(self) -> int:
        """Messages submitted and not yet acked."""
        return self._pending

    def submit(self, subject: str, message: Payload, on_done: Done | None = None) -> None:
        """Queue ``message``; ``on_done`` runs once the stream acked it."""
        self._pending += 1
        self._acked_all.clear()
        self._queue.put_nowait(_Item(subject, message, on_done, barrier=False))

    def submit_barrier(self, subject: str, message: Payload, on_done: Done | None = None) -> None:
        """Queue ``message`` to be published after every message submitted before it is acked."""
        self._pending += 1
        self._acked_all.clear()
        self._queue.put_nowait(_Item(subject, message, on_done, barrier=True))

    async def wait_idle(self) -> None:
        """Return once everything submitted so far is acked."""
        await self._acked_all.wait()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                raise_if_cancelled()  # a publish that swallowed this task's cancellation returned
                item = await self._queue.get()
                if item.barrier:
                    await self._idle.wait()
                    await self._publish(item)
                    continue
                chain = self._chains.get(item.subject)
                if chain is not None:
                    # Same subject already in flight: go after it, never beside it.
                    chain.append(item)
                    continue
                await self._slots.acquire()
                self._chains[item.subject] = collections.deque([item])
                self._idle.clear()
                tg.create_task(self._drain(item.subject), name=f"publish {item.subject}")

    async def _drain(self, subject: str) -> None:
        chain = self._chains[subject]
        try:
            while chain:
                await self._publish(chain[0])
                chain.popleft()
        finally:
            del self._chains[subject]
            self._slots.release()
            if not self._chains:
                self._idle.set()

    async def _publish(self, item: _Item) -> None:
        try:
            message = item.payload if isinstance(item.payload, Message) else item.payload()
            await self._send(item.subject, message)
        except Exception as exc:
            self._settled()
            reason = f"{item.subject} cannot be published ({type(exc).__name__}: {exc}); it is skipped until it changes"
            log.error("message cannot be published, skipped", subject=item.subject, error=str(exc))
            self.failed[item.subject] = reason
            self._report(item.subject, reason)
            return
        self._settled()
        self.published += 1
        if self.failed.pop(item.subject, None) is not None:
            self._report(item.subject, "")
        if item.on_done is not None:
            try:
                item.on_done()
            except Exception as exc:  # a bookkeeping callback must not stop publishing
                log.error("publish callback failed", subject=item.subject, error=repr(exc), exc_info=True)

    def _settled(self) -> None:
        self._pending -= 1
        if not self._pending:
            self._acked_all.set()

    def _report(self, subject: str, reason: str) -> None:
        if self.on_failed is None:
            return
        try:
            self.on_failed(subject, reason)
        except Exception as exc:  # a bookkeeping callback must not stop publishing
            log.error("publish failure callback failed", subject=subject, error=repr(exc), exc_info=True)
