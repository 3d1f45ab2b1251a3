"""The nats-server configuration Palisade runs with: JetStream, TLS, one user per component.

Rendered as JSON, which nats-server reads as its configuration format. Used by `make run`,
the test fixtures and the deploy manifests' checks, so every NATS runs with the same
users and permissions (:data:`services.common.access.BUS_ROLES`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from services.common.access import BUS_ROLES, BusRole, bus_permissions
from services.common.trust import Credentials


def render(
    *,
    listen: str,
    store_dir: str,
    tls: Credentials | None,
    http: str = "",
    roles: Mapping[str, BusRole] = BUS_ROLES,
) -> str:
    """A nats-server configuration; ``tls`` is the server's own credentials (None: no TLS, no users)."""
    config: dict[str, object] = {"listen": listen, "jetstream": {"store_dir": store_dir}}
    if http:
        config["http"] = http
    if tls is not None:
        config["tls"] = {
            "cert_file": str(tls.cert_file),
            "key_file": str(tls.key_file),
            "ca_file": str(tls.ca_file),
            # The client certificate's name is the user: no passwords to hand around.
            "verify_and_map": True,
            "timeout": 5,
        }
        config["authorization"] = {
            "users": [
                {"user": name, "permissions": bus_permissions(name, role)} for name, role in sorted(roles.items())
            ]
        }
    return json.dumps(config, indent=2) + "\n"


def write(path: Path, **kw: object) -> Path:
    path.write_text(render(**kw))  # type: ignore[arg-type]
    return path
