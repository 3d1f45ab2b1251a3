"""The manifest-folder source: a directory of YAML/JSON manifests stands in for the API server.

Files (``*.yaml``, ``*.yml``, ``*.json``, recursively, hidden ones skipped) hold
one or more documents or ``kind: List`` objects. The folder is scanned when inotify
says a file was written and closed, created, moved or deleted (see :mod:`inotify`),
and polled as well, rarely, as a safety net (often where inotify is unavailable): a file
whose (mtime, size, inode) changed, or that changed very recently, is read and
hashed, and only a new hash is parsed. After any change the whole folder's
objects are handed over as one ``Listed`` per kind, and the reconciler turns
that into the deltas a cluster would produce. Objects get a synthetic uid
(stable per kind/namespace/name unless the file gives one) and a synthetic,
increasing resourceVersion that moves only when the object's content changes.

A file that fails to parse is reported (``Problem``) and its objects keep their
last good state until the file is fixed or removed: the state this run last read,
or, for a file already broken when the watcher starts, the state an earlier run
published (the bus holds it, with each object's file).

An object defined in several files is an error on the files that lose (``Problem``)
and on the object (``conflict``, shown in its policy status); the definition in
force stays in force until it is removed, whatever order files change in, and
the next in path order takes over then. At start, the definition in force is the
one the bus holds; with nothing on the bus, the first in path order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import PalisadeError, clip
from services.common.log import get_logger
from services.common.manifests import Document, DocumentError, split_documents
from services.watcher.clusterips import assign_cluster_ips
from services.watcher.endpointslices import PodAddresses, SliceInputs, endpoint_slices, slice_inputs
from services.watcher.inotify import FolderWatch
from services.watcher.kinds import KINDS, Kind, KindInfo, lookup
from services.watcher.objects import KObject, ObjectKey, check_names, from_api
from services.watcher.source import Emit, Listed, Problem, ProblemReason, SourceEvent

log = get_logger("watcher.manifests")

SUFFIXES = (".yaml", ".yml", ".json")
STATUS_TOKEN = "manifests"
#: A file modified this recently is re-hashed on every poll: two writes within one
#: timestamp tick and of the same size would otherwise go unnoticed.
_RECENT_NS = 2_000_000_000
_UID_NAMESPACE = uuid.UUID("5f0c6a52-8f4e-4c55-9a77-0d6f6f1a5e11")


class ManifestError(DocumentError):
    """A manifest file cannot be used; the message says which file, which object and why."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """The watched objects of one file, and the ones of other kinds that were ignored."""

    objects: tuple[KObject, ...]
    ignored: tuple[str, ...]


# -- pure parsing ---------------------------------------------------------------


def synthetic_uid(info: KindInfo, namespace: str, name: str) -> str:
    return str(uuid.uuid5(_UID_NAMESPACE, f"{info.kind.value}/{namespace}/{name}"))


def to_objects(docs: list[Document], origin: str) -> Parsed:
    """Watched objects from split documents: namespaces defaulted, uid filled in, other kinds ignored."""
    objects: list[KObject] = []
    ignored: list[str] = []
    for doc in docs:
        body, where = doc.body, doc.source
        api_version, api_kind = body.get("apiVersion"), body.get("kind")
        if not isinstance(api_version, str) or not isinstance(api_kind, str) or not api_version or not api_kind:
            raise ManifestError(f"{where}: apiVersion and kind are required")
        meta = body.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        info = lookup(api_version, api_kind)
        if info is None:
            ignored.append(f"{api_version} {api_kind} {name or '?'}")
            continue
        if not isinstance(meta, Mapping) or not isinstance(name, str) or not name:
            raise ManifestError(f"{where} ({api_kind}): metadata.name is required")
        new_meta = dict(meta)
        if info.namespaced:
            namespace = new_meta.get("namespace") or "default"
            if not isinstance(namespace, str):
                raise ManifestError(f"{where} ({api_kind} {name}): metadata.namespace must be a string")
            new_meta["namespace"] = namespace
        else:
            new_meta.pop("namespace", None)
            namespace = ""
        try:
            check_names(info, name, namespace, new_meta.get("labels"))
        except PalisadeError as exc:
            raise ManifestError(f"{where} ({api_kind} {clip(name, 80)}): {exc.message}") from None
        new_meta.setdefault("uid", synthetic_uid(info, namespace, name))
        new_meta.pop("resourceVersion", None)  # assigned by the source
        objects.append(from_api(info, {**body, "metadata": new_meta}, origin=origin))
    return Parsed(tuple(objects), tuple(ignored))


def parse_file(origin: str, data: bytes) -> Parsed:
    """Parse one file's bytes; ``origin`` is its path relative to the folder (messages start with it)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{origin}: not UTF-8 text ({exc})") from None
    try:
        docs = split_documents(text, origin, json_file=origin.endswith(".json"))
    except DocumentError as exc:
        raise ManifestError(exc.message) from None
    return to_objects(docs, origin)


