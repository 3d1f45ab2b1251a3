"""`palisade policy import|delete|get|list|wait|trace`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from palisade.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.cli import diff
from services.cli.client import (
    CLIError,
    add_address_flags,
    add_output_flag,
    call,
    channel,
    print_json,
    print_table,
    progress,
    run,
    to_dict,
)
from services.common.manifests import DocumentError, split_documents
from services.policy.documents import dump_document

KINDS = {
    "networkpolicy": "NetworkPolicy",
    "netpol": "NetworkPolicy",
    "cnp": "CiliumNetworkPolicy",
    "ciliumnetworkpolicy": "CiliumNetworkPolicy",
    "ccnp": "CiliumClusterwideNetworkPolicy",
    "ciliumclusterwidenetworkpolicy": "CiliumClusterwideNetworkPolicy",
}
PROTOCOLS = {
    "tcp": common_pb2.PROTOCOL_TCP,
    "udp": common_pb2.PROTOCOL_UDP,
    "sctp": common_pb2.PROTOCOL_SCTP,
    "icmp": common_pb2.PROTOCOL_ICMP,
    "any": common_pb2.PROTOCOL_ANY,
}
SOURCES = {"api": policy_pb2.POLICY_SOURCE_API, "kubernetes": policy_pb2.POLICY_SOURCE_KUBERNETES}


def _state(status: policy_pb2.PolicyStatus) -> str:
    return policy_pb2.PolicyState.Name(status.state).removeprefix("POLICY_STATE_").lower()


def source_text(status: policy_pb2.PolicyStatus) -> str:
    """Where a policy came from, in one word: api, manifest or kubernetes."""
    if status.source == policy_pb2.POLICY_SOURCE_API:
        return "api"
    if status.origin.startswith("manifests"):
        return "manifest"
    if status.source == policy_pb2.POLICY_SOURCE_KUBERNETES:
        return "kubernetes"
    return "-"


def _ref_text(ref: common_pb2.ObjectRef) -> str:
    return f"{ref.kind} {ref.namespace + '/' if ref.namespace else ''}{ref.name}"


def _print_statuses(statuses: list[policy_pb2.PolicyStatus]) -> None:
    rows = []
    for s in statuses:
        nodes = f"{s.nodes_realized}/{s.nodes_total}" if s.nodes_total else "-"
        rows.append(
            (
                s.ref.kind,
                s.ref.namespace or "-",
                s.ref.name,
                source_text(s),
                _state(s),
                s.mode or "-",
                s.revision or "-",
                nodes,
                len(s.unsupported) or "",
            )
        )
    print_table(("KIND", "NAMESPACE", "NAME", "SOURCE", "STATE", "MODE", "REVISION", "NODES", "UNSUPPORTED"), rows)
    for s in statuses:
        if s.error:
            print(f"\n{_ref_text(s.ref)}: {s.error}")
        for u in s.unsupported:
            print(f"{_ref_text(s.ref)}: unsupported, not enforced: {u}")


def _read(paths: list[str]) -> list[tuple[str, str]]:
    docs = []
    for p in paths:
        if p == "-":
            docs.append(("<stdin>", sys.stdin.read()))
            continue
        path = Path(p)
        files = (
            sorted(f for f in path.rglob("*") if f.suffix in (".yaml", ".yml", ".json")) if path.is_dir() else [path]
        )
        for f in files:
            try:
                docs.append((str(f), f.read_text()))
            except OSError as exc:
                raise CLIError(f"cannot read {f}: {exc.strerror}", 2) from None
    return docs


def import_deadline(text: str) -> float:
    """Seconds to give an import: the server reads about a MB of YAML per second; leave room for a busy one."""
    return 30.0 + 30.0 * len(text.encode()) / 1_000_000


def _rpc_error(err: grpc.RpcError) -> CLIError:
    code = err.code()
    exit_code = 2 if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else 1
    return CLIError(f"policy: {code.name}: {err.details()}", exit_code)


def _late_import(
    stub: policy_pb2_grpc.PolicyServiceStub, text: str, origin: str, deadline: float
) -> list[policy_pb2.PolicyStatus]:
    """The answer to an import did not come in time: find out whether it was applied.

    The service never applies an import whose caller has given up, and applies one import
    whole or not at all, so the documents now in force say which happened: never report a
    failure for an import that succeeded.
    """
    try:
        docs = split_documents(text, origin)
    except DocumentError as exc:
        raise CLIError(str(exc), 2) from None
    statuses = []
    missing = []
    for document in docs:
        label, doc = document.source, document.body
        meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
        assert isinstance(meta, dict)
        kind = KINDS.get(str(doc.get("kind", "")).lower(), str(doc.get("kind", "")))
        namespace = "" if kind == "CiliumClusterwideNetworkPolicy" else str(meta.get("namespace") or "default")
        ref = common_pb2.ObjectRef(kind=kind, namespace=namespace, name=str(meta.get("name") or ""))
        try:
            status = stub.GetPolicy(
                policy_pb2.GetPolicyRequest(ref=ref, source=policy_pb2.POLICY_SOURCE_API), timeout=30
            )
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise _rpc_error(err) from None
            missing.append(label)
            continue
        if status.document != dump_document(doc):
            missing.append(label)
            continue
        status.document = ""
        statuses.append(status)
    if missing:
        raise CLIError(
            f"policy: no answer within {deadline:.0f}s, and {', '.join(missing)} is not in force as sent: the import "
            "was not applied; retry it (importing the same documents again is harmless), with a larger "
            "--request-timeout if the service is busy"
        )
    print(f"palisade: the answer came after {deadline:.0f}s, but the import was applied", file=sys.stderr)
    return statuses


@run
def cmd_import(args: argparse.Namespace) -> int:
    statuses: list[policy_pb2.PolicyStatus] = []
    revision = 0
    with channel(args, "policy") as ch:
        stub = policy_pb2_grpc.PolicyServiceStub(ch)
        for origin, text in _read(args.file):
            req = policy_pb2.ImportPoliciesRequest(documents=text, dry_run=args.dry_run, origin=origin)
            deadline = args.request_timeout or import_deadline(text)
            try:
                with progress(f"importing {origin}"):
                    resp = stub.ImportPolicies(req, timeout=deadline)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or args.dry_run:
                    raise _rpc_error(err) from None
                late = _late_import(stub, text, origin, deadline)
                statuses.extend(late)
                revision = max([revision, *(s.revision for s in late)])
                continue
            statuses.extend(resp.policies)
            revision = max(revision, resp.revision)
        if args.wait and not args.dry_run and revision:
            with progress(f"waiting for revision {revision} to be realized"):
                _wait(stub, revision, args.timeout)
    rejected = [s for s in statuses if s.state == policy_pb2.POLICY_STATE_REJECTED]
    if args.output == "json":
        print_json({"revision": revision, "dry_run": args.dry_run, "policies": [to_dict(s) for s in statuses]})
    else:
        _print_statuses(statuses)
        if args.dry_run:
            print(f"\ndry run: nothing applied; the import would make revision {revision}")
        else:
            print(f"\nrevision {revision}")
    return 2 if rejected else 0


def _ref(args: argparse.Namespace) -> common_pb2.ObjectRef:
    kind = KINDS.get(args.kind.lower())
    if kind is None:
        raise CLIError(f"unknown policy kind {args.kind!r}; use one of: {', '.join(sorted(set(KINDS)))}", 2)
    namespace = "" if kind == "CiliumClusterwideNetworkPolicy" else (args.namespace or "default")
    return common_pb2.ObjectRef(kind=kind, namespace=namespace, name=args.name)


@run
def cmd_delete(args: argparse.Namespace) -> int:
    req = policy_pb2.DeletePolicyRequest(ref=_ref(args), source=SOURCES[args.source])
    with channel(args, "policy") as ch:
        resp = call("policy", policy_pb2_grpc.PolicyServiceStub(ch).DeletePolicy, req)
    if args.output == "json":
        print_json(to_dict(resp))
    else:
        print(f"deleted; revision {resp.revision}")
    return 0


@run
def cmd_get(args: argparse.Namespace) -> int:
    with channel(args, "policy") as ch:
        stub = policy_pb2_grpc.PolicyServiceStub(ch)
        if args.name:
            status = call(
                "policy",
                stub.GetPolicy,
                policy_pb2.GetPolicyRequest(
                    ref=_ref(args), source=SOURCES.get(args.source, policy_pb2.POLICY_SOURCE_UNSPECIFIED)
                ),
            )
            statuses = [status]
        else:
            listing = call("policy", stub.ListPolicies, policy_pb2.ListPoliciesRequest(namespace=args.namespace or ""))
            statuses = list(listing.policies)
    if args.output == "json":
        print_json({"policies": [to_dict(s) for s in statuses]})
    else:
        _print_statuses(statuses)
        if args.name and statuses[0].nodes:
            print()
            print_table(
                ("NODE", "REALIZED REVISION", "ENDPOINTS", "REALIZED", "FAILED"),
                [
                    (n.node, n.realized_revision or "-", n.endpoints, n.endpoints_realized, n.endpoints_failed)
                    for n in statuses[0].nodes
                ],
            )
        if args.name and statuses[0].origin:
            print(f"\norigin: {statuses[0].origin}")
        if args.name and statuses[0].document:
            print("\n" + statuses[0].document)
    return 0


def _wait(stub: policy_pb2_grpc.PolicyServiceStub, revision: int, timeout: float) -> policy_pb2.WaitForRevisionResponse:
    req = policy_pb2.WaitForRevisionRequest(revision=revision, timeout_seconds=timeout)
    resp: policy_pb2.WaitForRevisionResponse = call("policy", stub.WaitForRevision, req, timeout=timeout + 10)
    if resp.failed:
        failed = [e for e in resp.behind if e.error]
        lines = "\n".join(
            f"  {e.node}/{e.pod or e.endpoint_id} at revision {e.failed_revision}: {e.error}" for e in failed[:10]
        )
        more = f"\n  and {len(failed) - 10} more" if len(failed) > 10 else ""
        raise CLIError(f"revision {revision} failed to be realized by {len(failed)} endpoint(s):\n{lines}{more}")
    if not resp.realized:
        behind = ", ".join(f"{e.node}/{e.pod or e.endpoint_id} at {e.realized_revision}" for e in resp.behind[:10])
        more = f" and {len(resp.behind) - 10} more" if len(resp.behind) > 10 else ""
        raise CLIError(f"revision {revision} not realized after {timeout:g}s; behind: {behind}{more}")
    return resp


@run
def cmd_wait(args: argparse.Namespace) -> int:
    with channel(args, "policy") as ch, progress(f"waiting for revision {args.revision}"):
        resp = _wait(policy_pb2_grpc.PolicyServiceStub(ch), args.revision, args.timeout)
    if args.output == "json":
        print_json(to_dict(resp))
    else:
        print(f"revision {args.revision} realized (current {resp.current_revision})")
    return 0


def _peer(text: str) -> policy_pb2.TracePeer:
    if "=" in text or text.startswith(("k8s:", "reserved:", "any:")):
        return policy_pb2.TracePeer(labels=[label for label in text.split(",") if label])
    if "/" not in text:
        raise CLIError(f"peer {text!r}: give a pod as NAMESPACE/NAME or labels as key=value[,key=value]", 2)
    return policy_pb2.TracePeer(pod=text)


@run
def cmd_trace(args: argparse.Namespace) -> int:
    proto = PROTOCOLS.get(args.protocol.lower())
    if proto is None:
        raise CLIError(f"unknown protocol {args.protocol!r}; use TCP, UDP, SCTP, ICMP or ANY", 2)
    given = [
        flag
        for flag, value in (("--dst", args.dst), ("--to-fqdn", args.to_fqdn), ("--dns-query", args.dns_query))
        if value
    ]
    if len(given) != 1:
        raise CLIError(
            "give one of --dst (a pod or labels), --to-fqdn NAME=IP (a name and an address it resolved to) "
            "or --dns-query NAME" + (f", not {' and '.join(given)}" if given else ""),
            2,
        )
    req = policy_pb2.TraceRequest(source=_peer(args.src), port=args.port, protocol=proto)
    if args.dst:
        req.destination.CopyFrom(_peer(args.dst))
    elif args.to_fqdn:
        name, sep, address = args.to_fqdn.partition("=")
        if not sep or not name or not address:
            raise CLIError(f"--to-fqdn {args.to_fqdn!r}: write NAME=IP, e.g. api.example.test=192.0.2.10", 2)
        req.fqdn, req.address = name, address
    else:
        req.dns_query = args.dns_query
    with channel(args, "policy") as ch:
        resp = call("policy", policy_pb2_grpc.PolicyServiceStub(ch).Trace, req)
    if args.output == "json":
        print_json(to_dict(resp))
    else:
        # The explanation ends with the final verdict, in the words of its per-direction lines.
        print(resp.explanation.rstrip())
    return 0 if resp.verdict == common_pb2.VERDICT_ALLOW else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("policy", help="import, inspect and trace policies")
    psub = p.add_subparsers(dest="policy_command", metavar="COMMAND", required=True)

    imp = psub.add_parser(
        "import", help="import policies from YAML/JSON files or folders (like `cilium policy import`)"
    )
    imp.add_argument("file", nargs="+", help="file, folder or - for stdin")
    imp.add_argument(
        "--dry-run",
        action="store_true",
        help="validate only, and tell the revision the import would make (the current one if it changes nothing)",
    )
    imp.add_argument("--wait", action="store_true", help="wait until the new revision is realized")
    imp.add_argument("--timeout", type=float, default=60.0, help="seconds to wait with --wait")
    imp.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds to wait for each file's answer (default: 30 plus 30 per MB of the file)",
    )
    imp.set_defaults(func=cmd_import)

    def ref_args(q: argparse.ArgumentParser, optional_name: bool = False) -> None:
        q.add_argument(
            "kind",
            help="networkpolicy|cnp|ccnp" if not optional_name else "networkpolicy|cnp|ccnp (omit to list)",
            nargs="?" if optional_name else None,
            default="cnp",
        )
        q.add_argument("name", nargs="?" if optional_name else None, default="")
        q.add_argument(
            "-n",
            "--namespace",
            default=None if optional_name else "default",
            help="namespace of the policy (listing: only this namespace)",
        )
        q.add_argument(
            "--source",
            choices=sorted(SOURCES),
            default=None if optional_name else "api",
            help="which copy (imported or from Kubernetes)"
            + (": default the imported one if there is one, else Kubernetes'" if optional_name else ""),
        )

    dele = psub.add_parser("delete", help="delete an imported policy")
    ref_args(dele)
    dele.set_defaults(func=cmd_delete)

    get = psub.add_parser("get", help="show a policy's status, or list all")
    ref_args(get, optional_name=True)
    get.set_defaults(func=cmd_get)

    wait = psub.add_parser("wait", help="wait until every affected endpoint realized a revision")
    wait.add_argument("revision", type=int)
    wait.add_argument("--timeout", type=float, default=60.0)
    wait.set_defaults(func=cmd_wait)

    trace = psub.add_parser("trace", help="explain the verdict for a connection, like `cilium policy trace`")
    trace.add_argument(
        "--src", required=True, help="NAMESPACE/POD or labels k8s:app=a,k8s:io.kubernetes.pod.namespace=x"
    )
    trace.add_argument("--dst", help="NAMESPACE/POD or labels")
    trace.add_argument(
        "--to-fqdn",
        metavar="NAME=IP",
        help=(
            "instead of --dst: a connection to IP, an address an answer for the DNS name NAME gave; the "
            "source's toFQDNs rules (on --port) and DNS rules (may it resolve NAME) take part"
        ),
    )
    trace.add_argument(
        "--dns-query",
        metavar="NAME",
        help=(
            "instead of --dst: may the source resolve NAME? allowed (exit 0) or refused by its node's DNS "
            "proxy (exit 1), naming the DNS rules; a pod without DNS rules is not filtered"
        ),
    )
    trace.add_argument("--port", type=int, default=0, help="destination port")
    trace.add_argument("--protocol", default="TCP", help="TCP, UDP, SCTP, ICMP or ANY")
    trace.set_defaults(func=cmd_trace)

    for q in (imp, dele, get, wait, trace):
        add_address_flags(q, "policy")
        add_output_flag(q)
    diff.register(psub)
