"""Who may call which gRPC method: the caller's certificate name against one table.

Every TCP gRPC port is mutual TLS (:mod:`services.common.trust`), so a caller has proved
a name from the installation's CA; this table says what that name may do. A method not
in the table is refused (fail closed). The datapath's unix socket is root-only
(0600, like Cilium's agent socket), so a local caller there is trusted as root and
needs no certificate: that is how the CNI plugin and the node's CLI reach it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

#: Any caller with a certificate from the installation's CA.
ANYONE = frozenset({"*"})

_CLI = frozenset({"cli"})
_DATAPATH = frozenset({"datapath"})
_NODE = frozenset({"cli", "devnode"})
_POLICY = frozenset({"policy"})

#: Full method name (or service name, for all its methods) -> certificate names allowed.
RULES: dict[str, frozenset[str]] = {
    "grpc.health.v1.Health": ANYONE,
    "grpc.reflection.v1alpha.ServerReflection": ANYONE,
    "palisade.v1.StatusService": ANYONE,
    # The policy service: edits and reads from operators, the realization loop from datapaths.
    # A follower replica forwards every call to the leader under its own name ("policy").
    "palisade.v1.PolicyService/ImportPolicies": _CLI | _POLICY,
    "palisade.v1.PolicyService/DeletePolicy": _CLI | _POLICY,
    # Reads also by a node's datapath certificate: `palisade policy get` run in the datapath's
    # container (kubectl exec) speaks with it; the node enforces those policies anyway.
    "palisade.v1.PolicyService/GetPolicy": _CLI | _DATAPATH | _POLICY,
    "palisade.v1.PolicyService/ListPolicies": _CLI | _DATAPATH | _POLICY,
    "palisade.v1.PolicyService/Trace": _CLI | _POLICY,
    "palisade.v1.PolicyService/Diff": _CLI | _POLICY,
    "palisade.v1.PolicyService/WaitForRevision": _CLI | _DATAPATH | _POLICY,
    "palisade.v1.PolicyService/Resync": _DATAPATH | _POLICY,
    "palisade.v1.PolicyService/ReportRealized": _DATAPATH | _POLICY,
    # ipam: allocation by datapaths (they make endpoints) and by the policy service (the CIDR
    # identities of the prefixes policies name, and only those: ipam checks), reads by operators too.
    "palisade.v1.IdentityService/AllocateIdentity": _DATAPATH | _POLICY,
    "palisade.v1.IdentityService/ReleaseIdentity": _DATAPATH | _POLICY,
    "palisade.v1.IdentityService/ResolvePod": _DATAPATH,
    "palisade.v1.IdentityService/GetIdentity": _CLI | _DATAPATH | _POLICY,
    "palisade.v1.IdentityService/ListIdentities": _CLI | _DATAPATH | _POLICY,
    "palisade.v1.IPAMService/AllocateIP": _DATAPATH,
    "palisade.v1.IPAMService/ReleaseIP": _DATAPATH,
    "palisade.v1.IPAMService/GetNodeCIDR": _CLI | _DATAPATH,
    "palisade.v1.IPAMService/ListAllocations": _CLI | _DATAPATH,
    # The datapath over the network: operators and the dev node's kubelet stand-in only;
    # the CNI plugin uses the root-only unix socket.
    "palisade.v1.DatapathService": _NODE,
}


def allowed(method: str) -> frozenset[str]:
    """The certificate names that may call ``method`` (``/pkg.Service/Method``); empty: nobody."""
    name = method.lstrip("/")
    if name in RULES:
        return RULES[name]
    return RULES.get(name.partition("/")[0], frozenset())


def may_call(peer: str, method: str) -> bool:
    names = allowed(method)
    return "*" in names or peer in names


#: The caller of the call being handled, as the access check found it (each call runs in a task of
#: its own, so the value is the call's): servicers asking again need not read the TLS state again.
_CALLER: contextvars.ContextVar[tuple[object, str | None]] = contextvars.ContextVar("palisade_caller")


def caller(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's certificate name; "" for a local (unix socket) caller; None without either."""
    known = _CALLER.get(None)
    if known is not None and known[0] is context:
        return known[1]
    if context.peer().startswith("unix:"):
        who: str | None = ""
    else:
        names = context.auth_context().get("x509_common_name") or []
        who = names[0].decode() if names else None
    _CALLER.set((context, who))
    return who


Behavior = Callable[..., Any]


def _guard(method: str, behavior: Behavior) -> Behavior:
    async def check(context: grpc.aio.ServicerContext) -> None:
        who = caller(context)
        if who == "":
            return
        if who is None or not may_call(who, method):
            allowed_names = ", ".join(sorted(allowed(method))) or "nobody"
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: the caller {who or '(no certificate)'} may not call this; it is for {allowed_names} "
                "(use that component's certificate, or the CLI's)",
            )

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            async for item in behavior(request, context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary


class AccessInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses, with PERMISSION_DENIED, every call the table does not allow the caller."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        return self.wrap(details.method, await continuation(details))

    def wrap(self, method: str, handler: grpc.RpcMethodHandler | None) -> Any:
        """``handler`` of ``method`` with the access check in front of its behavior."""
        return wrap_handler(handler, lambda behavior: _guard(method, behavior))


def wrap_handler(handler: grpc.RpcMethodHandler | None, wrap: Callable[[Behavior], Behavior]) -> Any:
    """``handler`` with its behavior (unary or streaming, whichever it has) passed through ``wrap``."""
    if handler is None:
        return handler
    for field in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, field)
        if behavior is not None:
            return handler._replace(**{field: wrap(behavior)})
    return handler


