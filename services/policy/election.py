"""Which policy replica leads: a lease in a JetStream key-value bucket.

Every replica consumes the same inputs and keeps a warm engine; exactly one, the
leader, plans, persists and publishes orders. The lease is the key ``leader`` in a
bucket whose entries expire after ``lease`` seconds (the bucket's max age): a replica
becomes leader by creating the key (which succeeds only when it is absent), and keeps
it by updating it, compare-and-set on its own last write, several times per lease. A
leader that dies stops renewing; its key expires and a follower creates it.

The lease decides who *tries* to lead; the state bucket's compare-and-set decides who
*can*: a new leader reads the revision and sequences, confirms it still holds the lease,
and writes them back (its claim) before it plans anything, so a deposed leader that has
not noticed yet fails its next write (EpochConflictError) before it publishes anything,
and one whose takeover reads the state only after the claim finds the lease another's.
Either way (a renewal refused, or that write failing while the lease names another
replica or nobody) the replica steps down: ``stepped_down`` is set, it stops leading, and it
campaigns again only once the service has put its state back to a follower's
(:meth:`Election.resume`). The process never exits over it: losing the leader's seat to a
NATS server's loss, or to a partition, is an ordinary event.

Each replica also keeps ``member.<name>`` fresh in the same bucket (address and role),
which is how ``palisade status`` lists the replicas and how followers find the leader. A
replica whose heartbeat expired (frozen, killed, cut off) stays listed as silent for a
while (:data:`FORGET_AFTER_LEASES`); one that resigned (its heartbeat deleted) goes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js import api as jsapi
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

from services.common.bus import Bus
from services.common.log import get_logger

log = get_logger("election")

LEADER_KEY = "leader"
MEMBER_PREFIX = "member."
#: A replica silent for this many leases is no longer listed (one restarted under another name
#: would otherwise stay forever); until then it is shown with how long it has been silent.
FORGET_AFTER_LEASES = 20


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    address: str
    role: str  # "leader" or "follower"
    #: Server time of the member's last heartbeat (seconds since the epoch).
    seen: float


def _decode(data: bytes | None) -> dict[str, Any]:
    try:
        raw = json.loads(data or b"{}")
    except ValueError:
        return {}
    return raw if isinstance(raw, dict) else {}


class Election:
    """Run with :meth:`run`; ``leading`` is set while this replica holds the lease. Losing it clears
    ``leading`` and sets ``stepped_down`` until :meth:`resume`."""

    def __init__(
        self,
        kv: KeyValue,
        *,
        member: str,
        address: Callable[[], str],
        lease: float,
    ) -> None:
        self._kv = kv
        self.member = member
        self.address = address
        self.lease = lease
        self.leading = asyncio.Event()
        #: Set when this replica lost the lease it held; cleared by :meth:`resume`.
        self.stepped_down = asyncio.Event()
        self._ready = False
        self._resigned = False
        self._wake = asyncio.Event()
        #: Set whenever a leader is known (this replica or another).
        self.leader_known = asyncio.Event()
        self._revision = 0
        #: This process's own mark in the lease: a process restarted in place under the same member
        #: name (``make run``'s ``--member policy``) tells its predecessor's lease from its own by it.
        self._instance = secrets.token_hex(8)
        self.leader: Member | None = None
        self.members: dict[str, Member] = {}

    @classmethod
    async def open(
        cls,
        bus: Bus,
        bucket: str,
        *,
        member: str,
        address: Callable[[], str],
        lease: float,
    ) -> Election:
        try:
            kv = await bus.js.key_value(bucket)
        except BucketNotFoundError:
            kv = await bus.js.create_key_value(
                jsapi.KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    ttl=lease,
                    storage=jsapi.StorageType.FILE,
                    replicas=bus.replicas,
                    description="Palisade policy leader lease and replica heartbeats",
                )
            )
        return cls(kv, member=member, address=address, lease=lease)

    @property
    def role(self) -> str:
        return "leader" if self.leading.is_set() else "follower"

    @property
    def interval(self) -> float:
        """How often the lease is renewed and heartbeats are written: several times per lease."""
        return self.lease / 4

    @property
    def candidate(self) -> bool:
        """This replica's engine is warm: it may lead."""
        return self._ready

    def run_for_leader(self) -> None:
        """This replica's engine is warm: it may lead from now on (it campaigns at once)."""
        self._ready = True
        self._wake.set()

    def _value(self) -> bytes:
        record = {"member": self.member, "address": self.address(), "instance": self._instance, "at": time.time()}
        return json.dumps(record).encode()

    async def run(self) -> None:
        while not self._resigned:
            try:
                if self.leading.is_set():
                    await self._renew()
                elif self._ready and not self.stepped_down.is_set():
                    await self._campaign()
                await self._heartbeat()
                await self._refresh()
            except Exception as exc:  # NATS away: keep trying; the lease decides
                log.warning("election step failed, retrying", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()

    async def _campaign(self) -> None:
        try:
            self._revision = await self._kv.create(LEADER_KEY, self._value())
        except KeyWrongLastSequenceError:
            if not await self._take_from_predecessor():
                return  # somebody leads
        log.info("elected policy leader", member=self.member)
        self.leader = Member(self.member, self.address(), "leader", time.time())
        self.leading.set()
        self.leader_known.set()

    async def _take_from_predecessor(self) -> bool:
        """A lease naming this very address was held by a process that is gone: this one holds its port.

        That is a replica restarted in place (a kill -9, a crash): it need not wait for the lease to
        expire. Deleting is compare-and-set on the entry read, so a lease renewed meanwhile stays.
        """
        try:
            entry = await self._kv.get(LEADER_KEY)
        except KeyNotFoundError:
            return False
        raw = _decode(entry.value)
        if not self._predecessor(raw):
            return False
        try:
            await self._kv.delete(LEADER_KEY, last=entry.revision)
            self._revision = await self._kv.create(LEADER_KEY, self._value())
        except KeyWrongLastSequenceError:
            return False
        log.info("took over the lease of this address's previous process", previous=str(raw.get("member")))
        return True

    def _predecessor(self, raw: dict[str, object]) -> bool:
        """A lease record naming this replica's address, written by another process (another member,
        or this member's name from another process): the process that held this port before (only
        one process can), so it is gone."""
        return raw.get("address") == self.address() and not self._own(raw)

    def _own(self, raw: dict[str, object]) -> bool:
        """A lease record this very process wrote."""
        return raw.get("member") == self.member and raw.get("instance") == self._instance

    async def _renew(self) -> None:
        try:
            self._revision = await self._kv.update(LEADER_KEY, self._value(), last=self._revision)
        except KeyWrongLastSequenceError:
            # Taken by another replica, or expired while NATS was away. Even a lease nobody took
            # is not simply taken again: another replica may have led (and published) meanwhile,
            # so this one steps down and, if it wins again, takes over anew from the stored state.
            self._step_down(f"it could not renew its lease within {self.lease:g}s")

    def _step_down(self, why: str) -> None:
        if not self.leading.is_set():
            return
        self.leading.clear()
        self.leader = None
        self.stepped_down.set()
        log.warning("policy leader stepped down to follower", member=self.member, reason=why)

    def resume(self) -> None:
        """The service dropped its leader's state after a step-down: this replica may lead again."""
        self.stepped_down.clear()
        self._wake.set()

    async def confirm(self) -> bool:
        """Whether this leader still holds its lease, read now; if not (another replica holds it,
        or it expired), step down.

        For a leader taking over, after it read the stored state; and for a leader whose state write
        was refused: a new leader took over (step down), or, while the lease is still its own,
        somebody else writes the state bucket (a real conflict).
        """
        if not self.leading.is_set():
            return False
        try:
            raw = _decode((await self._kv.get(LEADER_KEY)).value)
        except KeyNotFoundError:
            self._step_down(f"its lease expired (not renewed within {self.lease:g}s)")
            return False
        if self._own(raw) and raw.get("address") == self.address():
            return True
        self._step_down(f"{raw.get('member')} holds the lease")
        return False

    async def _heartbeat(self) -> None:
        record = {"address": self.address(), "role": self.role, "at": time.time()}
        await self._kv.put(MEMBER_PREFIX + self.member, json.dumps(record).encode())

    async def _refresh(self) -> None:
        """Who leads, and every replica: those with a heartbeat, and those whose heartbeat expired."""
        try:
            entry = await self._kv.get(LEADER_KEY)
            raw = _decode(entry.value)
            if self._predecessor(raw):
                # This address's previous process, gone (a kill -9): no leader to follow or forward
                # to. The campaign takes its lease once this replica is warm; until then reads are
                # answered here, as with no leader at all.
                self.leader = None
            else:
                self.leader = Member(str(raw.get("member", "")), str(raw.get("address", "")), "leader", 0.0)
                self.leader_known.set()
        except KeyNotFoundError:
            self.leader = None
        members = {}
        with contextlib.suppress(NoKeysError):
            for key in [k for k in await self._kv.keys() if k.startswith(MEMBER_PREFIX)]:
                with contextlib.suppress(KeyNotFoundError):
                    raw = _decode((await self._kv.get(key)).value)
                    name = key.removeprefix(MEMBER_PREFIX)
                    members[name] = Member(
                        name, str(raw.get("address", "")), str(raw.get("role", "")), float(raw.get("at", 0.0))
                    )
        forget = time.time() - FORGET_AFTER_LEASES * self.lease
        for name, member in self.members.items():
            if name not in members and member.seen > forget and not await self._resigned_member(name):
                members[name] = member  # silent: status shows for how long
        self.members = members

    async def _resigned_member(self, name: str) -> bool:
        """Whether the replica deleted its heartbeat (a clean stop) rather than letting it expire."""
        try:
            await self._kv.get(MEMBER_PREFIX + name)
        except KeyNotFoundError as err:
            return err.op is not None  # a delete marker (the client's KeyDeletedError, re-raised)
        return False

    async def resign(self) -> None:
        """On a clean shutdown: give the lease up at once, so a follower need not wait for it to expire."""
        self._resigned = True
        self._wake.set()  # run() ends after the step under way
        with contextlib.suppress(Exception):
            await self._kv.delete(MEMBER_PREFIX + self.member)
        if self.leading.is_set():
            with contextlib.suppress(Exception):
                await self._kv.delete(LEADER_KEY, last=self._revision)
                log.info("leader lease released", member=self.member)
