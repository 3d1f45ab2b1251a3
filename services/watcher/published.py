"""Read back what the compacted k8s stream holds, so a (re)started watcher can reconcile against it."""

from __future__ import annotations

import json
from dataclasses import dataclass

from palisade.v1 import k8s_pb2
from services.common.bus import Bus
from services.common.largeobjects import LargeObjects
from services.common.log import get_logger
from services.common.subjects import k8s_filter, k8s_object_kind
from services.watcher.kinds import BY_PROTO, KindInfo
from services.watcher.objects import KObject, ObjectKey

log = get_logger("watcher.published")


def from_delta(delta: k8s_pb2.K8sDelta) -> KObject | None:
    """The object an UPSERT delta describes; None for tombstones and unreadable payloads."""
    if delta.op != k8s_pb2.DELTA_OP_UPSERT:
        return None
    info = BY_PROTO.get(int(delta.kind))
    if info is None:
        return None
    try:
        body = json.loads(delta.object_json)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        log.warning("unreadable object on the stream ignored", kind=info.kind.value, name=delta.name)
        return None
    return KObject(
        info=info,
        key=ObjectKey(info.kind, delta.namespace, delta.name),
        uid=delta.uid,
        resource_version=delta.resource_version,
        body=body,
        origin=delta.origin,
        conflict=delta.conflict,
    )


@dataclass(frozen=True, slots=True)
class Published:
    """What the stream holds: the objects, and the stored large objects their deltas reference by subject."""

    objects: list[KObject]
    refs: dict[str, str]


async def load_published(bus: Bus, kinds: tuple[KindInfo, ...], large: LargeObjects) -> Published:
    """Every object of ``kinds`` the stream currently holds as upserted (tombstoned ones are left out).

    Replays the stream once up to where it stood when following began (the watcher is
    the stream's only writer, and not yet running). An object whose stored large body is
    gone counts as not published (it is published again).
    """
    tokens = {info.kind.value for info in kinds}
    found: dict[str, KObject] = {}
    refs: dict[str, str] = {}

    async def on_msg(subject: str, data: bytes) -> None:
        if k8s_object_kind(subject) not in tokens:
            return  # the synced marker, statuses and unwatched kinds are not objects here
        refs.pop(subject, None)
        obj: KObject | None = None
        try:
            delta = k8s_pb2.K8sDelta.FromString(data)
            if delta.object_ref:
                refs[subject] = delta.object_ref
            full = await large.resolved(delta)
            obj = from_delta(full) if full is not None else None
        except Exception as exc:  # a foreign payload must not stop the watcher from starting
            log.warning("undecodable message on the stream ignored", subject=subject, error=str(exc))
        if obj is None:
            found.pop(subject, None)
        else:
            found[subject] = obj

    follower = await bus.follow_raw([k8s_filter()], on_msg)
    try:
        await follower.caught_up.wait()
    finally:
        await follower.stop()
    return Published(list(found.values()), refs)
