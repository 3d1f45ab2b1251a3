"""`palisade install` and `palisade uninstall`: Palisade on a Kubernetes cluster with one command.

Install renders ``deploy/kubernetes`` (and its CRDs, ``deploy/kubernetes/crds``) for the chosen
mode, the cluster's Service range and image, adds one TLS Secret per component from an
installation directory (made with the CA on first use, kept after: the CA's key never goes to
the cluster), and applies it with kubectl in two steps: the Namespace and CRDs first (a
CiliumClusterwideNetworkPolicy can only be created once its CRD is established), then the
rest. ``--dry-run -o yaml`` prints every object instead (keys included: it is what would be
applied).

Uninstall stops the datapaths, runs ``deploy/kubernetes/uninstall`` (a DaemonSet whose init
container runs ``python -m services.cni.install --uninstall`` on every node: the conflist,
the plugin and its runtime removed, the programs detached and the pinned maps removed), waits
for it on every node, then deletes everything else. The CRDs and with them the users'
CiliumNetworkPolicies stay unless ``--delete-crds``.

The control plane's Services have fixed ClusterIPs in the low band of the Service range that
Kubernetes keeps for static addresses, named in every pod's hostAliases, so the control plane
finds itself before the cluster's DNS runs (deploy/README.md, "Bootstrap"). The manifests carry
them for 10.96.0.0/12 (kubeadm's and kind's range); ``--service-cidr`` moves them.
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import ipaddress
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from services.cli.client import CLIError, run
from services.common.trust import CA_NAME, ensure_pki

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
NAMESPACE = "palisade-system"
DEFAULT_SERVICE_CIDR = "10.96.0.0/12"
MODES = ("standalone", "chained")
#: Components that run in the cluster, each with a Secret of its own key (palisade-tls-<name>).
CLUSTER_COMPONENTS = ("watcher", "policy", "ipam", "datapath", "nats", "etcd")
#: Service -> offset of its fixed ClusterIP in the Service range (the low, static band).
STATIC_SERVICES = {
    "palisade-nats": 200,
    "palisade-nats-0": 201,
    "palisade-nats-1": 202,
    "palisade-nats-2": 203,
    "palisade-etcd": 204,
    "palisade-etcd-0": 205,
    "palisade-etcd-1": 206,
    "palisade-etcd-2": 207,
    "palisade-policy": 208,
    "palisade-ipam": 209,
    "palisade-watcher": 210,
}
CRD_NAMES = ("ciliumnetworkpolicies.cilium.io", "ciliumclusterwidenetworkpolicies.cilium.io")

Obj = dict[str, Any]


def static_cluster_ips(service_cidr: str) -> dict[str, str]:
    """Service -> its fixed ClusterIP in ``service_cidr``; CLIError if the range cannot hold them."""
    try:
        network = ipaddress.ip_network(service_cidr)
    except ValueError as exc:
        raise CLIError(f"--service-cidr {service_cidr!r}: {exc}", 2) from None
    # Kubernetes keeps min(max(16, size/16), 256) addresses at the start for static ClusterIPs.
    band = min(max(16, network.num_addresses // 16), 256)
    if band <= max(STATIC_SERVICES.values()):
        raise CLIError(
            f"--service-cidr {service_cidr}: too small; Palisade's Services take fixed addresses "
            f"{min(STATIC_SERVICES.values())}-{max(STATIC_SERVICES.values())} of the range's static band "
            "(a /20 or larger)",
            2,
        )
    return {name: str(network.network_address + offset) for name, offset in STATIC_SERVICES.items()}


# ---------------------------------------------------------------------------
# rendering (pure: objects in, objects out)


def load_kustomization(directory: Path) -> list[Obj]:
    """The objects a kustomization's ``resources`` list (files only; as `kubectl kustomize` reads them)."""
    path = directory / "kustomization.yaml"
    try:
        kustomization = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc}; point --manifests at deploy/kubernetes", 2) from None
    out: list[Obj] = []
    for resource in kustomization.get("resources", []):
        out += [doc for doc in yaml.safe_load_all((directory / resource).read_text()) if doc]
    return out


def _pod_specs(objects: Iterable[Obj]) -> Iterable[Obj]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield obj["spec"]["template"]["spec"]


def _env(container: Obj, name: str, value: str) -> None:
    for entry in container.setdefault("env", []):
        if entry["name"] == name:
            entry["value"] = value
            entry.pop("valueFrom", None)
            return
    container["env"].append({"name": name, "value": value})


@dataclasses.dataclass(frozen=True)
class InstallOptions:
    """What `palisade install` was asked for."""

    mode: str = "standalone"
    service_cidr: str = DEFAULT_SERVICE_CIDR
    #: Pod CIDRs ipam carves node CIDRs from, for nodes without spec.podCIDRs ("" keeps the manifests').
    cluster_cidrs: str = ""
    #: The Palisade image ("" keeps the manifests').
    image: str = ""
    #: Leave the CRDs out (Cilium's own are installed).
    skip_crds: bool = False


