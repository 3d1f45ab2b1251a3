"""`palisade endpoint list|get` and the endpoint argument shared with `bpf policy get`."""

from __future__ import annotations

import argparse

import grpc

from palisade.v1 import datapath_pb2, datapath_pb2_grpc
from services.cli.client import (
    CLIError,
    add_address_flags,
    add_output_flag,
    ask_datapaths,
    call,
    node_channels,
    print_json,
    print_table,
    run,
    to_dict,
)


def endpoint_request(text: str) -> datapath_pb2.GetEndpointRequest:
    """An endpoint given as its numeric id or as NAMESPACE/POD."""
    if text.isdigit():
        return datapath_pb2.GetEndpointRequest(id=int(text))
    namespace, sep, pod = text.partition("/")
    if not sep or not namespace or not pod:
        raise CLIError(f"endpoint {text!r}: give its numeric id or NAMESPACE/POD", 2)
    return datapath_pb2.GetEndpointRequest(namespace=namespace, pod=pod)


def _state(ep: datapath_pb2.Endpoint) -> str:
    return datapath_pb2.EndpointState.Name(ep.state).removeprefix("ENDPOINT_STATE_").lower()


def _enforcement(ep: datapath_pb2.Endpoint) -> str:
    return f"ingress={'on' if ep.enforcement.ingress else 'off'} egress={'on' if ep.enforcement.egress else 'off'}"


@run
def cmd_list(args: argparse.Namespace) -> int:
    answers = ask_datapaths(args, args.node, lambda s: s.ListEndpoints, datapath_pb2.ListEndpointsRequest())
    endpoints = [e for answer in answers for e in answer.endpoints]
    if args.output == "json":
        print_json({"endpoints": [to_dict(e) for e in endpoints]})
    else:
        rows = [
            (
                e.node,
                e.id,
                f"{e.namespace}/{e.pod}",
                e.identity,
                ",".join(e.ips),
                _state(e),
                e.realized_revision,
                _enforcement(e),
            )
            for e in endpoints
        ]
        print_table(("NODE", "ID", "POD", "IDENTITY", "IPS", "STATE", "REVISION", "ENFORCEMENT"), rows)
    return 0


@run
def cmd_get(args: argparse.Namespace) -> int:
    req = endpoint_request(args.endpoint)
    with node_channels(args, args.node) as channels:
        if req.id and len(channels) > 1:
            raise CLIError(
                f"endpoint ids are per node: give --node with {req.id}, or NAMESPACE/POD (nodes: "
                f"{', '.join(sorted(channels))})",
                2,
            )
        ep = _find(channels, req)
    if args.output == "json":
        print_json(to_dict(ep))
    else:
        for key, value in (
            ("ID", ep.id),
            ("POD", f"{ep.namespace}/{ep.pod}"),
            ("NODE", ep.node),
            ("IDENTITY", ep.identity),
            ("IPS", ",".join(ep.ips)),
            ("STATE", _state(ep)),
            ("REVISION", ep.realized_revision),
            ("ENFORCEMENT", _enforcement(ep)),
            ("INTERFACE", f"{ep.host_ifname} ({ep.host_ifindex})"),
            ("NETNS", ep.netns),
        ):
            print(f"{key:12} {value}")
        if ep.error:
            print(f"{'ERROR':12} {ep.error}")
        for name, count in sorted(ep.counters.items()):
            print(f"{'COUNTER':12} {name}={count}")
    return 0


def _find(channels: dict[str, grpc.Channel], req: datapath_pb2.GetEndpointRequest) -> datapath_pb2.Endpoint:
    """The endpoint from whichever node has it (a pod lives on one node)."""
    if len(channels) == 1:
        (ch,) = channels.values()
        found: datapath_pb2.Endpoint = call("datapath", datapath_pb2_grpc.DatapathServiceStub(ch).GetEndpoint, req)
        return found
    for _, ch in sorted(channels.items()):
        try:
            found = datapath_pb2_grpc.DatapathServiceStub(ch).GetEndpoint(req, timeout=30)
            return found
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise CLIError(f"datapath: {err.code().name}: {err.details()}") from None
    raise CLIError(f"no node has endpoint {req.namespace}/{req.pod}; list them with `palisade endpoint list`", 2)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("endpoint", help="endpoints (pods) on a node")
    esub = p.add_subparsers(dest="endpoint_command", metavar="COMMAND", required=True)
    lst = esub.add_parser("list", help="list endpoints")
    lst.set_defaults(func=cmd_list)
    get = esub.add_parser("get", help="show one endpoint")
    get.add_argument("endpoint", help="endpoint id or NAMESPACE/POD")
    get.set_defaults(func=cmd_get)
    for q in (lst, get):
        q.add_argument("--node", default="", help="only this node's endpoints (default: every node's)")
        add_address_flags(q, "datapath")
        add_output_flag(q)
