"""Read back what the compacted k8s stream holds, so a (re)started watcher can reconcile against it."""

from __future__ import annotations

import asyncio
import json

from nats.aio.msg import Msg
from nats.js import api as jsapi

from palisade.v1 import k8s_pb2
from services.common.bus import K8S_STREAM, Bus
from services.common.log import get_logger
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
    )


async def load_published(bus: Bus, kinds: tuple[KindInfo, ...]) -> list[KObject]:
    """Every object of ``kinds`` the stream currently holds as upserted (tombstoned ones are left out).

    Reads the stream once with an ordered consumer up to its last sequence at the
    time of the call (the watcher is the stream's only writer, and not yet running).
    """
    state = (await bus.js.stream_info(K8S_STREAM.name)).state
    if not state.messages:
        return []
    last = state.last_seq
    tokens = {info.kind.value for info in kinds}
    found: dict[str, KObject] = {}
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        parts = msg.subject.split(".")
        # palisade.k8s.<kind>.<namespace>.<name>; the synced marker and status are not objects.
        if len(parts) == 5 and parts[2] in tokens:
            try:
                obj = from_delta(k8s_pb2.K8sDelta.FromString(msg.data))
            except Exception as exc:  # a foreign payload must not stop the watcher from starting
                log.warning("undecodable message on the stream ignored", subject=msg.subject, error=str(exc))
                obj = None
            if obj is None:
                found.pop(msg.subject, None)
            else:
                found[msg.subject] = obj
        meta = msg.metadata
        if meta.sequence.stream >= last or meta.num_pending == 0:
            done.set()

    sub = await bus.js.subscribe(
        "palisade.k8s.>",
        cb=on_msg,
        ordered_consumer=True,
        config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL),
    )
    try:
        await done.wait()
    finally:
        await sub.unsubscribe()
    return list(found.values())
