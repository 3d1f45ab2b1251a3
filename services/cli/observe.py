"""`palisade observe`: flow events of every node's datapath, merged in time order, hubble-like filters.

As Hubble Relay does, the CLI opens one Observe stream per node (every datapath the address
lists); each datapath filters on its side and replays its flow ring for ``--last``/``--since``.
History is merged by time across nodes (``--last N`` keeps the N newest of the cluster); live
flows (``--follow``, or no ``--last``/``--since`` at all) are printed as they arrive.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import grpc
import yaml

from palisade.v1 import common_pb2, datapath_pb2, datapath_pb2_grpc, policy_pb2, policy_pb2_grpc
from services.cli.client import (
    CLIError,
    add_address_flags,
    add_output_flag,
    call,
    channel,
    node_channels,
    run,
    to_dict,
)
from services.common import fqdn
from services.policy.engine.model import Direction, PolicyValidationError, Verdict
from services.policy.engine.parse import parse_policy

VERDICTS = {
    "dropped": common_pb2.VERDICT_DENY,
    "denied": common_pb2.VERDICT_DENY,
    "forwarded": common_pb2.VERDICT_ALLOW,
    "allowed": common_pb2.VERDICT_ALLOW,
    "audit": common_pb2.VERDICT_AUDIT,
}
PROTOCOLS = {
    "tcp": common_pb2.PROTOCOL_TCP,
    "udp": common_pb2.PROTOCOL_UDP,
    "sctp": common_pb2.PROTOCOL_SCTP,
    "icmp": common_pb2.PROTOCOL_ICMP,
    "icmpv6": common_pb2.PROTOCOL_ICMPV6,
}
_VERDICT_NAMES = {
    common_pb2.VERDICT_ALLOW: "FORWARDED",
    common_pb2.VERDICT_DENY: "DROPPED",
    common_pb2.VERDICT_AUDIT: "AUDIT",
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: float) -> int:
    """``--since``: a duration back from ``now`` (``90s``, ``5m``, ``1h``) or an RFC 3339 time; Unix ns."""
    m = _DURATION.match(text.strip())
    if m:
        return int((now - float(m.group(1)) * _UNIT_SECONDS[m.group(2)]) * 1e9)
    try:
        when = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise CLIError(
            f"--since {text!r}: give a duration such as 30s, 5m, 2h, or a time such as 2026-11-26T15:04:05Z", 2
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return int(when.timestamp() * 1e9)


def _pod(text: str, namespace: str, flag: str) -> str:
    if "/" in text:
        ns, _, name = text.partition("/")
        if not ns or not name or "/" in name:
            raise CLIError(f"{flag} {text!r}: give NAMESPACE/POD", 2)
        return text
    if not namespace:
        raise CLIError(f"{flag} {text!r}: give NAMESPACE/POD (or --namespace with the pod's name)", 2)
    return f"{namespace}/{text}"


def flow_filter(args: argparse.Namespace) -> datapath_pb2.FlowFilter:
    """The filter the flags describe; bad values are CLIErrors naming the flag."""
    verdicts = []
    for v in args.verdict or []:
        if v.lower() not in VERDICTS:
            raise CLIError(f"--verdict {v!r}: use forwarded, dropped or audit", 2)
        verdicts.append(VERDICTS[v.lower()])
    protocols = []
    for p in args.protocol or []:
        if p.lower() not in PROTOCOLS:
            raise CLIError(f"--protocol {p!r}: use one of {', '.join(PROTOCOLS)}", 2)
        protocols.append(PROTOCOLS[p.lower()])
    for port in args.port or []:
        if not 0 < port < 65536:
            raise CLIError(f"--port {port}: give a port 1-65535", 2)
    fqdns = []
    for pattern in args.fqdn or []:
        try:
            fqdns.append(fqdn.validate_pattern(pattern))
        except fqdn.FqdnError as exc:
            raise CLIError(f"--fqdn: {exc}", 2) from None
    namespaces = args.namespace or []
    ns = namespaces[0] if len(namespaces) == 1 else ""
    return datapath_pb2.FlowFilter(
        verdicts=verdicts,
        namespaces=[] if (args.pod or args.from_pod or args.to_pod) and ns else namespaces,
        pods=[_pod(p, ns, "--pod") for p in args.pod or []],
        from_pods=[_pod(p, ns, "--from-pod") for p in args.from_pod or []],
        to_pods=[_pod(p, ns, "--to-pod") for p in args.to_pod or []],
        from_identities=args.from_identity or [],
        to_identities=args.to_identity or [],
        ports=args.port or [],
        protocols=protocols,
        fqdns=fqdns,
    )


class AuditNames:
    """Names the policies in audit mode behind each audit flow, from PolicyService's list: those
    selecting the flow's local endpoint that, in the flow's direction, put it in default deny (for
    a default-deny audit) or have a deny rule (for a deny audit)."""

    REFRESH = 30.0

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._loaded_at = -self.REFRESH
        #: (identity, direction, deny rule?) -> policy names
        self._names: dict[tuple[int, int, bool], list[str]] = {}
        self.error = ""

    def _load(self) -> None:
        self._loaded_at = time.monotonic()
        names: dict[tuple[int, int, bool], list[str]] = {}
        try:
            with channel(self._args, "policy") as ch:
                listing = call(
                    "policy", policy_pb2_grpc.PolicyServiceStub(ch).ListPolicies, policy_pb2.ListPoliciesRequest()
                )
        except CLIError as err:
            self.error = str(err)
            return
        for status in listing.policies:
            if status.mode != "audit" or not status.document:
                continue
            try:
                policy = parse_policy(yaml.safe_load(status.document))
            except (PolicyValidationError, yaml.YAMLError, AttributeError):
                continue
            name = f"{status.ref.kind} {status.ref.namespace + '/' if status.ref.namespace else ''}{status.ref.name}"
            for direction, wire in (
                (Direction.INGRESS, common_pb2.DIRECTION_INGRESS),
                (Direction.EGRESS, common_pb2.DIRECTION_EGRESS),
            ):
                enforces = any(
                    r.enforce_ingress if direction is Direction.INGRESS else r.enforce_egress for r in policy.rules
                )
                denies = any(
                    pr.direction is direction and pr.verdict is Verdict.DENY
                    for r in policy.rules
                    for pr in r.peer_rules
                )
                for identity in status.subjects:
                    if enforces:
                        names.setdefault((identity, wire, False), []).append(name)
                    if denies:
                        names.setdefault((identity, wire, True), []).append(name)
        self._names = names

    def name(self, ev: datapath_pb2.FlowEvent) -> None:
        """Fill ``ev.audit_policies`` for an audit flow."""
        if ev.verdict != common_pb2.VERDICT_AUDIT or ev.audit_policies:
            return
        if time.monotonic() - self._loaded_at >= self.REFRESH:
            self._load()
        local = ev.source_identity if ev.direction == common_pb2.DIRECTION_EGRESS else ev.destination_identity
        deny = ev.reason == datapath_pb2.FLOW_REASON_POLICY_DENY
        ev.audit_policies.extend(self._names.get((local, ev.direction, deny), []))


def _peer(pod: str, ip: str, names: Iterable[str]) -> str:
    """A pod by its name; a learned address by its DNS names, then the address."""
    if pod:
        return pod
    known = ",".join(names)
    return f"{known} ({ip})" if known else ip


def line(ev: datapath_pb2.FlowEvent) -> str:
    proto = (
        common_pb2.Protocol.Name(ev.protocol).removeprefix("PROTOCOL_")
        if ev.protocol in PROTOCOLS.values()
        else str(ev.protocol)
    )
    verdict = _VERDICT_NAMES.get(ev.verdict, "UNKNOWN")
    reason = datapath_pb2.FlowReason.Name(ev.reason).removeprefix("FLOW_REASON_").lower()
    direction = common_pb2.Direction.Name(ev.direction).removeprefix("DIRECTION_").lower()
    when = ev.time.ToDatetime().strftime("%H:%M:%S.%f")[:-3]
    src = f"{_peer(ev.source_pod, ev.source_ip, ev.source_names)}:{ev.source_port} (id {ev.source_identity})"
    dst = (
        f"{_peer(ev.destination_pod, ev.destination_ip, ev.destination_names)}:{ev.destination_port} "
        f"(id {ev.destination_identity})"
    )
    audit = f" by {','.join(ev.audit_policies)}" if ev.audit_policies else ""
    return f"{when} {ev.node} {verdict:9} {direction:7} {src} -> {dst} {proto} {reason}{audit}"


def merge_history(streams: Iterable[Iterable[datapath_pb2.FlowEvent]], last: int = 0) -> list[datapath_pb2.FlowEvent]:
    """Each node's history (oldest first) merged in time order; with ``last``, the newest ``last``."""
    merged = list(heapq.merge(*streams, key=lambda e: (e.time.seconds, e.time.nanos, e.node)))
    return merged[-last:] if last else merged


