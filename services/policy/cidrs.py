"""CIDR identities for the prefixes policies name: the engine says which, this keeps ipam in step.

Every prefix a CIDR rule or an ``except`` of an accepted policy names needs an identity
(and ipam an ipcache entry prefix -> identity), or the datapath's longest-prefix match
finds ``world`` for the address and the rule allows nothing. The engine reports the set
of prefixes after each batch (:meth:`PolicyCore.cidr_prefixes`, pure); this component,
the leader's only, holds a reference on each prefix's CIDR identity in ipam (node
:data:`CIDR_HOLDER_NODE`, owner ``cidr/<prefix>``) and releases the ones no policy names
any more. ipam announces the identities and their ipcache entries on the bus, from where
the engine selects them like any identity.

One task owns the state and is woken by :meth:`CidrIdentities.want`, so the commit of a
change never waits on ipam. A failed call (ipam down) is retried with the shared backoff,
logged and shown in status with what to do. A new leader (and, every ``resync_interval``,
the leader itself) re-syncs from what ipam holds: it releases the CIDR identities nobody
names and takes every wanted one again (taking a reference is idempotent per owner).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import grpc

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc
from services.common.errors import Code, PalisadeError
from services.common.labels import CIDR_HOLDER_NODE, cidr_identity_labels, cidr_owner
from services.common.log import get_logger
from services.common.retry import retry

log = get_logger("cidrs")

#: What to do when ipam cannot be reached, in logs and status.
HINT = "check that ipam runs and that --ipam-address names it; until then CIDR rules allow nothing"


class CidrIdentityError(PalisadeError):
    """A call to ipam about a CIDR identity failed; the message says which and why."""


class CidrIdentityPort(Protocol):
    """What the policy service needs from ipam's IdentityService for CIDR identities."""

    async def allocate(self, prefix: str) -> int:
        """Hold a reference on the CIDR identity of ``prefix`` (created if need be); its id."""
        ...

    async def release(self, identity: int, prefix: str) -> None:
        """Drop the reference on ``prefix``'s identity; holding none is no error."""
        ...

    async def referenced(self) -> dict[str, int]:
        """Every CIDR identity with references (by anyone), prefix -> id."""
        ...


class GrpcCidrIdentities:
    """:class:`CidrIdentityPort` over IdentityService."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self._stub = identity_pb2_grpc.IdentityServiceStub(channel)
        self._timeout = timeout

    async def allocate(self, prefix: str) -> int:
        labels = [common_pb2.Label(source=x.source, key=x.key, value=x.value) for x in cidr_identity_labels(prefix)]
        request = identity_pb2.AllocateIdentityRequest(labels=labels, node=CIDR_HOLDER_NODE, owner=cidr_owner(prefix))
        try:
            response = await self._stub.AllocateIdentity(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failed(f"allocating the CIDR identity of {prefix}", exc) from None
        return int(response.identity.id)

    async def release(self, identity: int, prefix: str) -> None:
        request = identity_pb2.ReleaseIdentityRequest(id=identity, node=CIDR_HOLDER_NODE, owner=cidr_owner(prefix))
        try:
            await self._stub.ReleaseIdentity(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return  # not held (any more): what a release wants
            raise _failed(f"releasing the CIDR identity {identity} of {prefix}", exc) from None

    async def referenced(self) -> dict[str, int]:
        try:
            response = await self._stub.ListIdentities(identity_pb2.ListIdentitiesRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _failed("listing identities", exc) from None
        return {
            x.cidr: int(x.id)
            for x in response.identities
            if x.kind == identity_pb2.IDENTITY_KIND_CIDR and x.cidr and x.references > 0
        }


def _failed(what: str, exc: grpc.aio.AioRpcError) -> CidrIdentityError:
    code = Code.__members__.get(exc.code().name, Code.INTERNAL)
    return CidrIdentityError(f"ipam failed {what}: {exc.details() or exc.code().name}", code)


class CidrIdentities:
    """Keeps a CIDR identity allocated in ipam for exactly the prefixes the policies name (leader only)."""

    def __init__(
        self,
        port: CidrIdentityPort,
        *,
        leading: Callable[[], bool],
        resync_interval: float = 60.0,
        retry_initial: float = 0.2,
        retry_max: float = 5.0,
    ) -> None:
        self._port = port
        self._leading = leading
        self._resync_interval = resync_interval
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._wanted: frozenset[str] = frozenset()
        #: prefix -> identity this leader holds; None: not known yet (re-sync with ipam first).
        self._held: dict[str, int] | None = None
        self._wake = asyncio.Event()
        #: What was last logged as held, so that a periodic re-sync logs only what changed.
        self._logged: dict[str, int] = {}
        #: The last failure, until a pass succeeds ("" when in step).
        self.error = ""

    # -- fed by the state-owning task (never waits) ------------------------------------------

    def want(self, prefixes: frozenset[str]) -> None:
        """The prefixes the accepted policies name now."""
        if prefixes != self._wanted:
            self._wanted = prefixes
            self._wake.set()

    def lead(self) -> None:
        """This replica leads now: re-sync with ipam before anything else."""
        self._held = None
        self._wake.set()

    def follow(self) -> None:
        """This replica stepped down: the next leader owns the references."""
        self._held = None

    # -- views -------------------------------------------------------------------------------

    def held(self) -> dict[str, int]:
        return dict(self._held or {})

    def status(self) -> dict[str, str]:
        held = self._held or {}
        out = {"cidr_identities": f"{len(held.keys() & self._wanted)} of {len(self._wanted)} prefixes"}
        if self.error:
            out["cidr_identities_error"] = f"{self.error}; {HINT}"
        return out

    # -- the task ----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._resync_interval)
            except TimeoutError:
                self._held = None  # now and then, make sure ipam still holds what this leader thinks
            self._wake.clear()
            if not self._leading():
                continue
            await retry(
                "cidr identities",
                self._sync,
                initial=self._retry_initial,
                maximum=self._retry_max,
                log_every=5,
                message="cidr identities not in step with ipam, retrying",
                logger=log,
                describe=self._failed,
                fields={"hint": HINT},
            )

    def _failed(self, exc: BaseException) -> str:
        self.error = str(exc)
        return self.error

    async def _sync(self) -> None:
        if not self._leading():
            return
        held = self._held
        if held is None:
            # What a previous leader (or this one, before a restart of ipam) left: release what no
            # policy names; every wanted prefix is taken again below (idempotent per owner).
            found = await self._port.referenced()
            for prefix, identity in sorted(found.items()):
                if prefix not in self._wanted:
                    await self._port.release(identity, prefix)
                    log.info("cidr identity released", prefix=prefix, id=identity, reason="named by no policy")
            held = self._held = {}
        for prefix in sorted(self._wanted - held.keys()):
            held[prefix] = await self._port.allocate(prefix)
            if self._logged.get(prefix) != held[prefix]:
                self._logged[prefix] = held[prefix]
                log.info("cidr identity held", prefix=prefix, id=held[prefix])
        for prefix in sorted(held.keys() - self._wanted):
            identity = held[prefix]
            await self._port.release(identity, prefix)
            del held[prefix]
            self._logged.pop(prefix, None)
            log.info("cidr identity released", prefix=prefix, id=identity, reason="named by no policy")
        if self.error:
            log.info("cidr identities in step with ipam again", prefixes=len(held))
        self.error = ""
