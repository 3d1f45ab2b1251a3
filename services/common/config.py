"""Typed service configuration from command-line flags and PALISADE_* environment variables.

Each service declares one frozen dataclass (subclassing :class:`CommonConfig`); every
field carries its help text in ``metadata["help"]``. :func:`load_config` is the only
place that reads flags or the environment: logic receives the dataclass.
Precedence: flag > environment variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from services.common.trust import Credentials

ENV_PREFIX = "PALISADE_"


class ConfigError(ValueError):
    """A flag or environment variable has a value that cannot be used."""


def setting(text: str, **kw: Any) -> Any:
    return dataclasses.field(metadata={"help": text}, **kw)


# Default ports per service; tests and `make run` pass their own.
DEFAULT_GRPC_PORTS = {"watcher": 9401, "policy": 9402, "ipam": 9403, "datapath": 9404}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommonConfig:
    """Settings every service has."""

    nats_url: str = setting("NATS server URL(s), comma-separated.", default="nats://127.0.0.1:4222")
    etcd_endpoints: str = setting(
        "etcd endpoint(s) host:port, comma-separated (only services that use etcd).",
        default="127.0.0.1:2379",
    )
    grpc_listen: str = setting("gRPC listen address host:port (port 0 picks a free one).", default="")
    metrics_listen: str = setting(
        "Prometheus metrics listen address host:port; empty disables, port 0 picks one.",
        default="",
    )
    connect_retries: int = setting("Attempts to reach NATS/etcd at startup before giving up.", default=10)
    connect_backoff: float = setting(
        "Initial backoff between startup attempts, seconds (doubles, max 5s).", default=0.2
    )
    shutdown_grace: float = setting("Seconds in-flight gRPC calls get to finish on SIGTERM.", default=5.0)
    log_level: str = setting("Log level: debug, info, warning, error.", default="info")
    log_format: str = setting("Log format: json or text.", default="json")
    node_name: str = setting("Name of the node this process runs for.", default="dev-node")
    tls_dir: str = setting(
        "Directory with the installation's ca.crt and this component's <name>.crt/<name>.key "
        "(mutual TLS for gRPC, NATS and etcd; `palisade tls init` creates them).",
        default="/etc/palisade/tls",
    )
    insecure: bool = setting(
        "Run without TLS or NATS users (development and benchmarks only; anyone who reaches a port owns it).",
        default=False,
    )

    def credentials(self, name: str) -> Credentials | None:
        """This component's certificate, or None when running --insecure; TrustError when missing."""
        return None if self.insecure else Credentials.load(self.tls_dir, name)

    def nats_servers(self) -> list[str]:
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    def etcd_endpoint_list(self) -> list[tuple[str, int]]:
        out = []
        for ep in self.etcd_endpoints.split(","):
            ep = ep.strip().removeprefix("http://")
            if not ep:
                continue
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"etcd endpoint {ep!r} is not host:port; fix --etcd-endpoints")
            out.append((host, int(port)))
        return out


C = TypeVar("C", bound=CommonConfig)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _convert(hint: Any, raw: str, where: str) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"expected true/false, got {raw!r}")
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if origin is tuple or hint is tuple:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        return raw
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def build_parser(config_type: type[CommonConfig], prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(config_type.__doc__ or "").strip())
    for f in dataclasses.fields(config_type):
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} (env {_env(f.name)}; default {default!r})"
        if f.type in (bool, "bool"):
            # A switch: `--insecure` alone means true; `--insecure false` is still accepted.
            parser.add_argument(_flag(f.name), dest=f.name, default=None, nargs="?", const="true", help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, metavar=f.name.upper(), help=help_text)
    return parser


def load_config(
    config_type: type[C],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str = "palisade",
) -> C:
    """Parse flags and environment into ``config_type``; raise ConfigError on bad values."""
    env = os.environ if env is None else env
    parser = build_parser(config_type, prog)
    ns = parser.parse_args(list(argv) if argv is not None else None)
    hints = typing.get_type_hints(config_type)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config_type):
        raw = getattr(ns, f.name)
        where = _flag(f.name)
        if raw is None and _env(f.name) in env:
            raw, where = env[_env(f.name)], _env(f.name)
        if raw is not None:
            values[f.name] = _convert(hints[f.name], raw, where)
    try:
        cfg = config_type(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg
