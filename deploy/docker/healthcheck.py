#!/usr/bin/env python
"""Exit 0 when a Palisade service's gRPC health check answers SERVING, 1 otherwise.

    palisade-healthcheck [ADDRESS] [--service NAME] [--timeout SECONDS]

Used as the container healthcheck in deploy/compose (Kubernetes uses its native
``grpc:`` probes instead). ADDRESS defaults to 127.0.0.1:9402; the service name
defaults to "" (the whole server), as in the grpc.health.v1 protocol.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="palisade-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:9402", help="gRPC address host:port")
    parser.add_argument("--service", default="", help="service name to check; empty checks the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
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
