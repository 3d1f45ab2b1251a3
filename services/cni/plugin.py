"""palisade-cni: ADD, DEL, CHECK, VERSION, STATUS and GC against the node's datapath (CNI 1.1, 1.0, 0.4, 0.3).

The runtime runs the plugin once per pod event with the CNI_* environment and the network
configuration on stdin. Standalone (first in the list) the datapath creates the pod's veth
in CNI_NETNS, addresses it from the node's pod CIDR and attaches its programs; chained
(after ptp, bridge, ...) it adopts the host-side veth of ``prevResult`` and passes that
result on unchanged. Until the pod's labels are known the endpoint has the init identity.

The datapath answers on a unix socket beside the node socket (``socket`` in the configuration),
in JSON lines (services/datapath/pluginapi.py): no gRPC or protobuf to import, which cost more
than the rest of an ADD. ADD waits up to
``timeout`` seconds for it (a restarting datapath), then answers "try again later" (11);
DEL never fails for a pod that is gone, and while the datapath is down it queues the
deletion in the socket's directory for the datapath to apply when it returns.

The commands reach the datapath through a :class:`NodeApi`: over the socket (:class:`SocketApi`,
this process run by the runtime), or in the datapath itself (services/datapath/pluginapi.py runs
:func:`run` for the executable the runtime really starts, services/cni/shim.c, which hands to this
process only what needs it: a datapath that is not there, VERSION, input it cannot read).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

from services.cni import spec
from services.cni.spec import CniError

#: Where queued deletions go, beside the socket (the datapath's deletequeue reads it).
QUEUE_DIR = "delete-queue"
#: Seconds between attempts to reach a datapath that is not answering yet.
CONNECT_RETRY = 0.05
#: Endpoint states in which a CHECK finds the pod's network as added.
USABLE_STATES = ("ENDPOINT_STATE_READY", "ENDPOINT_STATE_REGENERATING")


def main(argv: list[str] | None = None) -> int:
    status = run(os.environ, sys.stdin.buffer.read(), sys.stdout)
    sys.stdout.flush()
    return status


def run(env: Mapping[str, str], stdin: bytes, out: TextIO, api: NodeApi | None = None) -> int:
    """One plugin call; prints the result or the error object, returns the exit status.

    :class:`Handoff` from ``api`` goes up to the caller: the call is this process's to make.
    """
    node = api if api is not None else SocketApi()
    declared = _declared_version(stdin)
    # Errors are answered in the configuration's version where it gives one this plugin speaks,
    # whatever the error (the environment's, the configuration's own, the datapath's).
    version = declared if declared in spec.SUPPORTED_VERSIONS else spec.CURRENT_VERSION
    try:
        environment = spec.parse_environment(env)
        if environment.command == "VERSION":
            # VERSION answers whatever the configuration says (it may not even be given).
            _print(out, {"cniVersion": declared or version, "supportedVersions": list(spec.SUPPORTED_VERSIONS)})
            return 0
        conf = spec.parse_config(stdin, environment.command)
        result = COMMANDS[environment.command](environment, conf, node)
    except CniError as err:
        _print(out, err.to_json(version))
        return 1
    if result is not None:
        _print(out, result)
    return 0


def _declared_version(stdin: bytes) -> str:
    """The ``cniVersion`` the configuration gives, read leniently ("" if it gives none)."""
    try:
        version = json.loads(stdin or b"{}").get("cniVersion")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return ""
    return version if isinstance(version, str) else ""


def _print(out: TextIO, data: Mapping[str, Any]) -> None:
    out.write(json.dumps(data))
    out.write("\n")
    out.flush()


# --- the datapath ---------------------------------------------------------------------------


class ApiError(Exception):
    """The datapath answered with an error: its status code (by name) and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Handoff(Exception):
    """What a :class:`NodeApi` in the datapath raises for what only the plugin's own process does
    (queue a deletion on the node's file system): the caller runs the plugin's process instead."""


class NodeApi(Protocol):
    """How the commands reach the datapath."""

    def call(self, conf: spec.NetConf, method: str, request: Mapping[str, Any], *, wait: float) -> dict[str, Any]:
        """One call of the node API (protobuf's JSON mapping): the response, :class:`ApiError` with
        the datapath's code, or :class:`CniError` (11) if it is not reached within ``wait`` seconds."""
        ...

    def check_reachable(self, conf: spec.NetConf, wait: float) -> None:
        """Returns if the datapath answers within ``wait`` seconds, else :class:`CniError` (11)."""
        ...

    def queue_delete(self, conf: spec.NetConf, env: spec.Environment) -> None:
        """Leaves a deletion for the datapath to apply when it is back."""
        ...


