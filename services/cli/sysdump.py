"""`palisade sysdump`: one archive to attach to a bug report, as `cilium sysdump` makes.

It holds, each as its own file under ``palisade-sysdump-<time>/``:

- ``versions.json``: the CLI's and every component's version;
- ``status.json``: every service's health, sync state, revision and figures, the members;
- ``policies.json``, ``identities.json``, ``allocations.json``: the policy revisions and
  states (invalid ones with their errors), the identities, the IP allocations;
- ``nodes/<node>/``: each node's datapath status, endpoints, Service frontends, a summary
  of every endpoint's policy map (revision, enforcement, entries by verdict), and what its DNS
  proxy learned (``fqdn.json``: every name and address with its identity, TTL left and
  endpoints, and the toFQDNs selectors with the identities each holds);
- ``logs/``: the recent lines of every service's log (``make run``'s log folder, or
  ``--logs-dir``; on a cluster ``kubectl logs`` of every Palisade pod);
- ``config/``: the configuration: the local Palisade processes' flags and ``PALISADE_*``
  settings, and on a cluster the Palisade objects (never Secrets);
- ``errors.json``: every part that could not be collected, and why.

Run with kubectl reaching the cluster, it also runs ``palisade sysdump --json`` in every
datapath pod (``kubectl exec``, as `cilium sysdump` does): each pod's CLI reaches its node's
datapath on the node socket and the control plane through the Services, so every node's parts
are collected, and the cluster-wide ones this machine could not reach itself.

No private key goes in: Secrets are never read, settings whose names say key, secret, token
or password are replaced by ``[redacted]``, and any PEM private key block found in any file
is replaced before it is written.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from palisade.v1 import (
    common_pb2,
    common_pb2_grpc,
    datapath_pb2,
    datapath_pb2_grpc,
    identity_pb2,
    identity_pb2_grpc,
    ipam_pb2,
    ipam_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from services.cli import version
from services.cli.client import (
    RUN_ADDRESSES,
    SERVICES,
    CLIError,
    add_address_flags,
    address,
    call,
    channel,
    credentials,
    node_channels,
    run,
    to_dict,
)
from services.cli.status import probe

NAMESPACE = "palisade-system"
LOG_LINES = 2000
REDACTED = "[redacted]"
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL)
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` without PEM private key blocks."""
    return _PRIVATE_KEY.sub(REDACTED, text)