def history(channels: dict[str, grpc.Channel], request: datapath_pb2.ObserveRequest) -> list[datapath_pb2.FlowEvent]:
    """The flows of every node's ring that ``request`` selects (not following), merged in time order."""
    req = datapath_pb2.ObserveRequest()
    req.CopyFrom(request)
    req.follow = False
    per_node: list[list[datapath_pb2.FlowEvent]] = []
    for name, ch in sorted(channels.items()):
        try:
            per_node.append(list(datapath_pb2_grpc.DatapathServiceStub(ch).Observe(req, timeout=60)))
        except grpc.RpcError as err:
            raise CLIError(
                f"datapath of {name}: {err.code().name}: {err.details()}",
                2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1,
            ) from None
    return merge_history(per_node, request.last)


def recorded_flows(args: argparse.Namespace, since: str | None) -> list[datapath_pb2.FlowEvent]:
    """Every node's recorded flows (its flow ring), those since ``since`` (a ``--since`` text) or all,
    merged in time order."""
    request = datapath_pb2.ObserveRequest()
    request.since.FromNanoseconds(parse_since(since, time.time()) if since else 1)
    with node_channels(args) as channels:
        return history(channels, request)


def _follow(
    channels: dict[str, grpc.Channel], request: datapath_pb2.ObserveRequest
) -> Iterator[datapath_pb2.FlowEvent]:
    """Live flows of every node as they come (one stream per node, read by a thread each)."""
    out: queue.Queue[datapath_pb2.FlowEvent | BaseException | None] = queue.Queue(maxsize=10000)
    calls = []

    def pump(name: str, call: grpc.Future) -> None:
        try:
            for ev in call:
                out.put(ev)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                out.put(CLIError(f"datapath of {name}: {err.code().name}: {err.details()}"))
        finally:
            out.put(None)

    for name, ch in sorted(channels.items()):
        call = datapath_pb2_grpc.DatapathServiceStub(ch).Observe(request)
        calls.append(call)
        threading.Thread(target=pump, args=(name, call), daemon=True).start()
    running = len(calls)
    try:
        while running:
            item = out.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for call in calls:
            call.cancel()


