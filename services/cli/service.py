"""`palisade service list`: the Service frontends each node load-balances, with their backends."""

from __future__ import annotations

import argparse

from palisade.v1 import common_pb2, datapath_pb2
from services.cli.client import (
    add_address_flags,
    add_output_flag,
    ask_datapaths,
    print_json,
    print_table,
    run,
    to_dict,
)


def _frontend(f: datapath_pb2.ServiceFrontend) -> str:
    host = f"[{f.address}]" if ":" in f.address else f.address
    return f"{host}:{f.port}/{common_pb2.Protocol.Name(f.protocol).removeprefix('PROTOCOL_')}"


def _backends(f: datapath_pb2.ServiceFrontend) -> str:
    if not f.backends:
        return "(none: connections refused)"
    return ",".join(f"{b.address}:{b.port}" for b in f.backends)


@run
def cmd_list(args: argparse.Namespace) -> int:
    answers: list[datapath_pb2.ListServicesResponse] = ask_datapaths(
        args, args.node, lambda s: s.ListServices, datapath_pb2.ListServicesRequest()
    )
    if args.namespace:
        for answer in answers:
            kept = [f for f in answer.frontends if f.namespace == args.namespace]
            del answer.frontends[:]
            answer.frontends.extend(kept)
    if args.output == "json":
        print_json({"nodes": [to_dict(a) for a in answers]})
        return 0
    rows = []
    for answer in answers:
        for f in answer.frontends:
            extra = []
            if f.affinity_timeout_seconds:
                extra.append(f"affinity=ClientIP/{f.affinity_timeout_seconds}s")
            if f.local_only:
                extra.append("internalTrafficPolicy=Local")
            name = f"{f.namespace}/{f.name}" + (f":{f.port_name}" if f.port_name else "")
            rows.append((answer.node, name, _frontend(f), _backends(f), f.id, " ".join(extra)))
    print_table(("NODE", "SERVICE", "FRONTEND", "BACKENDS", "ID", "OPTIONS"), rows)
    for answer in answers:
        for line in answer.skipped:
            print(f"not load-balanced on {answer.node}: {line}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("service", help="Kubernetes Services as the nodes load-balance them")
    ssub = p.add_subparsers(dest="service_command", metavar="COMMAND", required=True)
    lst = ssub.add_parser("list", help="list each node's ClusterIP frontends, backends and service ids")
    lst.add_argument("--node", default="", help="only this node's frontends (default: every node's)")
    lst.add_argument("-n", "--namespace", default="", help="only Services in this namespace")
    add_address_flags(lst, "datapath")
    add_output_flag(lst)
    lst.set_defaults(func=cmd_list)
