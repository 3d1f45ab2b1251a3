"""A small Kubernetes API server speaking the list/watch protocol, for tests and benchmarks.

It keeps objects per resource with a global resourceVersion and a watch history,
and lets a test do what a real cluster does to a client: serve paged lists
(items without apiVersion/kind, as the API server sends them), stream watch
events from a resourceVersion, send BOOKMARKs, expire history so an old
resourceVersion gets ``410 Gone`` (as an ERROR event or an HTTP 410), cut watch
connections mid-stream, answer 404 for a resource that is not served (a missing
CRD), fail requests with a given status, and require a bearer token.

kmock's emulator streams every object as ADDED on each watch and has no
resourceVersion history, so it cannot produce 410s or resumable watches.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import ssl
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

Obj = dict[str, Any]
T = TypeVar("T")


@dataclass
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    served: bool = True
    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)
    #: (resourceVersion, event type, object) in order.
    history: list[tuple[int, str, Obj]] = field(default_factory=list)
    #: Watches must start at or after this resourceVersion, or they get 410 Gone.
    oldest: int = 0
    #: When set, list and watch requests answer this HTTP status.
    fail_status: int = 0

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def path(self) -> str:
        if self.group:
            return f"/apis/{self.group}/{self.version}/{self.plural}"
        return f"/api/{self.version}/{self.plural}"


def default_resources() -> list[Resource]:
    return [
        Resource("", "v1", "namespaces", "Namespace", namespaced=False),
        Resource("", "v1", "pods", "Pod", namespaced=True),
        Resource("", "v1", "nodes", "Node", namespaced=False),
        Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", namespaced=True),
        Resource("cilium.io", "v2", "ciliumnetworkpolicies", "CiliumNetworkPolicy", namespaced=True),
        Resource(
            "cilium.io", "v2", "ciliumclusterwidenetworkpolicies", "CiliumClusterwideNetworkPolicy", namespaced=False
        ),
        Resource("", "v1", "services", "Service", namespaced=True),
        Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", namespaced=True),
    ]


_CUT = object()


@dataclass(eq=False)
class _Watch:
    resource: Resource
    queue: asyncio.Queue[Any]
    bookmarks: bool


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeApiServer:
    def __init__(self, *, token: str = "test-token", resources: list[Resource] | None = None) -> None:
        self.token = token
        self.resources = {r.plural: r for r in (resources or default_resources())}
        self._by_path = {r.path: r for r in self.resources.values()}
        self.rv = 1
        #: Answer too-old watches with HTTP 410 instead of a 200 stream carrying an ERROR event.
        self.gone_as_http = False
        #: Every request: (path, query); tests count lists and watches with it.
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._watches: set[_Watch] = set()
        self._snapshots: dict[str, tuple[list[Obj], int]] = {}
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.scheme = "http"
        self.port = 0

    # -- lifecycle ----------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        """Listen on a free port of ``host``; over HTTPS with ``tls`` (a server context), as a real
        API server does for in-cluster clients (which verify it against their mounted CA)."""
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0, ssl_context=tls)
        await site.start()
        self.host = host
        self.scheme = "https" if tls else "http"
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        self.cut(partial=False)
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    # -- what a cluster does --------------------------------------------------

    def create(self, plural: str, obj: Obj) -> Obj:
        res = self.resources[plural]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        namespace = (meta.get("namespace") or "default") if res.namespaced else ""
        if res.namespaced:
            meta["namespace"] = namespace
        key = (namespace, meta["name"])
        if key in res.objects:
            raise ValueError(f"{plural} {key} already exists")
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = "2024-01-01T00:00:00Z"
        meta["managedFields"] = [{"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:metadata": {}}}]
        return self._record(res, "ADDED", key, obj)

    def patch(self, plural: str, namespace: str, name: str, change: Callable[[Obj], None]) -> Obj:
        res = self.resources[plural]
        key = (namespace if res.namespaced else "", name)
        obj = copy.deepcopy(res.objects[key])
        change(obj)
        obj["metadata"]["managedFields"] = [{"manager": "kubelet", "operation": "Update", "time": str(self.rv)}]
        return self._record(res, "MODIFIED", key, obj)

    def delete(self, plural: str, namespace: str, name: str) -> None:
        res = self.resources[plural]
        key = (namespace if res.namespaced else "", name)
        obj = copy.deepcopy(res.objects[key])
        self._record(res, "DELETED", key, obj)

    def compact(self) -> None:
        """Forget all history: a watch from any resourceVersion seen so far gets 410 Gone."""
        for res in self.resources.values():
            res.oldest = self.rv
        self._snapshots.clear()

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current resourceVersion to every watch that allows them."""
        for watch in self._watches:
            if watch.bookmarks:
                event = {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": watch.resource.kind,
                        "apiVersion": watch.resource.api_version,
                        "metadata": {"resourceVersion": str(self.rv)},
                    },
                }
                watch.queue.put_nowait(event)

    def cut(self, *, partial: bool = True) -> int:
        """Drop every watch connection, after half an event if ``partial``; returns how many."""
        n = len(self._watches)
        for watch in list(self._watches):
            watch.queue.put_nowait((_CUT, partial))
        return n

    def serve(self, plural: str, served: bool) -> None:
        """Install (True) or remove (False) a resource, as creating or deleting a CRD does."""
        self.resources[plural].served = served
        if not served:
            self.cut(partial=False)

    def count(self, plural: str, *, watch: bool) -> int:
        """Requests made so far for ``plural``: watches or lists (every page counts)."""
        path = self.resources[plural].path
        return sum(1 for p, q in self.requests if p == path and (q.get("watch") in ("true", "1")) == watch)

    def active_watches(self, plural: str) -> int:
        return sum(1 for w in self._watches if w.resource.plural == plural)

    def _record(self, res: Resource, kind: str, key: tuple[str, str], obj: Obj) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            res.objects.pop(key)
        else:
            res.objects[key] = obj
        res.history.append((self.rv, kind, obj))
        for watch in self._watches:
            if watch.resource is res:
                watch.queue.put_nowait({"type": kind, "object": obj})
        return copy.deepcopy(obj)

    # -- HTTP ---------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query))
        # The scheme is case-insensitive (RFC 7235): the Kubernetes client's in-cluster configuration
        # sends "bearer".
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or credentials != self.token:
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        res = self._by_path.get(request.path)
        if res is None or not res.served:
            message = "the server could not find the requested resource"
            return web.json_response(_status(404, "NotFound", message), status=404)
        if res.fail_status:
            return web.json_response(
                _status(res.fail_status, "InternalError", "injected failure"), status=res.fail_status
            )
        if query.get("watch") in ("true", "1"):
            return await self._watch(request, res, query)
        return self._list(res, query)

    def _list(self, res: Resource, query: dict[str, str]) -> web.StreamResponse:
        token = query.get("continue", "")
        if token:
            if token not in self._snapshots:
                message = "The provided continue parameter is too old to display a consistent list result."
                return web.json_response(_status(410, "Expired", message), status=410)
            items, rv = self._snapshots.pop(token)
        else:
            items = [self._list_item(o) for _, o in sorted(res.objects.items())]
            rv = self.rv
        limit = int(query.get("limit") or 0)
        meta: Obj = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            rest = items[limit:]
            items = items[:limit]
            next_token = f"c{next(self._ids)}"
            self._snapshots[next_token] = (rest, rv)
            meta["continue"] = next_token
        body = {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta, "items": items}
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    @staticmethod
    def _list_item(obj: Obj) -> Obj:
        # The API server leaves apiVersion and kind out of list items.
        return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}

    async def _watch(self, request: web.Request, res: Resource, query: dict[str, str]) -> web.StreamResponse:
        start = int(query.get("resourceVersion") or 0)
        too_old = start < res.oldest
        if too_old and self.gone_as_http:
            message = f"too old resource version: {start} ({res.oldest})"
            return web.json_response(_status(410, "Expired", message), status=410)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if too_old:
            error = _status(410, "Expired", f"too old resource version: {start} ({res.oldest})")
            await response.write(json.dumps({"type": "ERROR", "object": error}).encode() + b"\n")
            await response.write_eof()
            return response
        watch = _Watch(res, asyncio.Queue(), query.get("allowWatchBookmarks") == "true")
        # Register and snapshot history without awaiting in between: no event is lost or doubled.
        self._watches.add(watch)
        backlog = [{"type": t, "object": o} for rv, t, o in res.history if rv > start]
        timeout = float(query.get("timeoutSeconds") or 1800)
        try:
            for event in backlog:
                await response.write(json.dumps(event).encode() + b"\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                try:
                    item = await asyncio.wait_for(watch.queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break  # the server-side timeout: a normal end of the watch
                if isinstance(item, tuple) and item[0] is _CUT:
                    if item[1]:
                        await response.write(b'{"type":"MODIFIED","object":{"metadata":')
                    if request.transport is not None:
                        # close() still flushes what was written (a last bookmark, half an event).
                        request.transport.close()
                    return response
                await response.write(json.dumps(item).encode() + b"\n")
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass  # the client went away
        finally:
            self._watches.discard(watch)
        return response


class ApiServerThread:
    """A FakeApiServer on an event loop of its own thread, for synchronous tests (a kubelet stand-in's
    containers reach it over the network). Changes go through :meth:`call`, which runs them on the
    server's loop: its watch queues belong to that loop."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="apiserver", daemon=True)

    def start(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(host, tls), self._loop).result(30)

    def call(self, change: Callable[[FakeApiServer], T]) -> T:
        async def run() -> T:
            return change(self.server)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
