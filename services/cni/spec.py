"""The CNI specification as the plugin speaks it: versions, errors, network configuration, results.

Pure: environment and stdin in, a configuration or a :class:`CniError` out; results are
rendered for the version the runtime asked for (1.x without per-IP ``version``, 0.3/0.4
with it). Codes are the specification's well-known ones.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
#: What the plugin answers VERSION with and renders results in by default.
CURRENT_VERSION = "1.1.0"
DEFAULT_SOCKET = "/var/run/palisade/datapath/cni.sock"
#: The plugin's own endpoint (JSON lines; services/datapath/pluginapi.py), beside ``socket``.
PLUGIN_SOCKET = "plugin.sock"


def plugin_socket(node_socket: str) -> str:
    """Where the datapath answers the plugin, given the node socket the configuration names."""
    return os.path.join(os.path.dirname(node_socket), PLUGIN_SOCKET)


DEFAULT_TIMEOUT = 10.0
COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC")

# Well-known error codes (CNI spec, "Error"), and the plugin's own from 100 on.
INCOMPATIBLE_VERSION = 1
UNSUPPORTED_FIELD = 2
CONTAINER_UNKNOWN = 3
INVALID_ENVIRONMENT = 4
IO_FAILURE = 5
DECODE_FAILURE = 6
INVALID_CONFIG = 7
TRY_AGAIN_LATER = 11
NOT_AVAILABLE = 50
ENDPOINT_MISMATCH = 100
DATAPATH_ERROR = 101

_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


class CniError(Exception):
    """An error the runtime gets as the specification's error object."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def to_json(self, version: str) -> dict[str, Any]:
        out: dict[str, Any] = {"cniVersion": version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out


@dataclass(frozen=True)
class Environment:
    """The CNI_* variables of one call."""

    command: str
    container_id: str = ""
    netns: str = ""
    ifname: str = ""
    args: Mapping[str, str] = field(default_factory=dict)
    path: str = ""

    @property
    def pod(self) -> tuple[str, str]:
        return self.args.get("K8S_POD_NAMESPACE", ""), self.args.get("K8S_POD_NAME", "")


@dataclass(frozen=True)
class NetConf:
    """The network configuration of this plugin (one entry of a conflist, as the runtime passes it)."""

    version: str
    name: str
    socket: str
    timeout: float
    prev_result: Mapping[str, Any] | None
    raw: Mapping[str, Any]

    @property
    def chained(self) -> bool:
        return bool(self.prev_result and self.prev_result.get("interfaces"))


def parse_environment(env: Mapping[str, str]) -> Environment:
    command = env.get("CNI_COMMAND", "")
    if command not in COMMANDS:
        raise CniError(
            INVALID_ENVIRONMENT,
            f"CNI_COMMAND {command!r} is not one of {', '.join(COMMANDS)}",
            "palisade-cni is run by a container runtime with the CNI environment set",
        )
    args: dict[str, str] = {}
    for pair in filter(None, env.get("CNI_ARGS", "").split(";")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise CniError(INVALID_ENVIRONMENT, f"CNI_ARGS entry {pair!r} is not KEY=VALUE")
        args[key] = value
    out = Environment(
        command,
        container_id=env.get("CNI_CONTAINERID", ""),
        netns=env.get("CNI_NETNS", ""),
        ifname=env.get("CNI_IFNAME", ""),
        args=args,
        path=env.get("CNI_PATH", ""),
    )
    if command in ("ADD", "DEL", "CHECK"):
        if not out.container_id or not _CONTAINER_ID.fullmatch(out.container_id):
            raise CniError(
                INVALID_ENVIRONMENT,
                f"CNI_CONTAINERID {out.container_id!r} is missing or invalid",
                "letters, digits, '_', '.' and '-', starting with a letter or digit",
            )
        if not out.ifname and command != "DEL":
            raise CniError(INVALID_ENVIRONMENT, "CNI_IFNAME is missing", "the runtime names the pod's interface")
    if command in ("ADD", "CHECK"):
        if not out.netns:
            raise CniError(
                INVALID_ENVIRONMENT, "CNI_NETNS is missing", "ADD and CHECK need the pod's network namespace"
            )
        namespace, pod = out.pod
        if not namespace or not pod:
            raise CniError(
                INVALID_ENVIRONMENT,
                "CNI_ARGS must carry K8S_POD_NAMESPACE and K8S_POD_NAME",
                "Palisade gives a pod its identity from the Kubernetes pod; the kubelet's runtime passes these",
            )
    return out


#: CNI's network name rule (spec: "Network configuration format", ``name``).
_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")

#: Keys of the configuration whose type the plugin checks: the specification's own and this
#: plugin's (``socket``, ``timeout``). Other keys belong to runtimes or to other plugins.
_KEY_TYPES: dict[str, tuple[type, ...]] = {
    "cniVersion": (str,),
    "name": (str,),
    "type": (str,),
    "socket": (str,),
    "timeout": (int, float),
    "prevResult": (dict,),
    "args": (dict,),
    "capabilities": (dict,),
    "runtimeConfig": (dict,),
    "ipam": (dict,),
    "dns": (dict,),
    "disableCheck": (bool,),
    "disableGC": (bool,),
}
_OWN_KEYS = ("socket", "timeout")
_TYPE_NAMES = {str: "a string", int: "a number", float: "a number", dict: "an object", bool: "true or false"}


def _check_keys(data: Mapping[str, Any]) -> None:
    """Types of the known keys, and a key that looks like a misspelling of one of them (code 7)."""
    for key, value in data.items():
        kinds = _KEY_TYPES.get(key)
        if kinds is None:
            import difflib  # only for a mistyped key: every plugin call pays for imports

            close = difflib.get_close_matches(key, list(_KEY_TYPES), n=1, cutoff=0.8)
            if close:
                raise CniError(
                    INVALID_CONFIG,
                    f"unknown key {key!r} in the network configuration; did you mean {close[0]!r}?",
                )
            continue
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise CniError(INVALID_CONFIG, f"{key} must be {_TYPE_NAMES[kinds[0]]}, not {type(value).__name__}")


def parse_config(stdin: bytes | str, command: str) -> NetConf:
    """The network configuration; a :class:`CniError` naming the field when it is invalid.

    ``cniVersion``, ``name`` and ``type`` are required (VERSION needs only ``cniVersion``);
    the specification's keys and this plugin's own are type-checked before anything is done.
    """
    try:
        data = json.loads(stdin)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CniError(DECODE_FAILURE, "the network configuration on stdin is not JSON", str(exc)) from None
    if not isinstance(data, dict):
        raise CniError(DECODE_FAILURE, "the network configuration on stdin is not a JSON object")
    version = data.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(INVALID_CONFIG, "cniVersion is missing from the network configuration")
    if version not in SUPPORTED_VERSIONS and command != "VERSION":
        raise CniError(
            INCOMPATIBLE_VERSION,
            f"cniVersion {version} is not supported",
            f"supported: {', '.join(SUPPORTED_VERSIONS)}",
        )
    if command in ("STATUS", "GC") and _older(version, "1.1.0"):
        raise CniError(
            INCOMPATIBLE_VERSION, f"{command} needs cniVersion 1.1.0 or later, the configuration has {version}"
        )
    if command == "VERSION":
        return NetConf(version, str(data.get("name", "")), DEFAULT_SOCKET, DEFAULT_TIMEOUT, None, data)
    if "type" not in data:
        raise CniError(INVALID_CONFIG, 'type is missing from the network configuration; it is "palisade"')
    plugin_type = data.get("type")
    if plugin_type != "palisade":
        raise CniError(INVALID_CONFIG, f'type is {plugin_type!r}; this plugin is type "palisade"')
    if "name" not in data:
        raise CniError(
            INVALID_CONFIG,
            "name is missing from the network configuration",
            'every network configuration names its network, e.g. "name": "k8s-pod-network"',
        )
    _check_keys(data)
    name = data["name"]
    if not _NAME.fullmatch(name):
        raise CniError(
            INVALID_CONFIG,
            f"name {name!r} is not a network name",
            "letters, digits, '_', '.' and '-', starting with a letter or a digit",
        )
    socket = data.get("socket", DEFAULT_SOCKET)
    if not socket.startswith("/"):
        raise CniError(INVALID_CONFIG, f"socket {socket!r} is not an absolute path to the datapath's unix socket")
    timeout = data.get("timeout", DEFAULT_TIMEOUT)
    if not 0 < timeout <= 300:
        raise CniError(INVALID_CONFIG, f"timeout {timeout!r} is not a number of seconds in (0, 300]")
    return NetConf(version, name, socket, float(timeout), data.get("prevResult"), data)


def _older(version: str, than: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split(".") if p.isdigit())

    return parts(version) < parts(than)


@dataclass(frozen=True)
class PrevNetwork:
    """What a previous plugin's result says about the pod (chained mode)."""

    host_ifname: str
    ips: tuple[str, ...]


def read_prev_result(prev: Mapping[str, Any], netns: str) -> PrevNetwork:
    """The host-side interface and the pod's addresses from ``prevResult``."""
    interfaces = prev.get("interfaces") or []
    if not isinstance(interfaces, list):
        raise CniError(INVALID_CONFIG, "prevResult.interfaces is not a list")
    host = [i for i in interfaces if isinstance(i, dict) and not i.get("sandbox") and i.get("name")]
    if not host:
        raise CniError(
            INVALID_CONFIG,
            "prevResult names no host-side interface",
            "chain Palisade after a plugin that makes a veth pair (ptp, bridge): it attaches to the host end",
        )
    ips: list[str] = []
    for i, entry in enumerate(prev.get("ips") or []):
        try:
            ips.append(str(ipaddress.ip_interface(str(entry["address"])).ip))
        except (KeyError, TypeError, ValueError):
            raise CniError(INVALID_CONFIG, f"prevResult.ips[{i}].address is not an address with a prefix") from None
    if not ips:
        raise CniError(INVALID_CONFIG, "prevResult has no ips", "the previous plugin must address the pod")
    # A bridge result lists the bridge and the veth; the veth is the host interface whose peer is the pod.
    veths = [i for i in host if str(i.get("name", "")).startswith(("veth", "lxc"))] or host
    return PrevNetwork(str(veths[-1]["name"]), tuple(ips))


def render_result(version: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """``result`` (in 1.x form) for the runtime's ``version``: 0.3/0.4 add each IP's version."""
    out = {**result, "cniVersion": version}
    if _older(version, "1.0.0"):
        ips = []
        for entry in result.get("ips", []):
            family = ipaddress.ip_interface(entry["address"]).version
            ips.append({"version": str(family), **{k: v for k, v in entry.items() if k != "version"}})
        out["ips"] = ips
    else:
        out["ips"] = [{k: v for k, v in entry.items() if k != "version"} for entry in result.get("ips", [])]
    return out


def standalone_result(
    *, host_ifname: str, ifname: str, mac: str, netns: str, ips: list[str], gateways: list[str]
) -> dict[str, Any]:
    """The result of a standalone ADD: the host veth, the pod's interface, its /32 (/128) addresses and routes."""
    gateway = {ipaddress.ip_address(g).version: g for g in gateways}
    pod_iface: dict[str, Any] = {"name": ifname, "sandbox": netns}
    if mac:
        pod_iface["mac"] = mac
    entries: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    for ip in ips:
        family = ipaddress.ip_address(ip).version
        entry: dict[str, Any] = {"address": f"{ip}/{32 if family == 4 else 128}", "interface": 1}
        if family in gateway:
            entry["gateway"] = gateway[family]
            dst = "0.0.0.0/0" if family == 4 else "::/0"
            if not any(r["dst"] == dst for r in routes):
                routes.append({"dst": dst, "gw": gateway[family]})
        entries.append(entry)
    return {"interfaces": [{"name": host_ifname}, pod_iface], "ips": entries, "routes": routes, "dns": {}}
