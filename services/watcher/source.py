"""What a source (the Kubernetes API or a manifest folder) tells the watcher, and the source interface."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.watcher.kinds import Kind, KindInfo
from services.watcher.objects import KObject


class ProblemReason(enum.StrEnum):
    """Why a source reports a problem; the ``reason`` label of the errors metric."""

    #: The list or watch request failed or the stream broke; retried with backoff.
    STREAM = "stream"
    #: The kind is not served (CRD not installed); retried in the background.
    MISSING_KIND = "missing_kind"
    #: A manifest file does not parse; its objects keep their last good state.
    PARSE = "parse"
    #: The manifest folder cannot be read.
    FOLDER = "folder"
    #: An object is defined in several manifest files; the first definition stays in force.
    CONFLICT = "conflict"


@dataclass(frozen=True, slots=True)
class Listed:
    """The complete current set of one kind (initial list, relist after 410 Gone, or a rescan)."""

    kind: Kind
    objects: tuple[KObject, ...]
    #: A relist after the watch history expired (410 Gone), not the first list.
    relist: bool = False


@dataclass(frozen=True, slots=True)
class Upserted:
    obj: KObject


@dataclass(frozen=True, slots=True)
class Deleted:
    #: The last state of the object, as the source reported it.
    obj: KObject


@dataclass(frozen=True, slots=True)
class KindMissing:
    """The source does not serve ``kind`` (e.g. its CRD is not installed); none of its objects exist."""

    kind: Kind
    reason: str


@dataclass(frozen=True, slots=True)
class Problem:
    """A problem at ``origin`` (a kind token or a manifest file); an empty message clears it."""

    origin: str
    message: str
    reason: ProblemReason
    #: The kind concerned, if any (for metrics).
    kind: Kind | None = None


SourceEvent = Listed | Upserted | Deleted | KindMissing | Problem
Emit = Callable[[SourceEvent], None]


class Source(Protocol):
    """Produces events for a set of kinds until cancelled. ``emit`` never blocks."""

    #: Written into K8sDelta.source: "kubernetes" or "manifests:<dir>".
    name: str
    #: The subject token of its status: palisade.k8s.status.<status_token>.
    status_token: str
    kinds: tuple[KindInfo, ...]

    def seed(self, published: Sequence[KObject]) -> None:
        """What the bus holds from an earlier run, before :meth:`run` (a source may need it)."""

    async def run(self, emit: Emit) -> None: ...