DEV_CLUSTER_ORIGIN = "(dev cluster)"  # also endpointslices.ORIGIN


def schedule(objects: Mapping[ObjectKey, KObject], nodes: Mapping[str, str]) -> dict[ObjectKey, KObject]:
    """What the API server holds once a dev cluster's scheduler and kubelets have run.

    Each pod whose ``spec.nodeName`` names none of ``nodes`` is bound to one, chosen by a hash
    of its name (stable across restarts, spread over the nodes), as kube-scheduler would bind
    an unscheduled one; each node the folder does not define gets a Node object with its
    address, as a kubelet would register it.
    """
    names = sorted(nodes)
    out = dict(objects)
    for key, obj in objects.items():
        if key.kind is not Kind.POD:
            continue
        spec = obj.body.get("spec")
        spec = dict(spec) if isinstance(spec, Mapping) else {}
        if spec.get("nodeName") in nodes:
            continue
        spec["nodeName"] = names[zlib.crc32(f"{key.namespace}/{key.name}".encode()) % len(names)]
        out[key] = dataclasses.replace(obj, body={**obj.body, "spec": spec})
    info = lookup("v1", "Node")
    assert info is not None
    defined = {key.name for key in objects if key.kind is Kind.NODE}
    for name in names:
        if name in defined:
            continue
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": synthetic_uid(info, "", name),
                "labels": {"kubernetes.io/hostname": name},
            },
            "status": {"addresses": [{"type": "InternalIP", "address": nodes[name]}]},
        }
        node = from_api(info, body, origin=DEV_CLUSTER_ORIGIN)
        out[node.key] = node
    return out


def with_resource_version(obj: KObject, rv: str) -> KObject:
    meta = dict(obj.body.get("metadata") or {})
    meta["resourceVersion"] = rv
    return dataclasses.replace(obj, resource_version=rv, body={**obj.body, "metadata": meta})


# -- the polling source -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Version:
    """What a listing made of one object: the instance it was given, its content, and the object
    with its resource version. A file that did not change gives the same instance again, which
    needs no serializing."""

    given: KObject
    content: str
    listed: KObject


@dataclass(slots=True)
class _File:
    fingerprint: tuple[int, int, int]
    digest: bytes
    #: The last good objects; kept while the file does not parse.
    objects: tuple[KObject, ...]
    error: str = ""


