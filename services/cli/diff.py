"""`palisade policy diff`: preview a policy change against the running system, without applying it.

The CLI reads the files (policies are checked offline first, so an error names its file), gathers
the flows every node's flow ring recorded (``--since`` narrows them), aggregates them by the
identities, direction, protocol and port the datapath judged, and asks PolicyService to compute
the change on a copy of its engine, with the live identities and ipcache.

Exit status: 0 when no observed flow would be newly dropped, 3 when some would (a CI pipeline
gates a change on it), 2 for bad input, 1 for other errors.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterable

from palisade.v1 import common_pb2, datapath_pb2, policy_pb2, policy_pb2_grpc
from services.cli.analyze import load_documents
from services.cli.client import (
    CLIError,
    add_address_flags,
    add_output_flag,
    call,
    channel,
    print_json,
    run,
    to_dict,
)
from services.cli.observe import recorded_flows
from services.common.manifests import Document
from services.policy.documents import dump_document
from services.policy.engine.analyze import AnalyzeError, Probe
from services.policy.engine.model import PolicyValidationError
from services.policy.engine.parse import POLICY_KINDS, parse_policy
from services.policy.engine.sources import parse_kind

#: Exit status when observed traffic would be newly dropped.
EXIT_NEWLY_DROPPED = 3
#: The flows a policy decided (replies, refusals without backends and the like are not judged again).
JUDGED_REASONS = {
    datapath_pb2.FLOW_REASON_POLICY_ALLOW,
    datapath_pb2.FLOW_REASON_POLICY_DENY,
    datapath_pb2.FLOW_REASON_DEFAULT_DENY,
    datapath_pb2.FLOW_REASON_NOT_ENFORCED,
}


def delete_ref(text: str) -> common_pb2.ObjectRef:
    """``KIND/NAMESPACE/NAME``, or ``KIND/NAME`` for a cluster-wide policy."""
    parts = text.split("/")
    kind = parse_kind(parts[0]) if parts else None
    if kind is None or len(parts) not in (2, 3) or not all(parts):
        raise CLIError(
            f"--delete {text!r}: give KIND/NAMESPACE/NAME (e.g. cnp/shop/db) or KIND/NAME for a "
            "CiliumClusterwideNetworkPolicy",
            2,
        )
    namespace, name = (parts[1], parts[2]) if len(parts) == 3 else ("", parts[1])
    return common_pb2.ObjectRef(kind=kind.value, namespace=namespace, name=name)


def policy_documents(docs: Iterable[Document]) -> tuple[list[Document], dict[str, int]]:
    """The policies among ``docs`` (each checked offline: an invalid one is a CLIError naming its
    file and field) and a count of the other kinds, which are not part of the change."""
    policies: list[Document] = []
    others: collections.Counter[str] = collections.Counter()
    for doc in docs:
        kind = str(doc.body.get("kind", ""))
        if kind not in POLICY_KINDS:
            others[kind or "(no kind)"] += 1
            continue
        try:
            parse_policy(doc.body)
        except PolicyValidationError as exc:
            raise CLIError(f"{doc.source}: {exc}", 2) from None
        policies.append(doc)
    return policies, dict(others)


def aggregate(events: Iterable[datapath_pb2.FlowEvent]) -> list[policy_pb2.ObservedFlow]:
    """Flows a policy decided, counted per (identities, direction, protocol, port), with the first
    one's pods and node as the example."""
    out: dict[tuple[int, int, int, int, int], policy_pb2.ObservedFlow] = {}
    for ev in events:
        if ev.reason not in JUDGED_REASONS and ev.verdict != common_pb2.VERDICT_AUDIT:
            continue
        key = (ev.source_identity, ev.destination_identity, ev.direction, ev.protocol, ev.destination_port)
        flow = out.get(key)
        if flow is None:
            flow = out[key] = policy_pb2.ObservedFlow(
                source_identity=ev.source_identity,
                destination_identity=ev.destination_identity,
                direction=ev.direction,
                protocol=ev.protocol,
                port=ev.destination_port,
                source_pod=ev.source_pod,
                destination_pod=ev.destination_pod,
                node=ev.node,
            )
        flow.count += 1
    return list(out.values())


def _verdict(v: int) -> str:
    return "allowed" if v == common_pb2.VERDICT_ALLOW else "DROPPED"


def _ref_text(ref: common_pb2.ObjectRef) -> str:
    return f"{ref.kind} {ref.namespace}/{ref.name}" if ref.namespace else f"{ref.kind} {ref.name}"


def _probe_text(p: policy_pb2.DiffProbe) -> str:
    proto = common_pb2.Protocol.Name(p.protocol).removeprefix("PROTOCOL_")
    return f"{p.port or 'any'}/{proto}"


def _side(identity: int, pods: Iterable[str]) -> str:
    names = list(pods)
    return f"{identity} ({', '.join(names)})" if names else str(identity)