def answer_to_response(data: Mapping[str, Any]) -> dict[str, Any]:
    """The response in one answer of the plugin socket, or its error as :class:`ApiError`."""
    if "error" in data:
        raise ApiError(str(data["error"].get("code", "UNKNOWN")), str(data["error"].get("message", "")))
    response: dict[str, Any] = data.get("response", {})
    return response


class SocketApi:
    """The datapath over its plugin socket (JSON lines), from the plugin's own process."""

    def call(self, conf: spec.NetConf, method: str, request: Mapping[str, Any], *, wait: float) -> dict[str, Any]:
        with _connect(conf, wait) as sock:
            sock.settimeout(conf.timeout + 20)
            try:
                sock.sendall(json.dumps({"method": method, "request": request}).encode() + b"\n")
                answer = sock.makefile("rb").readline()
            except OSError as exc:  # it went away mid-call (a timeout is one too)
                raise ApiError("UNAVAILABLE", f"the datapath stopped answering: {exc}") from None
        try:
            data = json.loads(answer)
        except ValueError:
            raise ApiError("UNAVAILABLE", "the datapath closed the connection without an answer") from None
        return answer_to_response(data)

    def check_reachable(self, conf: spec.NetConf, wait: float) -> None:
        _connect(conf, wait).close()

    def queue_delete(self, conf: spec.NetConf, env: spec.Environment) -> None:
        _queue(conf, env)


def _connect(conf: spec.NetConf, wait: float) -> socket.socket:
    """A connection to the datapath's plugin socket, made within ``wait`` seconds, else error 11."""
    path = spec.plugin_socket(conf.socket)
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:  # not there yet, or nobody listening: a restarting datapath
            sock.close()
            if time.monotonic() >= deadline:
                raise CniError(
                    spec.TRY_AGAIN_LATER,
                    f"the Palisade datapath does not answer on {path}",
                    "it may be restarting; the runtime retries. If it stays down, check the datapath pod on this node",
                ) from None
            time.sleep(CONNECT_RETRY)


def _api_error(what: str, err: ApiError) -> CniError:
    if err.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"):
        return CniError(spec.TRY_AGAIN_LATER, f"{what}: the datapath could not do it now", err.message)
    if err.code == "INVALID_ARGUMENT":
        return CniError(spec.INVALID_ENVIRONMENT, f"{what}: the datapath refused the request", err.message)
    if err.code in ("NOT_FOUND", "FAILED_PRECONDITION"):
        return CniError(spec.CONTAINER_UNKNOWN, f"{what}: the pod's network is not usable", err.message)
    return CniError(spec.DATAPATH_ERROR, f"{what} failed: {err.code}", err.message)


# --- commands -------------------------------------------------------------------------------


def cmd_add(env: spec.Environment, conf: spec.NetConf, api: NodeApi) -> dict[str, Any]:
    namespace, pod = env.pod
    request: dict[str, Any] = {
        "namespace": namespace,
        "pod": pod,
        "netns": env.netns,
        "container_id": env.container_id,
        "ifname": env.ifname,
        "init_identity": True,
    }
    prev = None
    if conf.chained:
        assert conf.prev_result is not None
        prev = spec.read_prev_result(conf.prev_result, env.netns)
        request["adopt_host_ifname"] = prev.host_ifname
        request["ips"] = list(prev.ips)
        request["outside_pool"] = True  # the previous plugin's IPAM chose them
    if not os.path.exists(env.netns):
        raise CniError(spec.CONTAINER_UNKNOWN, f"CNI_NETNS {env.netns} does not exist", "the sandbox is gone")
    try:
        ep = api.call(conf, "CreateEndpoint", request, wait=conf.timeout)
    except ApiError as err:
        raise _api_error(f"adding pod {namespace}/{pod}", err) from None
    if prev is not None:
        assert conf.prev_result is not None
        return {**conf.prev_result, "cniVersion": conf.version}  # passed on unchanged
    result = spec.standalone_result(
        host_ifname=ep.get("host_ifname", ""),
        ifname=ep.get("ifname") or env.ifname,
        mac=ep.get("mac", ""),
        netns=env.netns,
        ips=list(ep.get("ips", [])),
        gateways=list(ep.get("gateways", [])),
    )
    return spec.render_result(conf.version, result)