class Archive:
    """The files of one sysdump, written into a tar.gz at the end."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.files: dict[str, bytes] = {}
        self.errors: dict[str, str] = {}

    def add(self, name: str, data: Any) -> None:
        text = data if isinstance(data, str) else json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
        self.files[name] = redact(text).encode()

    def part(self, name: str, collect: Callable[[], Any]) -> Any:
        """Run one collection; its failure is recorded under ``name`` and the rest goes on."""
        try:
            data = collect()
        except CLIError as exc:
            self.errors[name] = str(exc)
            return None
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            return None
        if data is not None:
            self.add(name, data)
        return data

    def write(self, path: Path) -> None:
        self.add("errors.json", self.errors)
        with tarfile.open(path, "w:gz") as tar:
            for name, data in sorted(self.files.items()):
                info = tarfile.TarInfo(f"{self.root}/{name}")
                info.size = len(data)
                info.mtime = int(time.time())
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------------------
# the parts


def _status(args: argparse.Namespace) -> dict[str, Any]:
    creds = credentials(args)
    rows = []
    for name in SERVICES:
        for target in (t.strip() for t in address(args, name).split(",")):
            health, status = probe(target, name, creds)
            rows.append({"service": name, "address": target, "health": health,
                         "status": to_dict(status) if status is not None else None})  # fmt: skip
    return {"services": rows}


def _policies(args: argparse.Namespace) -> dict[str, Any]:
    with channel(args, "policy") as ch:
        return to_dict(
            call("policy", policy_pb2_grpc.PolicyServiceStub(ch).ListPolicies, policy_pb2.ListPoliciesRequest())
        )


def _identities(args: argparse.Namespace) -> dict[str, Any]:
    with channel(args, "ipam") as ch:
        stub = identity_pb2_grpc.IdentityServiceStub(ch)
        return to_dict(call("ipam", stub.ListIdentities, identity_pb2.ListIdentitiesRequest(include_reserved=True)))


def _allocations(args: argparse.Namespace) -> dict[str, Any]:
    with channel(args, "ipam") as ch:
        stub = ipam_pb2_grpc.IPAMServiceStub(ch)
        return to_dict(call("ipam", stub.ListAllocations, ipam_pb2.ListAllocationsRequest()))


def _map_summary(stub: datapath_pb2_grpc.DatapathServiceStub, endpoint: datapath_pb2.Endpoint) -> dict[str, Any]:
    req = datapath_pb2.GetPolicyMapRequest(endpoint=datapath_pb2.GetEndpointRequest(id=endpoint.id))
    resp = call("datapath", stub.GetPolicyMap, req)
    verdicts: dict[str, int] = {}
    for entry in to_dict(resp).get("entries", []):
        verdict = str(entry.get("verdict", "allow"))
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    return {
        "endpoint": endpoint.id,
        "pod": f"{endpoint.namespace}/{endpoint.pod}",
        "identity": resp.identity,
        "revision": resp.revision,
        "enforcement": to_dict(resp.enforcement),
        "entries": len(resp.entries),
        "entries_by_verdict": verdicts,
    }


def _node_status(ch: Any) -> dict[str, Any]:
    return to_dict(call("datapath", common_pb2_grpc.StatusServiceStub(ch).GetStatus, common_pb2.GetStatusRequest()))


def _node_services(stub: datapath_pb2_grpc.DatapathServiceStub) -> dict[str, Any]:
    return to_dict(call("datapath", stub.ListServices, datapath_pb2.ListServicesRequest()))


def _node_names(stub: datapath_pb2_grpc.DatapathServiceStub) -> dict[str, Any]:
    return {
        "cache": to_dict(call("datapath", stub.ListFqdnCache, datapath_pb2.ListFqdnCacheRequest())),
        "selectors": to_dict(call("datapath", stub.ListFqdnSelectors, datapath_pb2.ListFqdnSelectorsRequest())),
    }


def _node_maps(stub: datapath_pb2_grpc.DatapathServiceStub, listed: Any) -> list[dict[str, Any]]:
    return [_map_summary(stub, ep) for ep in listed.endpoints]


def _nodes(args: argparse.Namespace, archive: Archive) -> None:
    with node_channels(args) as channels:
        for node, ch in sorted(channels.items()):
            where = f"nodes/{node or 'unnamed'}"
            stub = datapath_pb2_grpc.DatapathServiceStub(ch)
            archive.part(f"{where}/status.json", functools.partial(_node_status, ch))
            archive.part(f"{where}/services.json", functools.partial(_node_services, stub))
            archive.part(f"{where}/fqdn.json", functools.partial(_node_names, stub))
            try:
                listed = call("datapath", stub.ListEndpoints, datapath_pb2.ListEndpointsRequest())
            except CLIError as exc:
                archive.errors[f"{where}/endpoints.json"] = str(exc)
                continue
            archive.add(f"{where}/endpoints.json", to_dict(listed))
            archive.part(f"{where}/maps.json", functools.partial(_node_maps, stub, listed))


def _log_dir(args: argparse.Namespace) -> Path | None:
    if args.logs_dir:
        return Path(args.logs_dir)
    default = RUN_ADDRESSES.parent / "logs"
    return default if default.is_dir() else None


def _tail(path: Path, lines: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 400 * lines))
        data = f.read().decode(errors="replace")
    return "\n".join(data.splitlines()[-lines:]) + "\n"


def _local_processes() -> list[dict[str, Any]]:
    """This machine's Palisade processes: their flags and PALISADE_* settings (secrets redacted)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "-m" not in args or not any(a.startswith("services.") for a in args):
            continue
        settings = {}
        for item in environ:
            name, _, value = item.decode(errors="replace").partition("=")
            if name.startswith("PALISADE_"):
                settings[name] = REDACTED if _SECRET_NAME.search(name) else value
        out.append({"pid": int(entry), "argv": args, "settings": settings})
    return sorted(out, key=lambda p: p["pid"])


