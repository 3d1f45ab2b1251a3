#!/usr/bin/env python
"""Exit 0 when a Palisade service's gRPC health check answers SERVING, 1 otherwise.

    palisade-healthcheck [ADDRESS] [--server NAME] [--tls-dir DIR] [--insecure]
                         [--service NAME] [--timeout SECONDS]

The container healthcheck of deploy/compose and the exec probes of deploy/kubernetes
(kubelet's own ``grpc:`` probes cannot speak mutual TLS). A component checks itself: it
presents its own certificate from the mounted trust directory and expects the server
to prove the same name. ADDRESS defaults to $PALISADE_GRPC_LISTEN (the service's own
listen address), else 127.0.0.1:9402; the trust directory to $PALISADE_TLS_DIR, else
/etc/palisade/tls; NAME to the one component certificate found there. The health
service name defaults to "" (the whole server), as in the grpc.health.v1 protocol.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if args.insecure:
        return grpc.insecure_channel(args.address)
    directory = Path(args.tls_dir)
    name = args.server
    if not name:
        names = sorted(p.stem for p in directory.glob("*.crt") if p.stem != "ca")
        if len(names) != 1:
            found = ", ".join(names) or "none"
            raise SystemExit(f"{args.address}: say which component to check with --server ({directory} holds: {found})")
        name = names[0]
    try:
        ca, cert, key = ((directory / f).read_bytes() for f in ("ca.crt", f"{name}.crt", f"{name}.key"))
    except OSError as exc:
        raise SystemExit(f"{args.address}: cannot read the {name} certificate in {directory}: {exc.strerror}") from None
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(args.address, creds, options=[("grpc.ssl_target_name_override", name)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="palisade-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument(
        "address", nargs="?", default=os.environ.get("PALISADE_GRPC_LISTEN") or "127.0.0.1:9402", help="host:port"
    )
    parser.add_argument("--server", default="", help="component to check (its certificate's name)")
    parser.add_argument("--tls-dir", default=os.environ.get("PALISADE_TLS_DIR") or "/etc/palisade/tls")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get("PALISADE_INSECURE", "").lower() in ("1", "true"),
        help="plaintext, for a service started with --insecure",
    )
    parser.add_argument("--service", default="", help="service name to check; empty checks the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    with _channel(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: health check failed: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
