"""`palisade bpf policy get ENDPOINT`: the policy entries as read back from the kernel map."""

from __future__ import annotations

import argparse

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc
from services.cli.client import add_address_flags, add_output_flag, call, channel, print_json, print_table, run, to_dict
from services.cli.endpoint import endpoint_request


def _name(enum: object, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix)  # type: ignore[attr-defined]


@run
def cmd_policy_get(args: argparse.Namespace) -> int:
    req = datapath_pb2.GetPolicyMapRequest(endpoint=endpoint_request(args.endpoint))
    with channel(args, "datapath") as ch:
        resp = call("datapath", datapath_pb2_grpc.DatapathServiceStub(ch).GetPolicyMap, req)
    if args.output == "json":
        print_json(to_dict(resp))
        return 0
    print(
        f"endpoint {resp.endpoint_id}  identity {resp.identity}  revision {resp.revision}  "
        f"ingress {'enforced' if resp.enforcement.ingress else 'allow-all'}  "
        f"egress {'enforced' if resp.enforcement.egress else 'allow-all'}\n"
    )
    rows = []
    for e in resp.entries:
        k = e.key
        ports = (
            "ANY"
            if k.port_low == 0
            else (str(k.port_low) if k.port_high in (0, k.port_low) else f"{k.port_low}-{k.port_high}")
        )
        rows.append(
            (
                _name(common_pb2.Direction, k.direction, "DIRECTION_"),
                k.remote_identity or "ANY",
                _name(common_pb2.Protocol, k.protocol, "PROTOCOL_"),
                ports,
                _name(common_pb2.Verdict, e.verdict, "VERDICT_"),
            )
        )
    print_table(("DIRECTION", "IDENTITY", "PROTOCOL", "PORTS", "VERDICT"), rows)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bpf", help="inspect the BPF maps of this node")
    bsub = p.add_subparsers(dest="bpf_command", metavar="MAP", required=True)
    pol = bsub.add_parser("policy", help="the policy map")
    psub = pol.add_subparsers(dest="bpf_policy_command", metavar="COMMAND", required=True)
    get = psub.add_parser("get", help="entries of one endpoint's policy, read from the kernel")
    get.add_argument("endpoint", help="endpoint id or NAMESPACE/POD")
    add_address_flags(get, "datapath")
    add_output_flag(get)
    get.set_defaults(func=cmd_policy_get)
