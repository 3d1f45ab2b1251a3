"""`palisade observe`: live flow events from the datapath, filterable."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc
from services.cli.client import CLIError, add_address_flags, add_output_flag, channel, run, to_dict

VERDICTS = {
    "dropped": common_pb2.VERDICT_DENY,
    "denied": common_pb2.VERDICT_DENY,
    "forwarded": common_pb2.VERDICT_ALLOW,
    "allowed": common_pb2.VERDICT_ALLOW,
}


def _line(ev: datapath_pb2.FlowEvent) -> str:
    proto = common_pb2.Protocol.Name(ev.protocol).removeprefix("PROTOCOL_")
    verdict = "FORWARDED" if ev.verdict == common_pb2.VERDICT_ALLOW else "DROPPED"
    reason = datapath_pb2.FlowReason.Name(ev.reason).removeprefix("FLOW_REASON_").lower()
    direction = common_pb2.Direction.Name(ev.direction).removeprefix("DIRECTION_").lower()
    when = ev.time.ToDatetime().strftime("%H:%M:%S.%f")[:-3]
    return (
        f"{when} {verdict:9} {direction:7} {ev.source_ip}:{ev.source_port} (id {ev.source_identity}) -> "
        f"{ev.destination_ip}:{ev.destination_port} (id {ev.destination_identity}) {proto} {reason} {ev.pod}"
    )


@run
def cmd_observe(args: argparse.Namespace) -> int:
    verdicts = []
    for v in args.verdict or []:
        if v.lower() not in VERDICTS:
            raise CLIError(f"unknown verdict {v!r}; use dropped or forwarded", 2)
        verdicts.append(VERDICTS[v.lower()])
    req = datapath_pb2.ObserveRequest(verdicts=verdicts, pod=args.pod or "", limit=args.limit)
    with channel(args, "datapath") as ch:
        try:
            for ev in datapath_pb2_grpc.DatapathServiceStub(ch).Observe(req):
                if args.output == "json":
                    sys.stdout.write(json.dumps(to_dict(ev)) + "\n")
                else:
                    sys.stdout.write(_line(ev) + "\n")
                sys.stdout.flush()
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return 0
            raise CLIError(f"datapath: {err.code().name}: {err.details()}") from None
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("observe", help="stream flow events (like `hubble observe`)")
    p.add_argument("--verdict", action="append", help="dropped or forwarded (repeatable)")
    p.add_argument("--pod", help="only flows of NAMESPACE/POD")
    p.add_argument("--limit", type=int, default=0, help="stop after this many events")
    add_address_flags(p, "datapath")
    add_output_flag(p)
    p.set_defaults(func=cmd_observe)
