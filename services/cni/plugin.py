"""palisade-cni: ADD, DEL, CHECK, VERSION, STATUS and GC against the node's datapath (CNI 1.1, 1.0, 0.4, 0.3).

The runtime runs the plugin once per pod event with the CNI_* environment and the network
configuration on stdin. Standalone (first in the list) the datapath creates the pod's veth
in CNI_NETNS, addresses it from the node's pod CIDR and attaches its programs; chained
(after ptp, bridge, ...) it adopts the host-side veth of ``prevResult`` and passes that
result on unchanged. Until the pod's labels are known the endpoint has the init identity.

The datapath answers on a unix socket (``socket`` in the configuration). ADD waits up to
``timeout`` seconds for it (a restarting datapath), then answers "try again later" (11);
DEL never fails for a pod that is gone, and while the datapath is down it queues the
deletion in the socket's directory for the datapath to apply when it returns.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import grpc

from palisade.v1 import datapath_pb2, datapath_pb2_grpc
from services.cni import spec
from services.cni.spec import CniError

#: Where queued deletions go, beside the socket (the datapath's deletequeue reads it).
QUEUE_DIR = "delete-queue"


def main(argv: list[str] | None = None) -> int:
    status = run(os.environ, sys.stdin.buffer.read(), sys.stdout)
    sys.stdout.flush()
    # The process ends here: closing gRPC's channel politely costs 200 ms, a third of a pod's ADD.
    os._exit(status)


def run(env: Mapping[str, str], stdin: bytes, out: TextIO) -> int:
    """One plugin call; prints the result or the error object, returns the exit status."""
    version = spec.CURRENT_VERSION
    try:
        environment = spec.parse_environment(env)
        if environment.command == "VERSION":
            # VERSION answers whatever the configuration says (it may not even be given).
            try:
                version = str(json.loads(stdin or b"{}").get("cniVersion") or version)
            except (ValueError, AttributeError):
                pass
            _print(out, {"cniVersion": version, "supportedVersions": list(spec.SUPPORTED_VERSIONS)})
            return 0
        conf = spec.parse_config(stdin, environment.command)
        version = conf.version
        result = COMMANDS[environment.command](environment, conf)
    except CniError as err:
        _print(out, err.to_json(version))
        return 1
    if result is not None:
        _print(out, result)
    return 0


def _print(out: TextIO, data: Mapping[str, Any]) -> None:
    out.write(json.dumps(data))
    out.write("\n")
    out.flush()


# --- the datapath ---------------------------------------------------------------------------


def _stub(conf: spec.NetConf, wait: float) -> tuple[grpc.Channel, datapath_pb2_grpc.DatapathServiceStub]:
    """A channel to the datapath's socket that is ready within ``wait`` seconds, else error 11.

    Never closed: the process exits right after its one call (see :func:`main`).
    """
    channel = grpc.insecure_channel(f"unix:{conf.socket}")
    try:
        grpc.channel_ready_future(channel).result(timeout=wait)
    except grpc.FutureTimeoutError:
        channel.close()
        raise CniError(
            spec.TRY_AGAIN_LATER,
            f"the Palisade datapath does not answer on {conf.socket}",
            "it may be restarting; the runtime retries. If it stays down, check the datapath pod on this node",
        ) from None
    return channel, datapath_pb2_grpc.DatapathServiceStub(channel)


def _rpc_error(what: str, err: grpc.RpcError) -> CniError:
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else "") or str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED):
        return CniError(spec.TRY_AGAIN_LATER, f"{what}: the datapath could not do it now", details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return CniError(spec.INVALID_ENVIRONMENT, f"{what}: the datapath refused the request", details)
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return CniError(spec.CONTAINER_UNKNOWN, f"{what}: the pod's network is not usable", details)
    return CniError(spec.DATAPATH_ERROR, f"{what} failed: {code.name}", details)


# --- commands -------------------------------------------------------------------------------


def cmd_add(env: spec.Environment, conf: spec.NetConf) -> dict[str, Any]:
    namespace, pod = env.pod
    request = datapath_pb2.CreateEndpointRequest(
        namespace=namespace,
        pod=pod,
        netns=env.netns,
        container_id=env.container_id,
        ifname=env.ifname,
        init_identity=True,
    )
    prev = None
    if conf.chained:
        assert conf.prev_result is not None
        prev = spec.read_prev_result(conf.prev_result, env.netns)
        request.adopt_host_ifname = prev.host_ifname
        request.ips.extend(prev.ips)
        request.outside_pool = True  # the previous plugin's IPAM chose them
    if not os.path.exists(env.netns):
        raise CniError(spec.CONTAINER_UNKNOWN, f"CNI_NETNS {env.netns} does not exist", "the sandbox is gone")
    _, stub = _stub(conf, conf.timeout)
    try:
        ep = stub.CreateEndpoint(request, timeout=conf.timeout + 20)
    except grpc.RpcError as err:
        raise _rpc_error(f"adding pod {namespace}/{pod}", err) from None
    if prev is not None:
        assert conf.prev_result is not None
        return {**conf.prev_result, "cniVersion": conf.version}  # passed on unchanged
    result = spec.standalone_result(
        host_ifname=ep.host_ifname,
        ifname=ep.ifname or env.ifname,
        mac=ep.mac,
        netns=env.netns,
        ips=list(ep.ips),
        gateways=list(ep.gateways),
    )
    return spec.render_result(conf.version, result)


def cmd_del(env: spec.Environment, conf: spec.NetConf) -> None:
    namespace, pod = env.pod
    request = datapath_pb2.DeleteEndpointRequest(container_id=env.container_id)
    try:
        _, stub = _stub(conf, min(conf.timeout, 2.0))
    except CniError:
        _queue(conf, env)  # the datapath applies it when it is back; the runtime is never stuck
        return None
    try:
        stub.DeleteEndpoint(request, timeout=conf.timeout + 20)
    except grpc.RpcError as err:
        if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.NOT_FOUND:
            return None  # never added, or deleted already: DEL is idempotent
        if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.UNAVAILABLE:
            # Deleted, with IPAM's release still pending (the datapath retries it), or the datapath
            # is going away: queue it, which is harmless if it was done.
            _queue(conf, env)
            return None
        raise _rpc_error(f"deleting pod {namespace}/{pod}", err) from None
    return None


def _queue(conf: spec.NetConf, env: spec.Environment) -> None:
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


def _endpoint(stub: datapath_pb2_grpc.DatapathServiceStub, container_id: str, timeout: float) -> datapath_pb2.Endpoint:
    try:
        listing = stub.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=timeout)
    except grpc.RpcError as err:
        raise _rpc_error("listing endpoints", err) from None
    for ep in listing.endpoints:
        if ep.container_id == container_id:
            found: datapath_pb2.Endpoint = ep
            return found
    raise CniError(spec.ENDPOINT_MISMATCH, f"no endpoint for container {container_id}", "ADD it again")


def cmd_check(env: spec.Environment, conf: spec.NetConf) -> None:
    _, stub = _stub(conf, conf.timeout)
    ep = _endpoint(stub, env.container_id, conf.timeout)
    problems = []
    if ep.state not in (datapath_pb2.ENDPOINT_STATE_READY, datapath_pb2.ENDPOINT_STATE_REGENERATING):
        problems.append(f"state {datapath_pb2.EndpointState.Name(ep.state)}{': ' + ep.error if ep.error else ''}")
    if os.path.realpath(ep.netns) != os.path.realpath(env.netns):
        problems.append(f"netns {ep.netns}, not {env.netns}")
    if conf.chained:
        assert conf.prev_result is not None
        prev = spec.read_prev_result(conf.prev_result, env.netns)
        if set(prev.ips) != set(ep.ips) or prev.host_ifname != ep.host_ifname:
            problems.append(f"addresses {list(ep.ips)} on {ep.host_ifname}, prevResult says {list(prev.ips)}")
    if problems:
        raise CniError(
            spec.ENDPOINT_MISMATCH, f"endpoint of container {env.container_id} is not as added", "; ".join(problems)
        )
    return None


def cmd_status(env: spec.Environment, conf: spec.NetConf) -> None:
    try:
        _stub(conf, min(conf.timeout, 2.0))
    except CniError as err:
        raise CniError(spec.NOT_AVAILABLE, "the Palisade datapath is not available", err.details) from None
    return None


def cmd_gc(env: spec.Environment, conf: spec.NetConf) -> None:
    valid = conf.raw.get("cni.dev/valid-attachments") or []
    if not isinstance(valid, list):
        raise CniError(spec.INVALID_CONFIG, "cni.dev/valid-attachments is not a list")
    keep = {str(a.get("containerID", "")) for a in valid if isinstance(a, dict)}
    _, stub = _stub(conf, conf.timeout)
    try:
        listing = stub.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=conf.timeout)
        for ep in listing.endpoints:
            if ep.container_id and ep.container_id not in keep:  # only what a runtime added
                stub.DeleteEndpoint(datapath_pb2.DeleteEndpointRequest(id=ep.id), timeout=conf.timeout + 20)
    except grpc.RpcError as err:
        if not (isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.NOT_FOUND):
            raise _rpc_error("garbage collection", err) from None
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
