"""`palisade identity list|get`."""

from __future__ import annotations

import argparse

from palisade.v1 import common_pb2, identity_pb2, identity_pb2_grpc
from services.cli.client import add_address_flags, add_output_flag, call, channel, print_json, print_table, run, to_dict
from services.common.labels import parse_label


def _labels(identity: identity_pb2.Identity) -> str:
    return ",".join(f"{lb.source}:{lb.key}" + (f"={lb.value}" if lb.value else "") for lb in identity.labels)


def _kind(identity: identity_pb2.Identity) -> str:
    return identity_pb2.IdentityKind.Name(identity.kind).removeprefix("IDENTITY_KIND_").lower()


@run
def cmd_list(args: argparse.Namespace) -> int:
    selector = []
    for text in args.label or []:
        lb = parse_label(text)
        selector.append(common_pb2.Label(source=lb.source, key=lb.key, value=lb.value))
    req = identity_pb2.ListIdentitiesRequest(selector=selector, include_reserved=args.reserved)
    with channel(args, "ipam") as ch:
        resp = call("ipam", identity_pb2_grpc.IdentityServiceStub(ch).ListIdentities, req)
    if args.output == "json":
        print_json({"identities": [to_dict(i) for i in resp.identities]})
    else:
        print_table(
            ("ID", "KIND", "REFS", "LABELS"), [(i.id, _kind(i), i.references, _labels(i)) for i in resp.identities]
        )
    return 0


@run
def cmd_get(args: argparse.Namespace) -> int:
    with channel(args, "ipam") as ch:
        ident = call(
            "ipam", identity_pb2_grpc.IdentityServiceStub(ch).GetIdentity, identity_pb2.GetIdentityRequest(id=args.id)
        )
    if args.output == "json":
        print_json(to_dict(ident))
    else:
        print(f"ID      {ident.id}\nKIND    {_kind(ident)}\nREFS    {ident.references}")
        if ident.cidr:
            print(f"CIDR    {ident.cidr}")
        print("LABELS")
        for lb in ident.labels:
            print(f"  {lb.source}:{lb.key}" + (f"={lb.value}" if lb.value else ""))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("identity", help="numeric identities and their labels")
    isub = p.add_subparsers(dest="identity_command", metavar="COMMAND", required=True)
    lst = isub.add_parser("list", help="list identities")
    lst.add_argument("-l", "--label", action="append", help="only identities with this label (repeatable)")
    lst.add_argument("--reserved", action="store_true", help="include reserved identities")
    lst.set_defaults(func=cmd_list)
    get = isub.add_parser("get", help="show one identity")
    get.add_argument("id", type=int)
    get.set_defaults(func=cmd_get)
    for q in (lst, get):
        add_address_flags(q, "ipam")
        add_output_flag(q)