def _by_policy(items: Iterable[tuple[Iterable[common_pb2.ObjectRef], str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for refs, text in items:
        names = [_ref_text(r) for r in refs] or ["(no changed policy selects it)"]
        groups[", ".join(names)].append(text)
    return groups


def render(resp: policy_pb2.DiffResponse, considered: int) -> str:
    lines = [
        f"Preview against revision {resp.revision}; ports probed: "
        + (", ".join(_probe_text(p) for p in resp.probes) or "none"),
        "",
    ]
    pairs = _by_policy(
        (
            c.policies,
            f"{_side(c.source_identity, c.source_pods)} -> {_side(c.destination_identity, c.destination_pods)}  "
            f"{_probe_text(c.probe)}  {_verdict(c.before)} -> {_verdict(c.after)}",
        )
        for c in resp.pairs
    )
    lines.append(f"Identity pairs whose verdict changes: {len(resp.pairs) or 'none'}")
    for policy, texts in sorted(pairs.items()):
        lines.append(f"  {policy}:")
        lines += [f"    {t}" for t in texts]
    flows = _by_policy(
        (
            c.policies,
            f"{c.flow.count}x {c.flow.source_pod or c.flow.source_identity} (id {c.flow.source_identity}) -> "
            f"{c.flow.destination_pod or c.flow.destination_identity} (id {c.flow.destination_identity}) "
            f"{c.flow.port}/{common_pb2.Protocol.Name(c.flow.protocol).removeprefix('PROTOCOL_')} "
            f"{common_pb2.Direction.Name(c.flow.direction).removeprefix('DIRECTION_').lower()} on {c.flow.node}  "
            f"{_verdict(c.before)} -> {_verdict(c.after)}",
        )
        for c in resp.flows
    )
    lines.append("")
    lines.append(
        f"Observed flows whose verdict changes: {sum(c.flow.count for c in resp.flows) or 'none'} "
        f"(of {considered} recorded flows that policy decided)"
    )
    for policy, texts in sorted(flows.items()):
        lines.append(f"  {policy}:")
        lines += [f"    {t}" for t in texts]
    lines.append("")
    for note in resp.notes:
        lines.append(f"Note: {note}")
    if resp.notes:
        lines.append("")
    if resp.newly_dropped:
        lines.append(f"Result: {resp.newly_dropped} observed flows would be newly DROPPED.")
    else:
        lines.append("Result: no observed flow would be newly dropped.")
    return "\n".join(lines)


@run
def cmd_diff(args: argparse.Namespace) -> int:
    if not args.paths and not args.delete:
        raise CLIError("give the changed policies with -f FILE, or --delete KIND/NAMESPACE/NAME", 2)
    try:
        probes = [Probe.parse(p) for p in args.probes or []]
        docs = load_documents(args.paths or [])
    except AnalyzeError as err:
        raise CLIError(str(err), 2) from None
    policies, others = policy_documents(docs)
    if others:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(others.items()))
        print(f"note: {kinds} in the files are not policies: the diff uses the live pods", file=sys.stderr)
    if args.paths and not policies and not args.delete:
        raise CLIError(f"no policy in {' '.join(args.paths)}: nothing to preview", 2)
    request = policy_pb2.DiffRequest(
        documents="".join("---\n" + dump_document(d.body) for d in policies),
        origin=", ".join(args.paths or []),
        deletes=[delete_ref(t) for t in args.delete or []],
        probes=[policy_pb2.DiffProbe(port=p.port, protocol=int(p.protocol)) for p in probes],  # type: ignore[arg-type]
    )
    considered = 0
    if not args.no_flows:
        flows = aggregate(recorded_flows(args, args.since))
        considered = sum(f.count for f in flows)
        request.flows.extend(flows)
    with channel(args, "policy") as ch:
        resp = call("policy", policy_pb2_grpc.PolicyServiceStub(ch).Diff, request, timeout=300)
    if args.output == "json":
        print_json({**to_dict(resp), "flows_considered": considered})
    else:
        print(render(resp, considered))
    return EXIT_NEWLY_DROPPED if resp.newly_dropped else 0


def register(psub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = psub.add_parser(
        "diff",
        help="preview a change against the running system and the flows it saw (nothing is applied)",
        description="Compare the running policy with the policy after the change: identity pairs whose "
        "verdict changes, and the recorded flows whose verdict would change. Exit status 3 when observed "
        "traffic would be newly dropped, 0 otherwise (2: bad input).",
    )
    p.add_argument("-f", "--filename", dest="paths", action="append", metavar="PATH", help="new or edited policies")
    p.add_argument("--delete", action="append", metavar="KIND/NS/NAME", help="a policy the change deletes")
    p.add_argument("--since", help="only flows recorded since a duration ago (30s, 5m) or an RFC 3339 time")
    p.add_argument(
        "--probe",
        dest="probes",
        action="append",
        metavar="PORT/PROTO",
        help="judge identity pairs on this port (default: the ports the changed policies name)",
    )
    p.add_argument("--no-flows", action="store_true", help="do not read the nodes' flow rings")
    add_address_flags(p, "policy", "datapath")
    add_output_flag(p)
    p.set_defaults(func=cmd_diff)