def render(options: InstallOptions, manifests: Path = MANIFESTS) -> tuple[list[Obj], list[Obj]]:
    """(CRDs, everything else) for ``options``: deploy/kubernetes adapted, without the Secrets."""
    if options.mode not in MODES:
        raise CLIError(f"--mode {options.mode!r}: choose one of {', '.join(MODES)}", 2)
    crds = [] if options.skip_crds else load_kustomization(manifests / "crds")
    objects = copy.deepcopy(load_kustomization(manifests))
    moved = {
        old: new
        for name, old in static_cluster_ips(DEFAULT_SERVICE_CIDR).items()
        for new in [static_cluster_ips(options.service_cidr)[name]]
    }
    for obj in objects:
        if obj["kind"] == "Service" and obj["spec"].get("clusterIP") in moved:
            obj["spec"]["clusterIP"] = moved[obj["spec"]["clusterIP"]]
    for pod in _pod_specs(objects):
        for alias in pod.get("hostAliases", []):
            alias["ip"] = moved.get(alias["ip"], alias["ip"])
        for container in pod.get("initContainers", []) + pod["containers"]:
            if options.image and container["image"].partition(":")[0] == "palisade":
                container["image"] = options.image
            if container.get("command") == ["python", "-m", "services.cni.install"]:
                _env(container, "PALISADE_CNI_MODE", options.mode)
            if options.cluster_cidrs and container.get("command") == ["python", "-m", "services.ipam"]:
                _env(container, "PALISADE_CLUSTER_CIDRS", options.cluster_cidrs)
    return crds, objects


def tls_secrets(tls_dir: Path, components: Sequence[str] = CLUSTER_COMPONENTS) -> list[Obj]:
    """One Secret per component: the CA's certificate, the component's certificate and key."""
    ensure_pki(tls_dir)
    out = []
    for name in components:
        files = {"ca.crt": tls_dir / f"{CA_NAME}.crt", f"{name}.crt": tls_dir / f"{name}.crt"}
        files[f"{name}.key"] = tls_dir / f"{name}.key"
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": f"palisade-tls-{name}",
                    "namespace": NAMESPACE,
                    "labels": {"app.kubernetes.io/name": f"palisade-{name}", "app.kubernetes.io/part-of": "palisade"},
                },
                "type": "Opaque",
                "data": {key: base64.b64encode(path.read_bytes()).decode() for key, path in files.items()},
            }
        )
    return out


def install_objects(options: InstallOptions, tls_dir: Path, manifests: Path = MANIFESTS) -> list[list[Obj]]:
    """The objects to apply, in steps: the Namespace and CRDs, then the Secrets and the rest."""
    crds, objects = render(options, manifests)
    namespace = [o for o in objects if o["kind"] == "Namespace"]
    rest = [o for o in objects if o["kind"] != "Namespace"]
    return [namespace + crds, tls_secrets(tls_dir) + rest]


def to_yaml(objects: Iterable[Obj]) -> str:
    return "".join("---\n" + yaml.safe_dump(obj, sort_keys=False) for obj in objects)


# ---------------------------------------------------------------------------
# talking to the cluster


@dataclasses.dataclass(frozen=True)
class Step:
    """One kubectl call: what it does, its arguments, and the objects it reads on stdin."""

    what: str
    args: tuple[str, ...]
    objects: tuple[Obj, ...] = ()


