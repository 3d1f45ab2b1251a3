"""Loading the deploy/ files, and the checks that tie them to the code.

A deployment is consistent with the code when every Palisade container runs
``python -m services.<name>`` for a real service and sets only ``PALISADE_*``
variables that the service's config dataclass declares, with values it accepts.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from services.common.config import DEFAULT_GRPC_PORTS, ENV_PREFIX, CommonConfig, ConfigError, load_config
from testkit.harness import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
KUBERNETES_DIR = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"

# The four services; each has a gRPC port of its own.
SERVICES = frozenset(DEFAULT_GRPC_PORTS)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def config_class(service: str) -> type[CommonConfig]:
    """The one CommonConfig subclass that ``services.<service>.config`` declares."""
    module = importlib.import_module(f"services.{service}.config")
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, CommonConfig)
        and obj is not CommonConfig
        and obj.__module__ == module.__name__
    ]
    assert len(found) == 1, f"services.{service}.config should declare one config dataclass, found {found}"
    return found[0]


def env_names(config: type[CommonConfig]) -> set[str]:
    return {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(config)}


def service_of_command(command: Sequence[str]) -> str:
    """The service a container runs; fails unless the command is ``python -m services.<name>``."""
    assert len(command) == 3 and command[:2] == ["python", "-m"], (
        f"command {command!r} is not `python -m services.<name>`"
    )
    package, _, name = command[2].partition(".")
    assert package == "services" and name in SERVICES, f"{command[2]!r} is not one of services.{sorted(SERVICES)}"
    assert importlib.util.find_spec(f"services.{name}.__main__") is not None, f"services.{name} has no __main__"
    return name


#: Sample values of the pod fields the manifests pass through the downward API.
POD_FIELDS = {"POD_NAME": "palisade-policy-5d8c7b9f4-x2k8q", "POD_IP": "10.244.1.7", "HOST_IP": "10.0.0.5"}
_POD_FIELD = re.compile(r"\$\((\w+)\)")


def check_container_config(where: str, command: Sequence[str], env: Mapping[str, str]) -> tuple[str, CommonConfig]:
    """Check one Palisade container; return its service and the config it would run with.

    The values must convert to the fields' types and pass the config's own validation,
    except for checks of paths that exist only inside the container.
    """
    name = service_of_command(command)
    config = config_class(name)
    palisade_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    unknown = set(palisade_env) - env_names(config)
    assert not unknown, f"{where}: {sorted(unknown)} match no field of {config.__name__}: {sorted(env_names(config))}"
    etcd_set = "PALISADE_ETCD_ENDPOINTS" in palisade_env
    assert etcd_set == uses_etcd(name), (
        f"{where}: services.{name} {'uses' if uses_etcd(name) else 'does not use'} etcd; "
        f"PALISADE_ETCD_ENDPOINTS is {'set' if etcd_set else 'not set'}"
    )
    # Convert without the config's validate() first: some checks look at paths that
    # exist only inside the container.
    unvalidated: type[CommonConfig] = type(config.__name__, (config,), {"validate": lambda self: None})
    try:
        loaded = load_config(unvalidated, argv=[], env=palisade_env)
    except ConfigError as exc:
        raise AssertionError(f"{where}: services.{name} rejects its environment: {exc}") from None
    validate = getattr(config, "validate", None)
    try:
        if callable(validate):
            # What kubelet substitutes for $(VAR) references to the pod's fields.
            expanded = {k: _POD_FIELD.sub(lambda m: POD_FIELDS.get(m[1], m[0]), v) for k, v in palisade_env.items()}
            validate(load_config(unvalidated, argv=[], env=expanded))
    except ConfigError as exc:
        container_paths = [v for v in palisade_env.values() if v.startswith("/") and v in str(exc)]
        if not container_paths or any(Path(p).exists() for p in container_paths):
            raise AssertionError(f"{where}: services.{name} rejects its environment: {exc}") from None
    return name, loaded


#: Settings naming a gRPC peer: checked per service by :func:`upstreams` (a host-network container
#: reaches a peer at another address than a container on the compose network does).
PEER_ADDRESSES = ("policy_address", "ipam_address")


def disagreements(configs: Mapping[str, CommonConfig]) -> list[str]:
    """Settings that several services declare (beyond the common ones and peer addresses) but set differently."""
    common = {f.name for f in dataclasses.fields(CommonConfig)} | set(PEER_ADDRESSES)
    values: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        for f in dataclasses.fields(config):
            if f.name not in common:
                values.setdefault(f.name, {})[name] = getattr(config, f.name)
    return [f"{field}: {by}" for field, by in values.items() if len(by) > 1 and len(set(by.values())) > 1]


def port_of(address: str) -> int:
    """The port of ``host:port`` (or a URL ending in it)."""
    return int(address.rpartition(":")[2])


def host_of(address: str) -> str:
    return address.split("://")[-1].rpartition(":")[0]


@dataclasses.dataclass(frozen=True)
class Upstream:
    """An address a service is configured to reach: which setting, host and port."""

    setting: str
    host: str
    port: int


def uses_etcd(service: str) -> bool:
    """Whether the service connects to etcd (through its ServiceContext, the one way to)."""
    return any("ctx.etcd()" in p.read_text() for p in (ROOT / "services" / service).rglob("*.py"))


def upstreams(name: str, config: CommonConfig) -> Iterator[Upstream]:
    """The addresses ``name`` connects to with ``config``: NATS, etcd where used, and gRPC peers."""
    for url in config.nats_servers():
        yield Upstream("nats_url", host_of(url), port_of(url))
    if uses_etcd(name):
        for host, port in config.etcd_endpoint_list():
            yield Upstream("etcd_endpoints", host, port)
    for setting in PEER_ADDRESSES:
        address = getattr(config, setting, None)
        if address is not None:
            yield Upstream(setting, host_of(address), port_of(address))


_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def resolve_default(value: str) -> str:
    """A compose value with ``${VAR:-default}`` resolved to its default (what runs with VAR unset)."""
    return _VARIABLE.sub(lambda m: m.group(2) or "", value)


def image_of(svc: Mapping[str, Any]) -> str:
    """A compose service's image as it runs with nothing set on the host."""
    return resolve_default(str(svc.get("image", "")))


