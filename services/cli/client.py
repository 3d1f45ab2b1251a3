"""How the CLI reaches the services: addresses, channels, errors, output.

Addresses come from flags (`--policy-address`...), else PALISADE_<SERVICE>_ADDRESS,
else the addresses `make run` wrote to its run directory (several replicas with --ha),
else, on a node or in a pod of the cluster (`kubectl exec ds/palisade-datapath -- palisade
status`), the node's datapath socket and the Services of palisade-system, else the default
local ports that `make run` uses. Several comma-separated addresses
of one service make one channel that moves to the next replica when one goes away. A `unix:` address (the datapath's
root-only node socket) needs no certificate; TCP addresses are mutual TLS with the CLI's
certificate, found with --tls-dir, else PALISADE_TLS_DIR, else `make run`'s run
directory, else /etc/palisade/tls; where that holds no CLI certificate but the datapath's (in
the datapath's container), the CLI speaks with the datapath's, which may read (status, policy
get) but change nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from palisade.v1 import common_pb2, common_pb2_grpc, datapath_pb2_grpc
from services.common.config import DEFAULT_GRPC_PORTS
from services.common.grpcserver import grpc_target, open_sync_channel, parse_addresses
from services.common.trust import Credentials, TrustError

SERVICES = ("watcher", "policy", "ipam", "datapath")
#: Where `make run` keeps its installation's certificates, and where a node keeps them.
RUN_TLS_DIR = Path(__file__).resolve().parents[2] / ".run" / "tls"
#: The addresses of the services `make run` started (service -> "host:port[,host:port]").
RUN_ADDRESSES = RUN_TLS_DIR.parent / "addresses.json"
SYSTEM_TLS_DIR = Path("/etc/palisade/tls")
#: The datapath's root-only socket on a node (the datapath's container shares it with the node).
NODE_SOCKET = Path("/var/run/palisade/datapath/cni.sock")
#: Where the Kubernetes manifests run Palisade.
CLUSTER_NAMESPACE = "palisade-system"
T = TypeVar("T")


class CLIError(Exception):
    """An error the user can act on; printed without a traceback, exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def add_address_flags(parser: argparse.ArgumentParser, *services: str) -> None:
    for name in services or SERVICES:
        parser.add_argument(
            f"--{name}-address",
            default=None,
            metavar="HOST:PORT[,...]",
            help=f"{name} service gRPC address, or its replicas' comma-separated (env "
            f"PALISADE_{name.upper()}_ADDRESS; default what `make run` started, else 127.0.0.1:"
            f"{DEFAULT_GRPC_PORTS[name]})",
        )

    parser.add_argument(
        "--tls-dir",
        default=None,
        metavar="DIR",
        help=f"directory with ca.crt, cli.crt and cli.key (env PALISADE_TLS_DIR; default {RUN_TLS_DIR} "
        f"when `make run` made it, else {SYSTEM_TLS_DIR})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="talk to services started with --insecure, without TLS (env PALISADE_INSECURE)",
    )


def credentials(args: argparse.Namespace) -> Credentials | None:
    """The CLI's certificate, or a CLIError saying where to get one; None with --insecure."""
    insecure = getattr(args, "insecure", None) or os.environ.get("PALISADE_INSECURE", "").lower() in ("1", "true")
    if insecure:
        return None
    explicit = getattr(args, "tls_dir", None) or os.environ.get("PALISADE_TLS_DIR")
    if explicit:
        directory = Path(explicit)
    else:
        mine = ("cli.crt", "datapath.crt")
        found = [d for d in (RUN_TLS_DIR, SYSTEM_TLS_DIR) if any((d / f).is_file() for f in mine)]
        if not found:
            raise CLIError(
                f"no certificate for the CLI: on a `make run` machine it is in {RUN_TLS_DIR} once the stack "
                "has started (run `make run`, as the same user); on a cluster run it in the datapath's container "
                "(`kubectl -n palisade-system exec ds/palisade-datapath -- palisade status`); elsewhere point "
                "--tls-dir or PALISADE_TLS_DIR at a directory with ca.crt, cli.crt and cli.key (`palisade install` "
                "and `palisade tls init --dir DIR` make an installation's)"
            )
        directory = found[0]
    # A node's directory (the datapath's container) holds the datapath's certificate only: reads.
    name = "datapath" if not (directory / "cli.crt").exists() and (directory / "datapath.crt").is_file() else "cli"
    try:
        return Credentials.load(directory, name)
    except TrustError as exc:
        raise CLIError(str(exc)) from None


def add_output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")


def address(args: argparse.Namespace, service: str) -> str:
    flag = getattr(args, f"{service}_address", None)
    return (
        flag
        or os.environ.get(f"PALISADE_{service.upper()}_ADDRESS")
        or _run_addresses().get(service)
        or cluster_default(service, os.environ, NODE_SOCKET)
        or f"127.0.0.1:{DEFAULT_GRPC_PORTS[service]}"
    )


