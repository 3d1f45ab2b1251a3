"""The Kubernetes source: list+watch of every kind through the official client.

The client is synchronous, so each kind runs its own reflector loop in a daemon
thread (as client-go runs one reflector per informer) and hands events to the
event loop with ``call_soon_threadsafe``. Per kind:

    list (paged) -> Listed -> watch from its resourceVersion -> Upserted/Deleted ...
      BOOKMARK        : advance the resourceVersion, nothing to publish
      410 Gone        : relist; the reconciler diffs it, so deletions missed meanwhile become tombstones
      404             : the kind is not served (CRD missing): reported, retried every ``missing_retry``
      any other error : reported, watch again from the last resourceVersion with backoff
      server timeout  : watch again at once
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import config as kube_config
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines

from services.common.backoff import Backoff
from services.common.config import ConfigError
from services.common.errors import PalisadeError
from services.common.log import get_logger
from services.watcher.kinds import KINDS, KindInfo
from services.watcher.objects import KObject, ObjectError, check_names, from_api, metadata
from services.watcher.source import Deleted, Emit, KindMissing, Listed, Problem, ProblemReason, SourceEvent, Upserted

log = get_logger("watcher.kube")

SOURCE_NAME = "kubernetes"


@dataclass(frozen=True, slots=True)
class KubeSettings:
    """Timing of the list/watch loops."""

    #: Seconds the API server keeps a watch open before ending it (it is then renewed).
    watch_timeout: int = 300
    #: First wait after a failed list/watch, doubled up to ``backoff_max``.
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    #: Seconds between attempts to list a kind the API server does not serve.
    missing_retry: float = 10.0
    #: Objects per list page.
    page_size: int = 500
    #: Seconds to wait for the API server to accept a connection.
    connect_timeout: float = 10.0


class Gone(Exception):
    """The requested resourceVersion is too old (410): the watch cannot resume, relist."""


class WatchError(Exception):
    """The watch stream reported an error other than 410."""


def load_client_configuration(kubeconfig: str) -> Configuration:
    """The client configuration from ``kubeconfig``, or the in-cluster service account if empty."""
    cfg = Configuration()
    try:
        if kubeconfig:
            kube_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_incluster_config(client_configuration=cfg)
        else:
            raise ConfigError(
                "no --kubeconfig given and not running in a cluster (KUBERNETES_SERVICE_HOST is unset); "
                "pass --kubeconfig PATH, or use --source manifests"
            )
    except (ConfigException, OSError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
        raise ConfigError(f"cannot load {where}: {exc}; check the file or pass another --kubeconfig") from None
    return cfg


def _api_error(info: KindInfo, exc: ApiException) -> str:
    """What went wrong with a request for ``info``, and what to do about it."""
    detail = exc.reason or ""
    body = exc.body
    if body:
        try:
            detail = json.loads(body).get("message") or detail
        except (ValueError, AttributeError):
            pass
    what = f"{info.api_version} {info.plural}"
    if exc.status in (401, 403):
        return f"{exc.status} listing/watching {what}: {detail}; give the watcher's account list and watch on it"
    return f"{exc.status} from the API server for {what}: {detail}"


def _not_served(info: KindInfo) -> str:
    if info.custom:
        return f"the API server does not serve {info.api_version} {info.plural}; install the Cilium CRDs"
    return f"the API server does not serve {info.api_version} {info.plural}"


class _Reflector:
    """The list/watch loop of one kind, run in its own thread."""

    def __init__(
        self,
        info: KindInfo,
        api: ApiClient,
        settings: KubeSettings,
        emit: Callable[[SourceEvent], None],
        stop: threading.Event,
    ) -> None:
        self.info = info
        self._api = api
        self._s = settings
        self._emit = emit
        self._stop = stop
        self._log = log.bind(kind=info.kind.value)
        self._backoff = Backoff(settings.backoff_initial, settings.backoff_max, jitter=True)
        self._problem = False
        #: The resourceVersion to watch from; "" means list first.
        self._rv = ""
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None

    def interrupt(self) -> None:
        """Unblock a read in progress (called from another thread on shutdown)."""
        with self._lock:
            response = self._response
        if response is not None:
            try:
                response.shutdown()
            except Exception:
                pass

    def run(self) -> None:
        relist = False
        try:
            while not self._stop.is_set():
                try:
                    if not self._rv:
                        started = time.monotonic()
                        objects, self._rv = self._list()
                        self._emit(Listed(self.info.kind, tuple(objects), relist=relist))
                        self._log.info(
                            "listed",
                            objects=len(objects),
                            resource_version=self._rv,
                            relist=relist,
                            seconds=round(time.monotonic() - started, 3),
                        )
                        self._clear_problem()
                    self._watch()
                except Gone as exc:
                    self._log.info("watch history expired, relisting", resource_version=self._rv, reason=str(exc))
                    self._rv, relist = "", True
                except ApiException as exc:
                    if exc.status == 410:
                        self._log.info("watch history expired, relisting", resource_version=self._rv)
                        self._rv, relist = "", True
                    elif exc.status == 404:
                        self._rv, relist = "", False
                        self._emit(KindMissing(self.info.kind, _not_served(self.info)))
                        self._problem = True
                        self._stop.wait(self._s.missing_retry)
                    else:
                        self._failed(_api_error(self.info, exc))
                except Exception as exc:  # connection refused/reset, cut streams, bad JSON...
                    self._failed(f"list/watch of {self.info.api_version} {self.info.plural} failed: {exc}")
        finally:
            self._api.close()

    def _failed(self, message: str) -> None:
        if self._stop.is_set():
            return
        delay = self._backoff.next()
        self._log.warning("list/watch failed, retrying", error=message, retry_in=round(delay, 2))
        self._emit(Problem(self.info.kind.value, message, ProblemReason.STREAM, self.info.kind))
        self._problem = True
        self._stop.wait(delay)

    def _clear_problem(self) -> None:
        self._backoff.reset()
        if self._problem:
            self._problem = False
            self._emit(Problem(self.info.kind.value, "", ProblemReason.STREAM, self.info.kind))

    def _request(self, query: list[tuple[str, Any]], read_timeout: float) -> urllib3.BaseHTTPResponse:
        response: urllib3.BaseHTTPResponse = self._api.call_api(
            self.info.list_path,
            "GET",
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _preload_content=False,
            _request_timeout=(self._s.connect_timeout, read_timeout),
        )
        return response

    def _list(self) -> tuple[list[KObject], str]:
        objects: list[KObject] = []
        cont = ""
        while True:
            query: list[tuple[str, Any]] = [("limit", self._s.page_size)]
            if cont:
                query.append(("continue", cont))
            response = self._request(query, read_timeout=60.0)
            try:
                page = json.loads(response.data)
            finally:
                response.release_conn()
            for raw in page.get("items") or ():
                obj = self._object(raw)
                if obj is not None:
                    objects.append(obj)
            meta = page.get("metadata") or {}
            cont = str(meta.get("continue") or "")
            if not cont:
                rv = str(meta.get("resourceVersion") or "")
                if not rv:
                    raise WatchError("the list carried no metadata.resourceVersion to watch from")
                return objects, rv

    def _watch(self) -> None:
        """Follow the watch from ``self._rv`` until it ends; ``self._rv`` moves with every event,
        so a broken stream resumes right after the last event handled."""
        query: list[tuple[str, Any]] = [
            ("watch", "true"),
            ("resourceVersion", self._rv),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", self._s.watch_timeout),
        ]
        # The server ends the watch after watch_timeout; a silent connection beyond that is dead.
        response = self._request(query, read_timeout=self._s.watch_timeout + 30.0)
        with self._lock:
            self._response = response
        events = 0
        try:
            if self._stop.is_set():
                return
            self._clear_problem()
            for line in iter_resp_lines(response):
                if self._stop.is_set():
                    return
                self._event(json.loads(line))
                events += 1
        finally:
            with self._lock:
                self._response = None
            response.release_conn()
        if not events:
            # Ended at once with nothing in it: do not hammer a server that closes every watch.
            self._stop.wait(self._s.backoff_initial)

    def _event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        raw = event.get("object")
        raw = raw if isinstance(raw, Mapping) else {}
        if kind == "ERROR":
            code = raw.get("code")
            message = str(raw.get("message") or raw.get("reason") or "watch error")
            if code == 410:
                raise Gone(message)
            raise WatchError(f"{code}: {message}")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            obj = self._object(raw)
            if obj is not None:
                self._emit(Deleted(obj) if kind == "DELETED" else Upserted(obj))
        elif kind != "BOOKMARK":
            self._log.warning("unknown watch event type ignored", type=str(kind))
        self._rv = str(metadata(raw).get("resourceVersion") or "") or self._rv

    def _object(self, raw: Any) -> KObject | None:
        try:
            if not isinstance(raw, Mapping):
                raise ObjectError("not an object")
            obj = from_api(self.info, raw)
            check_names(self.info, obj.key.name, obj.key.namespace, metadata(obj.body).get("labels"))
            return obj
        except ObjectError as exc:
            self._log.warning("malformed object from the API server ignored", error=str(exc))
            return None
        except PalisadeError as exc:
            self._log.warning("object with names Kubernetes refuses ignored", error=exc.message)
            return None


class KubeSource:
    """Lists and watches every kind of ``kinds`` from the API server in ``configuration``."""

    name = SOURCE_NAME
    status_token = SOURCE_NAME

    def __init__(
        self,
        configuration: Configuration,
        *,
        kinds: tuple[KindInfo, ...] = KINDS,
        settings: KubeSettings | None = None,
    ) -> None:
        self.kinds = kinds
        self._configuration = configuration
        self._settings = settings or KubeSettings()

    def seed(self, published: Sequence[KObject]) -> None:
        """The API server is the truth for every object; what the bus held is only diffed against it."""

    async def run(self, emit: Emit) -> None:
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        failed: asyncio.Future[None] = loop.create_future()

        def emit_threadsafe(event: SourceEvent) -> None:
            try:
                loop.call_soon_threadsafe(emit, event)
            except RuntimeError:  # the event loop is closed: the watcher is shutting down
                stop.set()

        def crashed(exc: BaseException) -> None:
            if not failed.done():
                failed.set_exception(exc)

        reflectors = [
            _Reflector(info, ApiClient(self._configuration), self._settings, emit_threadsafe, stop)
            for info in self.kinds
        ]

        def body(reflector: _Reflector) -> None:
            try:
                reflector.run()
            except BaseException as exc:  # a bug: surface it instead of a silently dead kind
                try:
                    loop.call_soon_threadsafe(crashed, exc)
                except RuntimeError:
                    pass

        # Daemon threads: a read blocked on a silent server must never hold up process exit.
        threads = [
            threading.Thread(target=body, args=(r,), name=f"watch-{r.info.kind.value}", daemon=True) for r in reflectors
        ]
        log.info("watching", server=self._configuration.host, kinds=",".join(i.kind.value for i in self.kinds))
        for thread in threads:
            thread.start()
        try:
            await failed
        finally:
            stop.set()
            for reflector in reflectors:
                reflector.interrupt()
