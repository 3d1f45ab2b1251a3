"""The one owner of the watcher's state: applies source events to the cache and hands deltas,
the synced marker and source status to the publisher.

Ready means synced: once every kind has been listed (or found missing), the
SyncedMarker is published behind all initial deltas; ``synced`` is set when it
is acked. A kind that appears or disappears later republishes the marker.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

from google.protobuf.timestamp_pb2 import Timestamp

from palisade.v1 import common_pb2, k8s_pb2
from services.common.log import get_logger
from services.common.subjects import SYNCED_SUBJECT, k8s_object_kind, status_subject
from services.watcher.cache import Change, Diff, ObjectCache, Op
from services.watcher.kinds import Kind, KindInfo
from services.watcher.metrics import WatcherMetrics
from services.watcher.objects import KObject
from services.watcher.publisher import Publisher
from services.watcher.source import Deleted, KindMissing, Listed, Problem, SourceEvent, Upserted

log = get_logger("watcher")

_OPS = {Op.UPSERT: k8s_pb2.DELTA_OP_UPSERT, Op.DELETE: k8s_pb2.DELTA_OP_DELETE}


def _now() -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(time.time_ns())
    return ts


def to_delta(change: Change, source: str, observed_at: Timestamp) -> k8s_pb2.K8sDelta:
    """The wire form of one change."""
    obj = change.obj
    return k8s_pb2.K8sDelta(
        kind=obj.info.proto,
        op=_OPS[change.op],
        namespace=obj.key.namespace,
        name=obj.key.name,
        uid=obj.uid,
        resource_version=obj.resource_version,
        object_json=json.dumps(obj.body, separators=(",", ":")).encode(),
        source=source,
        origin=obj.origin,
        observed_at=observed_at,
        conflict=obj.conflict,
    )


class Reconciler:
    def __init__(
        self,
        *,
        source: str,
        status_token: str,
        kinds: tuple[KindInfo, ...],
        publisher: Publisher,
        metrics: WatcherMetrics,
    ) -> None:
        self.source = source
        self._status_subject = status_subject(status_token)
        self._kinds = kinds
        self._publisher = publisher
        self._metrics = metrics
        self._cache = ObjectCache()
        self._listed: set[Kind] = set()
        self._missing: dict[Kind, str] = {}
        self._errors: dict[str, str] = {}
        self._marker_sent = False
        #: Set once the first synced marker is acked by the stream.
        self.synced = asyncio.Event()
        publisher.on_failed = self._publish_failed

    # -- state from the bus -------------------------------------------------

    def seed(self, objects: list[KObject]) -> None:
        """What the stream holds from earlier runs; diffed against the first lists."""
        for obj in objects:
            self._cache.seed(obj)
        for info in self._kinds:
            self._metrics.objects.labels(info.kind.value).set(self._cache.count(info.kind))
        log.info("stream state loaded", objects=len(objects))

    # -- events -------------------------------------------------------------

    def handle(self, event: SourceEvent) -> None:
        if isinstance(event, Upserted):
            self._count_received(event.obj.key.kind, 1)
            self._apply(event.obj.key.kind, self._cache.upsert(event.obj))
        elif isinstance(event, Deleted):
            self._count_received(event.obj.key.kind, 1)
            self._apply(event.obj.key.kind, self._cache.delete(event.obj))
        elif isinstance(event, Listed):
            self._count_received(event.kind, len(event.objects))
            if event.relist:
                self._metrics.relists.labels(event.kind.value).inc()
            self._apply(event.kind, self._cache.replace(event.kind, event.objects))
            self._kind_present(event.kind)
        elif isinstance(event, KindMissing):
            self._kind_missing(event)
        elif isinstance(event, Problem):
            self._problem(event)

    def _count_received(self, kind: Kind, n: int) -> None:
        if n:
            self._metrics.received.labels(kind.value).inc(n)

    def _apply(self, kind: Kind, diff: Diff) -> None:
        if diff.skipped:
            self._metrics.skipped.labels(kind.value).inc(diff.skipped)
        if diff.changes:
            observed = _now()
            for change in diff.changes:
                self._submit(change, observed)
        self._metrics.objects.labels(kind.value).set(self._cache.count(kind))

    def _submit(self, change: Change, observed: Timestamp) -> None:
        published = self._metrics.published.labels(change.obj.key.kind.value, change.op.value)
        self._publisher.submit(
            change.obj.key.subject, functools.partial(to_delta, change, self.source, observed), published.inc
        )

    def _kind_present(self, kind: Kind) -> None:
        first = kind not in self._listed
        self._listed.add(kind)
        was_missing = self._missing.pop(kind, None) is not None
        if was_missing:
            log.info("kind available again", kind=kind.value)
            self._set_error(kind.value, "")
        if first or was_missing:
            self._maybe_mark_synced(changed=was_missing)

    def _kind_missing(self, event: KindMissing) -> None:
        kind = event.kind
        if self._missing.get(kind) == event.reason:
            return
        newly = kind not in self._missing
        self._missing[kind] = event.reason
        self._listed.discard(kind)
        if newly:
            self._metrics.errors.labels(kind.value, "missing_kind").inc()
            log.warning("kind not served, retrying in background", kind=kind.value, reason=event.reason)
        # Not served means none exist (deleting a CRD deletes its objects): tombstone what the bus holds.
        self._apply(kind, self._cache.replace(kind, ()))
        self._set_error(kind.value, event.reason)
        self._maybe_mark_synced(changed=True)

    def _problem(self, event: Problem) -> None:
        if event.message:
            self._metrics.errors.labels(event.kind.value if event.kind else "", event.reason.value).inc()
        self._set_error(event.origin, event.message)

    def _publish_failed(self, subject: str, reason: str) -> None:
        if subject == self._status_subject:
            return  # the status itself: nothing to report it on
        if reason:
            self._metrics.errors.labels(k8s_object_kind(subject) or "", "publish").inc()
        self._set_error(f"publish {subject}", reason)

    def _set_error(self, origin: str, message: str) -> None:
        before = self._errors.get(origin, "")
        if before == message:
            return
        if message:
            self._errors[origin] = message
        else:
            self._errors.pop(origin, None)
        status = k8s_pb2.SourceStatus(source=self.source, errors=self._errors, at=_now())
        self._publisher.submit(self._status_subject, status)

    def _maybe_mark_synced(self, *, changed: bool) -> None:
        done = all(info.kind in self._listed or info.kind in self._missing for info in self._kinds)
        if not done or (self._marker_sent and not changed):
            return
        marker = k8s_pb2.SyncedMarker(
            kinds=[i.kind.value for i in self._kinds if i.kind in self._listed],
            source=self.source,
            synced_at=_now(),
            missing_kinds=[i.kind.value for i in self._kinds if i.kind in self._missing],
        )
        first = not self._marker_sent
        self._marker_sent = True
        self._publisher.submit_barrier(SYNCED_SUBJECT, marker, self._on_marker_acked)
        if first:
            log.info("initial lists complete", kinds=",".join(marker.kinds), missing=",".join(marker.missing_kinds))

    def _on_marker_acked(self) -> None:
        if not self.synced.is_set():
            log.info("synced", source=self.source)
        self.synced.set()
        self._metrics.synced.set(1)

    # -- status -------------------------------------------------------------

    def errors(self) -> dict[str, str]:
        """The problems reported now, by origin (a file, a kind, a conflicting definition)."""
        return dict(self._errors)

    def fill_status(self, status: common_pb2.ServiceStatus) -> None:
        status.synced = self.synced.is_set()
        status.details["source"] = self.source
        for info in self._kinds:
            status.details[f"objects.{info.kind.value}"] = str(self._cache.count(info.kind))
        for kind, reason in self._missing.items():
            status.details[f"missing.{kind.value}"] = reason
        for origin, message in sorted(self._errors.items()):
            status.details[f"error.{origin}"] = message
        status.details["errors"] = str(len(self._errors))
        status.details["publish_pending"] = str(self._publisher.pending)
        status.details["published"] = str(self._publisher.published)