def install_steps(steps: list[list[Obj]], wait: bool) -> list[Step]:
    out = [
        Step(
            "the namespace and the CRDs",
            ("apply", "--server-side", "--field-manager=palisade", "-f", "-"),
            tuple(steps[0]),
        ),
    ]
    crds = [o["metadata"]["name"] for o in steps[0] if o["kind"] == "CustomResourceDefinition"]
    if crds:
        out.append(
            Step(
                "the CRDs established",
                ("wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in crds)),
            )
        )
    out.append(
        Step(
            "the TLS Secrets and the components",
            ("apply", "--server-side", "--field-manager=palisade", "--force-conflicts", "-f", "-"),
            tuple(steps[1]),
        )
    )
    if wait:
        out.append(
            Step(
                "the datapath on every node",
                ("-n", NAMESPACE, "rollout", "status", "daemonset/palisade-datapath", "--timeout=10m"),
            )
        )
    return out


def uninstall_steps(manifests: Path, delete_crds: bool) -> list[Step]:
    cleanup = load_kustomization(manifests / "uninstall")
    objects = load_kustomization(manifests)
    # The namespace last: deleting it takes everything left in it.
    keep_order = [o for o in objects if o["kind"] != "Namespace"] + [o for o in objects if o["kind"] == "Namespace"]
    steps = [
        Step(
            "stop the datapaths",
            ("-n", NAMESPACE, "delete", "daemonset/palisade-datapath", "--ignore-not-found", "--wait=true"),
        ),
        Step("the node cleanup on every node", ("apply", "-f", "-"), tuple(cleanup)),
        Step(
            "the node cleanup done on every node",
            ("-n", NAMESPACE, "rollout", "status", "daemonset/palisade-node-cleanup", "--timeout=10m"),
        ),
        Step("everything else", ("delete", "--ignore-not-found", "--wait=true", "-f", "-"), tuple(keep_order)),
    ]
    if delete_crds:
        steps.append(
            Step(
                "the CRDs, and every CiliumNetworkPolicy with them",
                ("delete", "--ignore-not-found", *(f"crd/{n}" for n in CRD_NAMES)),
            )
        )
    return steps


def _kubectl(args: argparse.Namespace) -> list[str]:
    found = shutil.which(args.kubectl)
    if found is None:
        raise CLIError(f"{args.kubectl} not found: install kubectl, or give its path with --kubectl", 2)
    return [found] + ([f"--context={args.context}"] if args.context else [])


def _run_steps(args: argparse.Namespace, steps: Sequence[Step]) -> None:
    kubectl = _kubectl(args)
    for step in steps:
        print(f"palisade: {step.what}: kubectl {' '.join(step.args)}", file=sys.stderr)
        result = subprocess.run(
            [*kubectl, *step.args], input=to_yaml(step.objects) if step.objects else "", text=True, check=False
        )
        if result.returncode != 0:
            raise CLIError(f"kubectl {' '.join(step.args)} failed ({step.what}); see its message above")


def _print_plan(steps: Sequence[Step], output: str) -> None:
    if output == "yaml":
        sys.stdout.write(to_yaml(o for step in steps for o in step.objects))
        return
    for n, step in enumerate(steps, 1):
        names = ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in step.objects)
        print(f"{n}. {step.what}: kubectl {' '.join(step.args)}" + (f"\n   {names}" if names else ""))


@run
def cmd_install(args: argparse.Namespace) -> int:
    options = InstallOptions(
        mode=args.mode,
        service_cidr=args.service_cidr,
        cluster_cidrs=args.cluster_cidrs,
        image=args.image,
        skip_crds=args.skip_crds,
    )
    steps = install_steps(install_objects(options, Path(args.tls_dir), Path(args.manifests)), wait=args.wait)
    if args.dry_run:
        _print_plan(steps, args.output)
        return 0
    _run_steps(args, steps)
    print(f"Palisade installed ({options.mode}); the CA and the CLI's certificate are in {args.tls_dir}")
    return 0


@run
def cmd_uninstall(args: argparse.Namespace) -> int:
    steps = uninstall_steps(Path(args.manifests), args.delete_crds)
    if args.dry_run:
        _print_plan(steps, args.output)
        return 0
    _run_steps(args, steps)
    kept = "" if args.delete_crds else "; the CRDs and your CiliumNetworkPolicies are kept (--delete-crds removes them)"
    print(f"Palisade uninstalled: its plugin and programs are off every node{kept}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--manifests", default=str(MANIFESTS), help=f"deploy/kubernetes of this release (default {MANIFESTS})"
    )
    p.add_argument("--kubectl", default="kubectl", help="the kubectl to run (default: kubectl on PATH)")
    p.add_argument("--context", default="", help="the kubeconfig context (default: the current one)")
    p.add_argument("--dry-run", action="store_true", help="print what would be done instead of doing it")
    p.add_argument(
        "-o",
        "--output",
        choices=("plan", "yaml"),
        default="plan",
        help="with --dry-run: the kubectl steps (plan) or every object they apply (yaml)",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "install",
        help="install Palisade on the current Kubernetes cluster (kubectl)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="standalone",
        help="standalone: Palisade is the network plugin; chained: after the cluster's plugin (kindnet, flannel)",
    )
    p.add_argument(
        "--service-cidr",
        default=DEFAULT_SERVICE_CIDR,
        help=f"the cluster's Service range, where the control plane's fixed ClusterIPs go "
        f"(default {DEFAULT_SERVICE_CIDR}: kubeadm, kind; k3s: 10.43.0.0/16)",
    )
    p.add_argument(
        "--cluster-cidrs", default="", help="pod CIDRs for nodes without spec.podCIDRs (default 10.244.0.0/16)"
    )
    p.add_argument("--image", default="", help="the Palisade image (default palisade:0.1.0, as the manifests say)")
    p.add_argument("--skip-crds", action="store_true", help="leave the CRDs out (Cilium's own are installed)")
    p.add_argument(
        "--tls-dir",
        default="palisade-tls",
        help="the installation's CA and certificates: made on first install, reused after; keep it "
        "(the CLI's certificate is there)",
    )
    p.add_argument("--wait", action="store_true", help="wait until the datapath runs on every node")
    _common(p)
    p.set_defaults(func=cmd_install)

    u = sub.add_parser(
        "uninstall",
        help="remove Palisade from the cluster and its plugin from every node",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    u.add_argument(
        "--delete-crds", action="store_true", help="also delete the CRDs, and with them every CiliumNetworkPolicy"
    )
    _common(u)
    u.set_defaults(func=cmd_uninstall)