def cluster_default(service: str, env: Mapping[str, str], node_socket: Path) -> str:
    """On a node, or in a pod of the cluster: the datapath on its node socket (when it is there
    and ours to use: root's), the others at their Services in palisade-system; else ""."""
    if service == "datapath" and node_socket.exists() and os.access(node_socket, os.R_OK | os.W_OK):
        return f"unix:{node_socket}"
    if env.get("KUBERNETES_SERVICE_HOST"):
        return f"palisade-{service}.{CLUSTER_NAMESPACE}.svc:{DEFAULT_GRPC_PORTS[service]}"
    return ""


def manifest_folder(args: argparse.Namespace) -> Path:
    """The dev cluster's manifest folder (its API server): --manifests, PALISADE_MANIFESTS, or `make run`'s."""
    folder = (
        getattr(args, "manifests", None) or os.environ.get("PALISADE_MANIFESTS") or _run_addresses().get("manifests")
    )
    if not folder:
        raise CLIError("no manifest folder: give --manifests (the folder the running stack's watcher reads)", 2)
    path = Path(folder)
    if not path.is_dir():
        raise CLIError(f"manifest folder {path} is not a folder; give the one the running stack's watcher reads", 2)
    return path


def _run_addresses() -> dict[str, str]:
    try:
        data = json.loads(RUN_ADDRESSES.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def dial_target(address: str) -> str:
    """The gRPC target of one address or of several replicas' (one channel failing over between them)."""
    if address.startswith("unix:") or "," not in address:
        return address
    try:
        return grpc_target(parse_addresses(address))
    except ValueError as exc:
        raise CLIError(f"bad address list {address!r}: {exc}", 2) from None


@contextmanager
def channel(args: argparse.Namespace, service: str, timeout: float = 3.0) -> Iterator[grpc.Channel]:
    """A ready channel to ``service``, or a CLIError naming the address and how to start it."""
    target = address(args, service)
    ch = open_sync_channel(dial_target(target), service, None if target.startswith("unix:") else credentials(args))
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        ch.close()
        raise CLIError(
            f"cannot reach the {service} service at {target}: start the system with `make run` "
            f"(or `python -m services.{service}`), or point --{service}-address / "
            f"PALISADE_{service.upper()}_ADDRESS at it"
        ) from None
    try:
        yield ch
    finally:
        ch.close()


@contextmanager
def node_channels(args: argparse.Namespace, node: str = "") -> Iterator[dict[str, grpc.Channel]]:
    """A ready channel to the datapath of every node (by node name), or of ``node`` only.

    The datapath address may list several nodes' datapaths (a dev cluster's, as `make run
    --nodes` writes them); each is asked which node it serves.
    """
    out: dict[str, grpc.Channel] = {}
    with ExitStack() as stack:
        for target in address(args, "datapath").split(","):
            single = argparse.Namespace(**{**vars(args), "datapath_address": target.strip()})
            ch = stack.enter_context(channel(single, "datapath"))
            status = call("datapath", common_pb2_grpc.StatusServiceStub(ch).GetStatus, common_pb2.GetStatusRequest())
            out[status.node] = ch
        if node and node not in out:
            raise CLIError(f"no datapath serves node {node!r}; the nodes are: {', '.join(sorted(out))}", 2)
        yield {node: out[node]} if node else out


def ask_datapaths(
    args: argparse.Namespace,
    node: str,
    method: Callable[[datapath_pb2_grpc.DatapathServiceStub], Callable[..., T]],
    request: Message,
) -> list[T]:
    """The answers of every node's datapath (or ``node``'s only) to one DatapathService call, in node
    order: ``method`` picks it from a stub (``lambda s: s.ListEndpoints``)."""
    with node_channels(args, node) as channels:
        stubs = [datapath_pb2_grpc.DatapathServiceStub(ch) for _, ch in sorted(channels.items())]
        return [call("datapath", method(stub), request) for stub in stubs]


def call(service: str, fn: Callable[..., T], request: Message, timeout: float = 30.0) -> T:
    """Call one unary method, turning gRPC errors into CLIErrors with the server's message."""
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as err:
        code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        exit_code = 2 if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else 1
        name = code.name if code is not None else "ERROR"
        raise CLIError(f"{service}: {name}: {details}", exit_code) from None


def to_dict(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0 and not rows:
            break


@contextmanager
def progress(message: str) -> Iterator[None]:
    """Show ``message`` with a spinner on stderr if the work takes more than a second."""
    done = threading.Event()
    tty = sys.stderr.isatty()

    def spin() -> None:
        if done.wait(1.0):
            return
        frames = "|/-\\"
        n = 0
        start = time.monotonic()
        while not done.is_set():
            elapsed = time.monotonic() - start + 1.0
            if tty:
                sys.stderr.write(f"\r{frames[n % 4]} {message} ({elapsed:.0f}s)")
            elif n == 0:
                sys.stderr.write(f"{message}...\n")
            sys.stderr.flush()
            n += 1
            done.wait(0.2)
        if tty:
            sys.stderr.write("\r" + " " * (len(message) + 12) + "\r")

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command so CLIErrors print one line to stderr and set the exit code."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except CLIError as exc:
            print(f"palisade: error: {exc}", file=sys.stderr)
            return exc.code

    return wrapper
