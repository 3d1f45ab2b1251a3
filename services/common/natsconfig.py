"""The nats-server configuration Palisade runs with: JetStream, TLS, one user per component.

Rendered as JSON, which nats-server reads as its configuration format. Used by `make run`,
the test fixtures and the deploy manifests' checks, so every NATS runs with the same
users and permissions (:data:`services.common.access.BUS_ROLES`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from services.common.access import BUS_ROLES, BusRole, bus_permissions
from services.common.trust import Credentials


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This server's place in a cluster: its name, its route listener, and every member's.

    A ``server_name`` starting with ``$`` is an environment variable nats-server reads at
    start (one configuration for every member of a StatefulSet).
    """

    server_name: str
    listen: str
    routes: tuple[str, ...]
    name: str = "palisade"


def _tls(tls: Credentials, **checks: bool) -> dict[str, object]:
    files = {"cert_file": str(tls.cert_file), "key_file": str(tls.key_file), "ca_file": str(tls.ca_file)}
    return {**files, **checks, "timeout": 5}


def render(
    *,
    listen: str,
    store_dir: str,
    tls: Credentials | None,
    http: str = "",
    roles: Mapping[str, BusRole] = BUS_ROLES,
    cluster: Cluster | None = None,
) -> str:
    """A nats-server configuration; ``tls`` is the server's own credentials (None: no TLS, no users).

    With ``cluster`` the server joins the others over routes (TLS both ways, each side
    proving it is ``nats``) and JetStream replicates across them.
    """
    config: dict[str, object] = {"listen": listen, "jetstream": {"store_dir": store_dir}}
    if http:
        config["http"] = http
    if cluster is not None:
        scheme = "nats-route" if tls is None else "tls"
        routes: dict[str, object] = {
            "name": cluster.name,
            "listen": cluster.listen,
            "routes": [f"{scheme}://{r}" for r in cluster.routes if r != cluster.listen],
        }
        if tls is not None:
            routes["tls"] = _tls(tls, verify=True)  # each side proves it is nats
        config["server_name"] = cluster.server_name
        config["cluster"] = routes
    if tls is not None:
        # The client certificate's name is the user: no passwords to hand around.
        config["tls"] = _tls(tls, verify_and_map=True)
        config["authorization"] = {
            "users": [
                {"user": name, "permissions": bus_permissions(name, role)} for name, role in sorted(roles.items())
            ]
        }
    text = json.dumps(config, indent=2) + "\n"
    variables = [listen] + ([cluster.server_name, cluster.listen] if cluster is not None else [])
    for value in variables:
        if value.startswith("$"):  # an environment variable of the server's, unquoted
            text = text.replace(json.dumps(value), value)
    return text


#: The cluster of deploy/kubernetes/nats.yaml: three members of a StatefulSet behind its headless Service.
KUBERNETES_CLUSTER = Cluster(
    server_name="$POD_NAME",
    # On the node's network: the node's own address (the pod's environment sets it), not every interface.
    listen="$NATS_CLUSTER_LISTEN",
    routes=tuple(f"palisade-nats-{i}.palisade-nats-headless.palisade-system.svc:6222" for i in range(3)),
)


def write(path: Path, **kw: object) -> Path:
    path.write_text(render(**kw))  # type: ignore[arg-type]
    return path


def main(argv: list[str] | None = None) -> int:
    """Print the configuration (deploy/kubernetes/nats-config.yaml and deploy/compose/nats.conf)."""
    parser = argparse.ArgumentParser(prog="python -m services.common.natsconfig", description=main.__doc__)
    parser.add_argument("--listen", default="0.0.0.0:4222")
    parser.add_argument("--store-dir", default="/data")
    parser.add_argument("--tls-dir", default="/etc/palisade/tls", help="where the nats certificate is mounted")
    parser.add_argument("--http", default="0.0.0.0:8222", help="monitoring address (health probes)")
    parser.add_argument(
        "--kubernetes-cluster", action="store_true", help="the three-member cluster of deploy/kubernetes"
    )
    args = parser.parse_args(argv)
    tls = Credentials("nats", Path(args.tls_dir))
    cluster = KUBERNETES_CLUSTER if args.kubernetes_cluster else None
    sys.stdout.write(render(listen=args.listen, store_dir=args.store_dir, tls=tls, http=args.http, cluster=cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