# --- The bus -----------------------------------------------------------------------------
# NATS maps each client certificate to the user of the same name (verify_and_map); a
# user publishes only the subjects it owns and consumes only the streams it reads.
# JetStream consumption goes through the consumer API and the client's own inbox, so
# "reads" grants consumer and message-get calls per stream, and subscriptions only on
# the client's inbox prefix (INBOX_PREFIX + name).

#: Streams and buckets (stream names of key-value buckets start KV_, of object stores OBJ_).
K8S, IDENTITY, IPCACHE, REGEN = "PALISADE_K8S", "PALISADE_IDENTITY", "PALISADE_IPCACHE", "PALISADE_REGEN"
LARGE_OBJECTS = "PALISADE_K8S_OBJECTS"
POLICY_STATE = "PALISADE_POLICY"
POLICY_LEADER = "PALISADE_POLICY_LEADER"
POLICY_API = "PALISADE_POLICY_API"
INBOX_PREFIX = "_INBOX_"


@dataclasses.dataclass(frozen=True)
class BusRole:
    """What one component does on the bus."""

    publishes: tuple[str, ...] = ()
    #: Streams it creates or updates at start (each service provisions what it uses).
    provisions: tuple[str, ...] = ()
    #: Streams it consumes (consumers, message gets).
    reads: tuple[str, ...] = ()
    #: Object-store streams it owns, whose old chunks it purges.
    purges: tuple[str, ...] = ()
    #: Core subjects it subscribes to besides its own inbox (none of Palisade's components do).
    subscribes: tuple[str, ...] = ()


BUS_ROLES: dict[str, BusRole] = {
    # The ipcache: a dev cluster's watcher keeps EndpointSlices from the pods' addresses.
    "watcher": BusRole(
        publishes=("palisade.k8s.>", f"$O.{LARGE_OBJECTS}.>"),
        provisions=(K8S, f"OBJ_{LARGE_OBJECTS}", IPCACHE),
        reads=(K8S, f"OBJ_{LARGE_OBJECTS}", IPCACHE),
        purges=(f"OBJ_{LARGE_OBJECTS}",),
    ),
    "ipam": BusRole(
        publishes=("palisade.identity.>", "palisade.ipcache.>"),
        provisions=(K8S, IDENTITY, IPCACHE),
        reads=(K8S, f"OBJ_{LARGE_OBJECTS}", IDENTITY, IPCACHE),
    ),
    "policy": BusRole(
        publishes=("palisade.regen.>", f"$KV.{POLICY_STATE}.>", f"$KV.{POLICY_LEADER}.>", f"$O.{POLICY_API}.>"),
        provisions=(K8S, IDENTITY, IPCACHE, REGEN, f"KV_{POLICY_STATE}", f"KV_{POLICY_LEADER}", f"OBJ_{POLICY_API}"),
        reads=(
            K8S,
            f"OBJ_{LARGE_OBJECTS}",
            IDENTITY,
            IPCACHE,
            REGEN,
            f"KV_{POLICY_STATE}",
            f"KV_{POLICY_LEADER}",
            f"OBJ_{POLICY_API}",
        ),
        purges=(f"OBJ_{POLICY_API}",),
    ),
    # Services and EndpointSlices come from the k8s stream (the datapath load-balances them).
    "datapath": BusRole(
        provisions=(K8S, REGEN, IPCACHE), reads=(K8S, f"OBJ_{LARGE_OBJECTS}", REGEN, IPCACHE, IDENTITY)
    ),
    "devnode": BusRole(reads=(K8S, f"OBJ_{LARGE_OBJECTS}")),
}


def bus_permissions(name: str, role: BusRole) -> dict[str, dict[str, list[str]]]:
    """The nats-server ``permissions`` block of one user."""
    api = "$JS.API"
    publish = [*role.publishes, f"{api}.INFO", f"{api}.STREAM.NAMES", f"{api}.STREAM.LIST"]
    for stream in role.provisions:
        publish += [f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.UPDATE.{stream}"]
    for stream in role.reads:
        publish += [
            f"{api}.STREAM.INFO.{stream}",
            f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>",
            f"{api}.CONSUMER.CREATE.{stream}",
            f"{api}.CONSUMER.CREATE.{stream}.>",
            f"{api}.CONSUMER.DELETE.{stream}.>",
            f"{api}.CONSUMER.INFO.{stream}.>",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.ACK.{stream}.>",
            f"$JS.FC.{stream}.>",
        ]
    for stream in role.purges:
        publish.append(f"{api}.STREAM.PURGE.{stream}")
    return {
        "publish": {"allow": sorted(set(publish))},
        "subscribe": {"allow": [f"{INBOX_PREFIX}{name}.>", *role.subscribes]},
    }