def cmd_del(env: spec.Environment, conf: spec.NetConf, api: NodeApi) -> None:
    namespace, pod = env.pod
    try:
        api.call(conf, "DeleteEndpoint", {"container_id": env.container_id}, wait=min(conf.timeout, 2.0))
    except CniError:
        api.queue_delete(conf, env)  # the datapath applies it when it is back; the runtime is never stuck
        return None
    except ApiError as err:
        if err.code == "NOT_FOUND":
            return None  # never added, or deleted already: DEL is idempotent
        if err.code == "UNAVAILABLE":
            # Deleted, with IPAM's release still pending (the datapath retries it), or the datapath
            # is going away: queue it, which is harmless if it was done.
            api.queue_delete(conf, env)
            return None
        raise _api_error(f"deleting pod {namespace}/{pod}", err) from None
    return None


def _queue(conf: spec.NetConf, env: spec.Environment) -> None:
    # Imported here: only a DEL that finds the datapath away needs them, and every call pays for imports.
    import tempfile
    from pathlib import Path

    directory = Path(conf.socket).parent / QUEUE_DIR
    namespace, pod = env.pod
    record = {"container_id": env.container_id, "namespace": namespace, "pod": pod, "netns": env.netns}
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
            json.dump(record, f)
        os.replace(f.name, directory / f"{env.container_id}.json")
    except OSError as exc:
        raise CniError(spec.IO_FAILURE, f"cannot queue the deletion in {directory}", str(exc)) from None


def _endpoints(conf: spec.NetConf, api: NodeApi) -> list[dict[str, Any]]:
    try:
        listing = api.call(conf, "ListEndpoints", {}, wait=conf.timeout)
    except ApiError as err:
        raise _api_error("listing endpoints", err) from None
    return list(listing.get("endpoints", []))


def cmd_check(env: spec.Environment, conf: spec.NetConf, api: NodeApi) -> None:
    found = [ep for ep in _endpoints(conf, api) if ep.get("container_id") == env.container_id]
    if not found:
        raise CniError(spec.ENDPOINT_MISMATCH, f"no endpoint for container {env.container_id}", "ADD it again")
    ep = found[0]
    problems = []
    state, error = ep.get("state", "ENDPOINT_STATE_UNSPECIFIED"), ep.get("error", "")
    if state not in USABLE_STATES:
        problems.append(f"state {state}{': ' + error if error else ''}")
    netns, ips, host_ifname = ep.get("netns", ""), list(ep.get("ips", [])), ep.get("host_ifname", "")
    if os.path.realpath(netns) != os.path.realpath(env.netns):
        problems.append(f"netns {netns}, not {env.netns}")
    if conf.chained:
        assert conf.prev_result is not None
        prev = spec.read_prev_result(conf.prev_result, env.netns)
        if set(prev.ips) != set(ips) or prev.host_ifname != host_ifname:
            problems.append(f"addresses {ips} on {host_ifname}, prevResult says {list(prev.ips)}")
    if problems:
        raise CniError(
            spec.ENDPOINT_MISMATCH, f"endpoint of container {env.container_id} is not as added", "; ".join(problems)
        )
    return None


def cmd_status(env: spec.Environment, conf: spec.NetConf, api: NodeApi) -> None:
    try:
        api.check_reachable(conf, min(conf.timeout, 2.0))
    except CniError as err:
        raise CniError(spec.NOT_AVAILABLE, "the Palisade datapath is not available", err.details) from None
    return None


def cmd_gc(env: spec.Environment, conf: spec.NetConf, api: NodeApi) -> None:
    valid = conf.raw.get("cni.dev/valid-attachments") or []
    if not isinstance(valid, list):
        raise CniError(spec.INVALID_CONFIG, "cni.dev/valid-attachments is not a list")
    keep = {str(a.get("containerID", "")) for a in valid if isinstance(a, dict)}
    for ep in _endpoints(conf, api):
        if ep.get("container_id") and ep["container_id"] not in keep:  # only what a runtime added
            try:
                api.call(conf, "DeleteEndpoint", {"id": ep["id"]}, wait=conf.timeout)
            except ApiError as err:
                if err.code != "NOT_FOUND":  # gone meanwhile: what GC wanted
                    raise _api_error("garbage collection", err) from None
    return None


COMMANDS = {
    "ADD": cmd_add,
    "DEL": cmd_del,
    "CHECK": cmd_check,
    "STATUS": cmd_status,
    "GC": cmd_gc,
}


if __name__ == "__main__":
    sys.exit(main())