@run
def cmd_observe(args: argparse.Namespace) -> int:
    if args.last is not None and args.last <= 0:
        raise CLIError(f"--last {args.last}: give a positive number of flows", 2)
    flt = flow_filter(args)
    request = datapath_pb2.ObserveRequest(filter=flt, last=args.last or 0)
    if args.since:
        request.since.FromNanoseconds(parse_since(args.since, time.time()))
    replay = bool(args.since or args.last)
    follow = args.follow or not replay
    printed = 0

    names = AuditNames(args)

    def emit(ev: datapath_pb2.FlowEvent) -> bool:
        nonlocal printed
        names.name(ev)
        if names.error:
            print(f"note: audit flows are shown without their policies' names: {names.error}", file=sys.stderr)
            names.error = ""
        sys.stdout.write((json.dumps(to_dict(ev)) if args.output == "json" else line(ev)) + "\n")
        sys.stdout.flush()
        printed += 1
        return bool(args.limit) and printed >= args.limit

    with node_channels(args, args.node or "") as channels:
        if not follow:
            for ev in history(channels, request):
                if emit(ev):
                    return 0
            return 0
        # One stream per node: its history, an end-of-history mark, then live flows (the node takes
        # the history and subscribes in one step: nothing is missed or repeated). The histories are
        # merged in time order once every node's is in; live flows print as they come.
        request.follow = True
        waiting = set(channels) if replay else set()
        histories: dict[str, list[datapath_pb2.FlowEvent]] = {name: [] for name in waiting}
        held: list[datapath_pb2.FlowEvent] = []  # live flows that came while other nodes still replay
        for ev in _follow(channels, request):
            if ev.node in waiting:
                if not ev.history_end:
                    histories[ev.node].append(ev)
                    continue
                waiting.discard(ev.node)
                if waiting:
                    continue
                for old in [*merge_history(histories.values(), args.last or 0), *held]:
                    if emit(old):
                        return 0
                held = []
            elif waiting:
                held.append(ev)
            elif emit(ev):
                return 0
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "observe",
        help="flow events of every node, merged in time order (like `hubble observe` through Hubble Relay)",
        description="Without --last or --since, stream live flows; with either, print the flows the nodes' "
        "flow rings recorded (merged in time order) and stop, unless --follow.",
    )
    p.add_argument("--verdict", action="append", help="forwarded, dropped or audit (repeatable)")
    p.add_argument("--namespace", action="append", help="flows from or to a pod of NAMESPACE (repeatable)")
    p.add_argument("--pod", action="append", help="flows from or to NAMESPACE/POD (repeatable)")
    p.add_argument("--from-pod", action="append", help="flows from NAMESPACE/POD (repeatable)")
    p.add_argument("--to-pod", action="append", help="flows to NAMESPACE/POD (repeatable)")
    p.add_argument("--from-identity", type=int, action="append", help="flows from this identity (repeatable)")
    p.add_argument("--to-identity", type=int, action="append", help="flows to this identity (repeatable)")
    p.add_argument("--port", type=int, action="append", help="flows to or from this port (repeatable)")
    p.add_argument("--protocol", action="append", help="tcp, udp, sctp, icmp, icmpv6 (repeatable)")
    p.add_argument(
        "--fqdn",
        action="append",
        help="flows from or to an address learned for a name this selects: a name or a pattern such as "
        "*.example.com (repeatable)",
    )
    p.add_argument("--node", help="only this node's datapath")
    p.add_argument("--since", help="recorded flows since a duration ago (30s, 5m, 1h) or an RFC 3339 time")
    p.add_argument("--last", type=int, help="the N most recent recorded flows (of the cluster)")
    p.add_argument("-f", "--follow", action="store_true", help="after --last/--since, keep streaming live flows")
    p.add_argument("--limit", type=int, default=0, help="stop after this many events")
    add_address_flags(p, "datapath", "policy")
    add_output_flag(p)
    p.set_defaults(func=cmd_observe)