class ManifestSource:
    """Scans ``root`` on every notified change (and every ``poll_interval`` seconds) and emits its state."""

    status_token = STATUS_TOKEN

    def __init__(
        self,
        root: Path,
        *,
        kinds: tuple[KindInfo, ...] = KINDS,
        poll_interval: float = 0.5,
        notify: bool = True,
        notified_poll_interval: float = 5.0,
        dev_nodes: Mapping[str, str] | None = None,
        service_cidr: str = "",
    ) -> None:
        self.root = root
        #: A dev cluster's nodes (name -> address): this source schedules pods onto them.
        self._dev_nodes = dict(dev_nodes or {})
        #: A dev cluster's service range: this source gives Services their ClusterIPs and keeps
        #: their EndpointSlices from the pods' addresses (:meth:`set_pod_addresses`).
        self._service_cidr = service_cidr
        self._pod_addresses: dict[tuple[str, str], tuple[str, ...]] = {}
        #: The addresses the last listing used (a snapshot: scans run on another thread).
        self._listed_addresses: PodAddresses = {}
        self._addresses_changed: asyncio.Event | None = None
        self.name = f"manifests:{root}"
        self.kinds = kinds
        self._poll = poll_interval
        self._notify = notify
        #: With notifications the poll is only a safety net (a file system that misses some).
        self._notified_poll = max(poll_interval, notified_poll_interval)
        #: Whether notifications drive the scans (None until :meth:`run` starts).
        self.notified: bool | None = None
        self._files: dict[str, _File] = {}
        #: Per kind, what the last listing made of each object (a kind is pruned alone).
        self._versions: dict[Kind, dict[ObjectKey, _Version]] = {}
        #: What the dev cluster's slices are made from, as of the last listing.
        self._slice_inputs: SliceInputs | None = None
        self._last_rv = 0
        self._listed_once = False
        self._folder_error = ""
        #: Per file, what an earlier run published from it (its last good state before this run).
        self._seeded: dict[str, tuple[KObject, ...]] = {}
        #: The file whose definition of an object is in force, for objects several files define.
        self._owners: dict[ObjectKey, str] = {}
        #: Problem origin -> message, for the definitions that lose to the one in force.
        self._conflicts: dict[str, str] = {}

    def seed(self, published: Sequence[KObject]) -> None:
        by_file: dict[str, list[KObject]] = {}
        for obj in published:
            if obj.origin:
                by_file.setdefault(obj.origin, []).append(obj)
                self._owners[obj.key] = obj.origin
        self._seeded = {rel: tuple(objs) for rel, objs in by_file.items()}

    def set_pod_addresses(self, namespace: str, pod: str, ips: tuple[str, ...]) -> None:
        """A pod's addresses (none: it has none any more), as the cluster's ipcache says; a dev cluster's
        EndpointSlices follow them."""
        key = (namespace, pod)
        if self._pod_addresses.get(key, ()) == ips:
            return
        if ips:
            self._pod_addresses[key] = ips
        else:
            self._pod_addresses.pop(key, None)
        if self._addresses_changed is not None:
            self._addresses_changed.set()

    async def run(self, emit: Emit) -> None:
        watch = FolderWatch.open(self.root) if self._notify else None
        self.notified = watch is not None
        poll = self._notified_poll if watch is not None else self._poll
        self._addresses_changed = asyncio.Event()
        log.info("watching manifests", folder=str(self.root), notified=self.notified, poll_interval=poll)
        if watch is not None:
            watch.start()
        try:
            addresses: PodAddresses | None = dict(self._pod_addresses)
            while True:
                for event in await asyncio.to_thread(self.scan, addresses):
                    emit(event)
                if await self._wait(watch, poll):
                    # Writes often come in bursts (an editor's save, a `cp -r`): take them in one scan.
                    await asyncio.sleep(0.002)
                    if watch is not None:
                        await watch.changed(0)
                addresses = None
                if self._addresses_changed.is_set():
                    self._addresses_changed.clear()
                    addresses = dict(self._pod_addresses)
        finally:
            if watch is not None:
                watch.close()

    async def _wait(self, watch: FolderWatch | None, poll: float) -> bool:
        """Until the folder or a pod's addresses changed (True), or the poll interval passed."""
        assert self._addresses_changed is not None
        folder = asyncio.ensure_future(watch.changed(poll) if watch is not None else asyncio.sleep(poll, False))
        addresses = asyncio.ensure_future(self._addresses_changed.wait())
        try:
            done, _ = await asyncio.wait((folder, addresses), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (folder, addresses):
                task.cancel()
            await asyncio.gather(folder, addresses, return_exceptions=True)
        return bool(folder in done and folder.result())

    def scan(self, addresses: PodAddresses | None = None) -> list[SourceEvent]:
        """One poll of the folder: the events its changes produce (none if nothing changed).

        ``addresses``: the pods' addresses changed to these (a dev cluster's slices follow).
        Only ever called by one thread at a time; it owns the source's state.
        """
        events: list[SourceEvent] = []
        if not self.root.is_dir():
            message = (
                f"manifest folder {self.root} does not exist or is not a folder; "
                "create it or point --manifests at your manifests (objects keep their last state)"
            )
            if self._folder_error != message:
                self._folder_error = message
                log.error("manifest folder unreadable", folder=str(self.root))
                events.append(Problem(".", message, ProblemReason.FOLDER))
            return events
        if self._folder_error:
            self._folder_error = ""
            events.append(Problem(".", "", ProblemReason.FOLDER))

        present = set(self._walk())
        changed = not self._listed_once
        moved = addresses is not None and addresses != self._listed_addresses
        if moved:
            assert addresses is not None
            self._listed_addresses = addresses
        for rel in sorted(set(self._files) - present):
            gone = self._files.pop(rel)
            changed = True
            log.info("manifest file removed", file=rel, objects=len(gone.objects))
            if gone.error:
                events.append(Problem(rel, "", ProblemReason.PARSE))
        now = time.time_ns()
        for rel in sorted(present):
            changed |= self._check_file(rel, now, events)
        if changed:
            events.extend(self._listing())
            self._listed_once = True
        elif moved:
            # Only the pods' addresses: only the dev cluster's slices can follow (one pod starting
            # in a cluster of thousands must not cost a pass over every object).
            events.extend(self._slice_listing())
        return events

    def _walk(self) -> Iterator[str]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            # Hidden folders are editors' and ConfigMap mounts' (..data) business.
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for filename in filenames:
                if filename.startswith(".") or not filename.endswith(SUFFIXES):
                    continue
                yield Path(dirpath, filename).relative_to(self.root).as_posix()

    def _check_file(self, rel: str, now: int, events: list[SourceEvent]) -> bool:
        """Re-read ``rel`` if it may have changed; True if its objects changed."""
        path = self.root / rel
        known = self._files.get(rel)
        try:
            st = path.stat()
            fingerprint = (st.st_mtime_ns, st.st_size, st.st_ino)
            if known is not None and known.fingerprint == fingerprint and now - st.st_mtime_ns > _RECENT_NS:
                return False
            data = path.read_bytes()
        except FileNotFoundError:
            return False  # removed since the walk; the next poll sees it gone
        except OSError as exc:
            return self._failed(rel, known, (0, 0, 0), b"", f"{rel}: cannot read it ({exc})", events)
        digest = hashlib.sha256(data).digest()
        if known is not None and known.digest == digest:
            known.fingerprint = fingerprint
            return False
        try:
            parsed = parse_file(rel, data)
        except ManifestError as exc:
            return self._failed(rel, known, fingerprint, digest, str(exc), events)
        for what in parsed.ignored:
            log.info("manifest object of an unwatched kind ignored", file=rel, object=what)
        if known is not None and known.error:
            log.info("manifest file fixed", file=rel)
            events.append(Problem(rel, "", ProblemReason.PARSE))
        self._files[rel] = _File(fingerprint, digest, parsed.objects)
        return True

    def _failed(
        self,
        rel: str,
        known: _File | None,
        fingerprint: tuple[int, int, int],
        digest: bytes,
        reason: str,
        events: list[SourceEvent],
    ) -> bool:
        message = f"{reason}; fix the file (its objects keep their last good state)"
        if known is None:
            # Broken since before this run: its last good state is what the bus holds from it.
            last_good = self._seeded.get(rel, ())
            if last_good:
                log.warning("manifest file broken at start, keeping what was published", file=rel)
            known = self._files[rel] = _File(fingerprint, digest, last_good)
        else:
            known.fingerprint, known.digest = fingerprint, digest
        if known.error != message:
            known.error = message
            log.warning("manifest file rejected", file=rel, error=reason)
            events.append(Problem(rel, message, ProblemReason.PARSE))
        return False

    def _listing(self) -> list[SourceEvent]:
        events: list[SourceEvent] = []
        merged = self._resolve_conflicts(events)
        if self._dev_nodes:
            merged = schedule(merged, self._dev_nodes)
        if self._service_cidr:
            merged = assign_cluster_ips(merged, self._service_cidr)
            self._slice_inputs = slice_inputs(merged)
            merged = {**merged, **endpoint_slices(self._slice_inputs, self._listed_addresses, synthetic_uid)}
        per_kind: dict[Kind, list[KObject]] = {info.kind: [] for info in self.kinds}
        for versions in self._versions.values():
            self._prune(versions, merged)
        for key, obj in merged.items():
            versioned = self._versioned(key, obj)
            if key.kind in per_kind:
                per_kind[key.kind].append(versioned)
        return [*events, *(Listed(kind, tuple(objs)) for kind, objs in per_kind.items())]

    def _slice_listing(self) -> list[SourceEvent]:
        """The slices kind listed again, after a change of the pods' addresses alone."""
        if self._slice_inputs is None or Kind.ENDPOINT_SLICE not in {info.kind for info in self.kinds}:
            return []
        inputs = self._slice_inputs
        slices = {**inputs.slices, **endpoint_slices(inputs, self._listed_addresses, synthetic_uid)}
        self._prune(self._versions.get(Kind.ENDPOINT_SLICE, {}), slices)
        return [Listed(Kind.ENDPOINT_SLICE, tuple(self._versioned(key, obj) for key, obj in slices.items()))]

    @staticmethod
    def _prune(versions: dict[ObjectKey, _Version], present: Mapping[ObjectKey, KObject]) -> None:
        for key in [k for k in versions if k not in present]:
            del versions[key]

    def _versioned(self, key: ObjectKey, obj: KObject) -> KObject:
        """The object with its resource version: its last one while its content is the same, else a new one."""
        versions = self._versions.setdefault(key.kind, {})
        known = versions.get(key)
        if known is not None and known.given is obj:
            return known.listed
        content = json.dumps(obj.body, sort_keys=True, separators=(",", ":"))
        rv = known.listed.resource_version if known is not None and known.content == content else self._next_rv()
        listed = with_resource_version(obj, rv)
        versions[key] = _Version(obj, content, listed)
        return listed

    def _resolve_conflicts(self, events: list[SourceEvent]) -> dict[ObjectKey, KObject]:
        """One definition per object: the one in force stays, else the first in path order.

        The others become problems on their files and a ``conflict`` on the object in force.
        """
        defined: dict[ObjectKey, list[KObject]] = {}
        for rel in sorted(self._files):
            for obj in self._files[rel].objects:
                defined.setdefault(obj.key, []).append(obj)
        merged: dict[ObjectKey, KObject] = {}
        owners: dict[ObjectKey, str] = {}
        conflicts: dict[str, str] = {}
        for key, candidates in defined.items():
            owner = self._owners.get(key)
            chosen = next((obj for obj in candidates if obj.origin == owner), candidates[0])
            losers = sorted({obj.origin for obj in candidates if obj is not chosen})
            if losers:
                others = ", ".join(losers)
                chosen = dataclasses.replace(
                    chosen,
                    conflict=f"{key} is also defined in {others}; the definition in {chosen.origin} stays in force "
                    "until the others are removed or renamed",
                )
                for rel in losers:
                    conflicts[f"{rel}: {key}"] = (
                        f"{rel}: {key} is already defined in {chosen.origin}; this definition is ignored: "
                        "remove or rename one of them"
                    )
            merged[key] = chosen
            owners[key] = chosen.origin
        for origin in sorted(self._conflicts.keys() - conflicts.keys()):
            events.append(Problem(origin, "", ProblemReason.CONFLICT))
        for origin, message in sorted(conflicts.items()):
            if self._conflicts.get(origin) != message:
                log.warning("object defined in several manifest files", problem=message)
                events.append(Problem(origin, message, ProblemReason.CONFLICT))
        self._owners, self._conflicts = owners, conflicts
        return merged

    def _next_rv(self) -> str:
        # Wall-clock microseconds, kept increasing: a restarted watcher's versions stay above
        # the ones an earlier run published.
        self._last_rv = max(self._last_rv + 1, time.time_ns() // 1000)
        return str(self._last_rv)