def _kubectl(args: argparse.Namespace, *kubectl_args: str) -> str:
    result = subprocess.run([args.kubectl, "--request-timeout=10s", *kubectl_args],
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    if result.returncode != 0:
        raise CLIError(f"kubectl {' '.join(kubectl_args)}: {result.stderr.strip()}")
    return result.stdout


def _cluster(args: argparse.Namespace, archive: Archive) -> None:
    if shutil.which(args.kubectl) is None:
        archive.errors["cluster"] = f"{args.kubectl} not found: cluster objects and pod logs not collected"
        return
    kinds = "daemonsets,deployments,statefulsets,pods,services,endpointslices,configmaps,networkpolicies"
    if archive.part("config/cluster-objects.yaml", lambda: _kubectl(args, "-n", NAMESPACE, "get", kinds, "-o", "yaml")):
        archive.part("config/nodes.yaml", lambda: _kubectl(args, "get", "nodes", "-o", "yaml"))
        archive.part("config/cilium-policies.yaml", lambda: _kubectl(
            args, "get", "ciliumnetworkpolicies,ciliumclusterwidenetworkpolicies", "-A", "-o", "yaml"))  # fmt: skip
        pods = _kubectl(args, "-n", NAMESPACE, "get", "pods", "-o", "name").split()
        for pod in pods:
            logs = ("-n", NAMESPACE, "logs", pod, "--all-containers", "--prefix", f"--tail={LOG_LINES}")
            archive.part(f"logs/{pod.rpartition('/')[2]}.log", functools.partial(_kubectl, args, *logs))
        datapaths = [p for p in pods if p.rpartition("/")[2].startswith("palisade-datapath-")]
        for pod in datapaths:
            _from_datapath_pod(args, archive, pod)


def _better(local: bytes | None, theirs: str) -> bool:
    """Whether a datapath pod's copy of a cluster-wide part should replace this machine's: when
    this machine has none, or reached fewer components (the pod reaches them all)."""
    if local is None:
        return True
    gaps = (b"unreachable", b"not asked")
    return any(g in local for g in gaps) and not any(g.decode() in theirs for g in gaps)


def _from_datapath_pod(args: argparse.Namespace, archive: Archive, pod: str) -> None:
    """What the CLI in one datapath pod collects (its node through the node socket, the control
    plane through the Services), merged in: every node's parts, and the cluster-wide ones this
    machine could not reach itself."""
    name = pod.rpartition("/")[2]
    command = ("-n", NAMESPACE, "exec", pod, "-c", "datapath", "--", "palisade", "sysdump", "--no-cluster", "--json")
    try:
        found = json.loads(_kubectl(args, *command))
    except (CLIError, ValueError, subprocess.SubprocessError) as exc:
        archive.errors[f"pods/{name}"] = f"palisade sysdump in the pod: {exc}"
        return
    for part, text in found["files"].items():
        if part.startswith("nodes/") or ("/" not in part and _better(archive.files.get(part), text)):
            archive.add(part, text)
            archive.errors.pop(part, None)
        elif part == "config/processes.json":
            archive.add(f"config/processes-{name}.json", text)
    if any(part.startswith("nodes/") for part in archive.files):
        archive.errors.pop("nodes", None)  # this machine could not reach the nodes; the pods did
    for part, error in found["errors"].items():
        if part not in archive.files:
            archive.errors.setdefault(f"pods/{name}/{part}", error)


def collect(args: argparse.Namespace) -> Archive:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    archive = Archive(f"palisade-sysdump-{stamp}")
    archive.part("versions.json", lambda: [asdict(v) for v in version.collect(args)])
    archive.part("status.json", lambda: _status(args))
    archive.part("policies.json", lambda: _policies(args))
    archive.part("identities.json", lambda: _identities(args))
    archive.part("allocations.json", lambda: _allocations(args))
    try:
        _nodes(args, archive)
    except CLIError as exc:
        archive.errors["nodes"] = str(exc)
    logs = _log_dir(args)
    if logs is not None:
        for path in sorted(logs.glob("*.log")):
            archive.part(f"logs/{path.name}", functools.partial(_tail, path, LOG_LINES))
    archive.part("config/processes.json", _local_processes)
    if not args.no_cluster:
        _cluster(args, archive)
    archive.add(
        "README.txt",
        f"Palisade sysdump, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.\n"
        "Parts that could not be collected are listed in errors.json. No private key is included.\n",
    )
    return archive


@run
def cmd_sysdump(args: argparse.Namespace) -> int:
    archive = collect(args)
    if args.json:
        files = {name: data.decode() for name, data in archive.files.items() if name != "README.txt"}
        print(json.dumps({"files": files, "errors": archive.errors}))
        return 0
    path = Path(args.output_file or f"{archive.root}.tar.gz")
    archive.write(path)
    print(f"wrote {path} ({len(archive.files)} files)")
    for part, error in sorted(archive.errors.items()):
        print(f"  not collected: {part}: {error}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sysdump", help="write one archive of everything a bug report needs (no keys)")
    p.add_argument("--output-file", default="", metavar="FILE", help="default palisade-sysdump-<time>.tar.gz")
    p.add_argument("--logs-dir", default="", help="the services' log folder (default: `make run`'s, if any)")
    p.add_argument("--kubectl", default="kubectl", help="for a cluster's objects and pod logs")
    p.add_argument("--no-cluster", action="store_true", help="do not ask kubectl (not on a cluster)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the collected files as one JSON object instead (what a sysdump run with kubectl asks of the "
        "CLI in every datapath pod, for every node's parts)",
    )
    add_address_flags(p)
    p.set_defaults(func=cmd_sysdump)