def compose_mounts(svc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Bind mounts by target, in long syntax (short ``SOURCE:TARGET[:OPTIONS]`` ones translated)."""
    out = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, dict) and vol.get("type") == "bind":
            out[vol["target"]] = vol
        elif isinstance(vol, str) and vol.startswith(("/", "./", "../")):
            source, target, *options = vol.split(":")
            opts = ",".join(options).split(",")
            mount: dict[str, Any] = {"type": "bind", "source": source, "target": target, "read_only": "ro" in opts}
            propagation = [o for o in opts if o in ("rshared", "shared", "rslave", "slave", "rprivate", "private")]
            if propagation:
                mount["bind"] = {"propagation": propagation[0]}
            out[target] = mount
    return out


#: The node's DNS proxy: a process beside the datapath (its own container), not one of the services.
DNS_PROXY = ["python", "-m", "services.datapath.dnsproxyd"]


def check_dns_proxy(where: str, env: Mapping[str, str], datapath_env: Mapping[str, str]) -> None:
    """The proxy's environment is its settings and names the datapath's pins and state folder."""
    from services.datapath.dnsproxyd import DnsProxyDaemonConfig

    palisade_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    unknown = set(palisade_env) - env_names(DnsProxyDaemonConfig)
    assert not unknown, f"{where}: {sorted(unknown)} are no settings of the DNS proxy"
    config = load_config(DnsProxyDaemonConfig, argv=[], env=palisade_env)
    for name in ("PALISADE_STATE_DIR", "PALISADE_BPFFS"):
        assert env.get(name) == datapath_env.get(name), f"{where}: {name} differs from the datapath's"
    assert config.state_dir and config.bpffs
