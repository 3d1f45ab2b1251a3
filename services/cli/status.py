"""`palisade status`: each service's health, revision, synced state and figures."""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from palisade.v1 import common_pb2, common_pb2_grpc, policy_pb2, policy_pb2_grpc
from services.cli.client import (
    SERVICES,
    add_address_flags,
    add_output_flag,
    address,
    credentials,
    print_json,
    print_table,
    run,
    to_dict,
)
from services.common.grpcserver import open_sync_channel
from services.common.trust import Credentials

#: How long a service has to complete the connection (TCP and TLS) before it is shown unreachable.
CONNECT_TIMEOUT = 1.5
UNREACHABLE = "unreachable"


def probe(target: str, service: str, creds: Credentials | None) -> tuple[str, common_pb2.ServiceStatus | None]:
    ch = open_sync_channel(target, service, creds)
    try:
        try:
            grpc.channel_ready_future(ch).result(timeout=CONNECT_TIMEOUT)
        except grpc.FutureTimeoutError:
            return UNREACHABLE, None
        try:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            state = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
        except grpc.RpcError as err:
            state = f"error: {err.code().name}"
        try:
            status = common_pb2_grpc.StatusServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=3)
        except grpc.RpcError:
            status = None
        return state, status
    finally:
        ch.close()


def _invalid_policies(target: str, creds: Credentials | None) -> list[policy_pb2.PolicyStatus]:
    """The policies whose latest version the policy service at ``target`` rejected."""
    ch = open_sync_channel(target, "policy", creds)
    try:
        listing = policy_pb2_grpc.PolicyServiceStub(ch).ListPolicies(policy_pb2.ListPoliciesRequest(), timeout=5)
    except grpc.RpcError:
        return []
    finally:
        ch.close()
    return [p for p in listing.policies if p.state == policy_pb2.POLICY_STATE_REJECTED]


def _invalid_text(p: policy_pb2.PolicyStatus) -> str:
    ref = f"{p.ref.kind} {p.ref.namespace + '/' if p.ref.namespace else ''}{p.ref.name}"
    kept = f"the version of revision {p.revision} stays enforced" if p.revision else "not enforced"
    return f"{ref} ({kept}): {p.error}"


@run
def cmd_status(args: argparse.Namespace) -> int:
    results = []
    creds = credentials(args)
    for name in SERVICES:
        # Each replica on its own: a list of addresses is a service's replicas.
        for target in address(args, name).split(","):
            state, status = probe(target.strip(), name, creds)
            results.append((name, target.strip(), state, status))
    members = _members(results)
    # Policies whose latest version was refused (a typo, a wrong type): asked of one replica.
    invalid: list[policy_pb2.PolicyStatus] = []
    for name, target, _, status in results:
        if name == "policy" and status is not None and status.details.get("rejected", "0") != "0":
            invalid = _invalid_policies(target, creds)
            break
    if args.output == "json":
        out = []
        for name, target, state, status in results:
            item: dict[str, object] = {"service": name, "address": target, "health": state}
            if status is not None:
                item.update(
                    synced=status.synced,
                    revision=status.revision,
                    node=status.node,
                    version=status.version,
                    role=status.details.get("role", ""),
                    details=dict(status.details),
                )
            out.append(item)
        print_json(
            {
                "services": out,
                "members": [to_dict(m) for m in members],
                "invalid_policies": [
                    {"ref": to_dict(p.ref), "error": p.error, "enforced_revision": p.revision} for p in invalid
                ],
            }
        )
    else:
        rows: list[tuple[object, ...]] = []
        for name, target, state, status in results:
            if status is None:
                rows.append((name, target, state, "", "", "", "", ""))
                continue
            details = " ".join(f"{k}={v}" for k, v in sorted(status.details.items()) if k not in ("role", "leader"))
            role = status.details.get("role", "")
            rows.append((name, target, state, role, status.synced, status.revision or "", status.node, details))
        print_table(("SERVICE", "ADDRESS", "HEALTH", "ROLE", "SYNCED", "REVISION", "NODE", "DETAILS"), rows)
        if members:
            print()
            print_table(
                ("MEMBER", "GROUP", "ADDRESS", "ROLE", "HEALTH"),
                [(m.name, m.group, m.address, m.role, m.health) for m in members],
            )
        if invalid:
            print(f"\n{len(invalid)} invalid policies (their latest version is refused):")
            for p in invalid:
                print(f"  {_invalid_text(p)}")
        down = [f"{n} at {t}" for n, t, s, _ in results if s == UNREACHABLE]
        if down and len(down) == len(results):
            print(f"\n{', '.join(down)} unreachable: start the system with `make run`, or pass --<service>-address.")
        elif down:
            print(
                f"\nno answer within {CONNECT_TIMEOUT:g}s from {', '.join(down)}, while other parts answer: "
                "stopped, frozen or overloaded (see their logs)?"
            )
        for name, _, _, status in results:
            for dependency, problem in sorted(_dependencies_down(status).items()):
                print(
                    f"\n{name}: {dependency} {problem}; it answers from what it knows, but changes do not flow "
                    "until it is back"
                )
    healthy = all(s == "SERVING" for _, _, s, _ in results) and all(m.health == "ok" for m in members)
    return 0 if healthy and not any(_dependencies_down(status) for *_, status in results) else 1


def _members(results: list[tuple[str, str, str, common_pb2.ServiceStatus | None]]) -> list[common_pb2.Member]:
    """Every member the services report (policy replicas, NATS servers, etcd members), once each.

    Where services disagree (one saw a member go), the worse health is shown. A replica that did
    not answer here is shown unreachable, whatever the others last heard from it; if none of them
    lists it, it gets a row of its own (named by its address) in its service's group.
    """
    seen: dict[tuple[str, str], common_pb2.Member] = {}
    for *_, status in results:
        for member in status.members if status is not None else ():
            key = (member.group, member.name)
            if key not in seen or (seen[key].health == "ok" and member.health != "ok"):
                seen[key] = member
    groups = {group for group, _ in seen}
    for service, target, state, _ in results:
        if state != UNREACHABLE or service not in groups:
            continue
        health = f"{UNREACHABLE}: no answer within {CONNECT_TIMEOUT:g}s"
        listed = [m for m in seen.values() if m.group == service and m.address == target]
        for member in listed:
            detail = "" if member.health == "ok" else f" ({member.health})"
            member.health = health + detail
        if not listed:
            seen[(service, target)] = common_pb2.Member(group=service, name=target, address=target, health=health)
    return [seen[k] for k in sorted(seen)]


def _dependencies_down(status: common_pb2.ServiceStatus | None) -> dict[str, str]:
    """Dependencies a service reports down (``details`` entries such as ``bus=down: ...``)."""
    if status is None:
        return {}
    return {k: v for k, v in status.details.items() if v.startswith("down")}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="health, revision and sync state of every service")
    add_address_flags(p)
    add_output_flag(p)
    p.set_defaults(func=cmd_status)
