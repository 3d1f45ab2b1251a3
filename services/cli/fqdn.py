"""`palisade fqdn cache list` and `palisade fqdn names`: what each node's DNS proxy learned.

Like `cilium fqdn cache list` and `cilium fqdn names`: every node's datapath is asked
(``ListFqdnCache``, ``ListFqdnSelectors``), and answers from its DNS proxy's own view.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import grpc

from palisade.v1 import datapath_pb2, datapath_pb2_grpc
from services.cli.client import (
    CLIError,
    add_address_flags,
    add_output_flag,
    ask_datapaths,
    node_channels,
    print_json,
    print_table,
    run,
    to_dict,
)
from services.cli.endpoint import endpoint_request
from services.common import fqdn


def cache_request(args: argparse.Namespace) -> datapath_pb2.ListFqdnCacheRequest:
    """The request the flags describe; bad values are CLIErrors naming the flag."""
    request = datapath_pb2.ListFqdnCacheRequest()
    if args.name:
        try:
            request.name = fqdn.validate_pattern(args.name)
        except fqdn.FqdnError as exc:
            raise CLIError(f"--name: {exc}", 2) from None
    if args.endpoint and args.pod:
        raise CLIError("--endpoint and --pod both name an endpoint: give one", 2)
    if args.pod:
        namespace, sep, pod = args.pod.partition("/")
        if not sep or not namespace or not pod or "/" in pod:
            raise CLIError(f"--pod {args.pod!r}: give NAMESPACE/POD", 2)
        request.endpoint.CopyFrom(datapath_pb2.GetEndpointRequest(namespace=namespace, pod=pod))
    elif args.endpoint:
        try:
            request.endpoint.CopyFrom(endpoint_request(args.endpoint))
        except CLIError as exc:
            raise CLIError(f"--endpoint: {exc}", 2) from None
    return request


def _who(endpoint_ids: Sequence[int], pods: Sequence[str]) -> str:
    return ",".join(pods) if len(pods) == len(endpoint_ids) else ",".join(str(i) for i in endpoint_ids)


def cache_rows(answers: Sequence[datapath_pb2.ListFqdnCacheResponse]) -> list[tuple[object, ...]]:
    """One row per node, name and address. Pure."""
    return [
        (a.node, n.name, x.ip, x.identity, f"{x.ttl_seconds}s", _who(x.endpoint_ids, x.pods))
        for a in answers
        for n in a.names
        for x in n.addresses
    ]


def cache_json(answers: Sequence[datapath_pb2.ListFqdnCacheResponse]) -> dict[str, object]:
    return {"names": [{"node": a.node, **to_dict(n)} for a in answers for n in a.names]}


def selector_rows(answers: Sequence[datapath_pb2.ListFqdnSelectorsResponse]) -> list[tuple[object, ...]]:
    """One row per node, selector and identity it holds (a selector holding none: one row). Pure."""
    rows: list[tuple[object, ...]] = []
    for a in answers:
        for s in a.selectors:
            users = _who(s.endpoint_ids, s.pods)
            if not s.selected:
                rows.append((a.node, s.selector, "-", "-", "-", users))
            for x in s.selected:
                rows.append((a.node, s.selector, x.identity, x.ip, ",".join(x.names), users))
    return rows


def selectors_json(answers: Sequence[datapath_pb2.ListFqdnSelectorsResponse]) -> dict[str, object]:
    return {"selectors": [{"node": a.node, **to_dict(s)} for a in answers for s in a.selectors]}


Answers = list[datapath_pb2.ListFqdnCacheResponse]


def _ask_cache(args: argparse.Namespace, request: datapath_pb2.ListFqdnCacheRequest) -> Answers:
    """Every node's answer; for an endpoint, the answers of the nodes that have it (a pod lives on one)."""
    if not request.HasField("endpoint"):
        return ask_datapaths(args, args.node, lambda s: s.ListFqdnCache, request)
    with node_channels(args, args.node) as channels:
        if request.endpoint.id and len(channels) > 1:
            raise CLIError(
                f"endpoint ids are per node: give --node with {request.endpoint.id}, or --pod NAMESPACE/POD "
                f"(nodes: {', '.join(sorted(channels))})",
                2,
            )
        answers: Answers = []
        missing: list[str] = []
        for name, ch in sorted(channels.items()):
            try:
                answers.append(datapath_pb2_grpc.DatapathServiceStub(ch).ListFqdnCache(request, timeout=30))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    code = 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
                    raise CLIError(f"datapath of {name}: {err.code().name}: {err.details()}", code) from None
                missing.append(err.details())
    if not answers:
        if len(missing) == 1:
            raise CLIError(f"datapath: {missing[0]}", 2)
        ref = request.endpoint
        raise CLIError(f"no node has endpoint {ref.namespace}/{ref.pod}; list them with `palisade endpoint list`", 2)
    return answers


@run
def cmd_cache_list(args: argparse.Namespace) -> int:
    answers = _ask_cache(args, cache_request(args))
    if args.output == "json":
        print_json(cache_json(answers))
    else:
        print_table(("NODE", "NAME", "ADDRESS", "IDENTITY", "TTL", "ENDPOINTS"), cache_rows(answers))
    return 0


@run
def cmd_names(args: argparse.Namespace) -> int:
    answers = ask_datapaths(args, args.node, lambda s: s.ListFqdnSelectors, datapath_pb2.ListFqdnSelectorsRequest())
    if args.output == "json":
        print_json(selectors_json(answers))
    else:
        print_table(("NODE", "SELECTOR", "IDENTITY", "ADDRESS", "NAMES", "ENDPOINTS"), selector_rows(answers))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fqdn", help="names each node's DNS proxy learned, and the toFQDNs selectors holding them")
    fsub = p.add_subparsers(dest="fqdn_command", metavar="COMMAND", required=True)
    cache = fsub.add_parser("cache", help="the learned names")
    csub = cache.add_subparsers(dest="fqdn_cache_command", metavar="COMMAND", required=True)
    lst = csub.add_parser(
        "list",
        help="every learned name with its addresses, TTL left and the endpoints whose lookups hold it",
        description="TTL is what is left of the answer's TTL (raised to the proxy's minimum); at 0s an "
        "address is kept only while a connection that uses it is open.",
    )
    lst.add_argument("--name", default="", help="only names this selects: a name or a pattern (*.example.com)")
    lst.add_argument(
        "--endpoint", default="", help="only what this endpoint learned: its id (with --node) or NAMESPACE/POD"
    )
    lst.add_argument("--pod", default="", help="only what this pod learned (NAMESPACE/POD)")
    lst.set_defaults(func=cmd_cache_list)
    names = fsub.add_parser(
        "names", help="the toFQDNs selectors of each node's endpoints and the learned identities each holds"
    )
    names.set_defaults(func=cmd_names)
    for q in (lst, names):
        q.add_argument("--node", default="", help="only this node (default: every node)")
        add_address_flags(q, "datapath")
        add_output_flag(q)
