"""The network configuration is checked before the plugin acts: required keys, types, misspellings (code 7)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from services.cni import plugin, spec

GOOD: dict[str, Any] = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "palisade"}
REMOVE = object()


def config(**changes: Any) -> str:
    data = {**GOOD, **changes}
    return json.dumps({k: v for k, v in data.items() if v is not REMOVE})


def test_a_good_configuration_is_read() -> None:
    conf = spec.parse_config(config(socket="/run/x.sock", timeout=3, runtimeConfig={"portMappings": []}), "ADD")
    assert (conf.name, conf.socket, conf.timeout, conf.version) == ("k8s-pod-network", "/run/x.sock", 3.0, "1.0.0")


def test_version_needs_only_cni_version() -> None:
    assert spec.parse_config(json.dumps({"cniVersion": "1.0.0"}), "VERSION").version == "1.0.0"


@pytest.mark.parametrize("command", ["ADD", "DEL", "CHECK"])
@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"name": REMOVE}, "name", "name is missing"),
        ({"type": REMOVE}, "type", "type is missing"),
        ({"cniVersion": REMOVE}, "cniVersion", "cniVersion is missing"),
        ({"name": 5}, "name", "name must be a string, not int"),
        ({"name": "-bad name"}, "name", "is not a network name"),
        ({"socket": 7}, "socket", "socket must be a string"),
        ({"socket": "relative.sock"}, "socket", "not an absolute path"),
        ({"timeout": "10"}, "timeout", "timeout must be a number, not str"),
        ({"timeout": True}, "timeout", "timeout must be a number, not bool"),
        ({"timeout": 0}, "timeout", "(0, 300]"),
        ({"prevResult": []}, "prevResult", "prevResult must be an object, not list"),
        ({"runtimeConfig": "x"}, "runtimeConfig", "runtimeConfig must be an object"),
        ({"disableCheck": "yes"}, "disableCheck", "disableCheck must be true or false"),
        ({"sockett": "/x.sock"}, "sockett", "did you mean 'socket'?"),
        ({"timout": 3}, "timout", "did you mean 'timeout'?"),
    ],
)
def test_an_invalid_configuration_is_code_7_naming_the_field(
    command: str, changes: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(spec.CniError) as err:
        spec.parse_config(config(**changes), command)
    assert err.value.code == spec.INVALID_CONFIG
    text = f"{err.value.msg} {err.value.details}"
    assert field in text and words in text, text


def test_an_error_object_is_in_the_configurations_version() -> None:
    """Whatever the error (the configuration's own, or the environment's), where the configuration
    gives a version this plugin speaks; else the plugin's current one."""
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/x", "CNI_IFNAME": "eth0",
           "CNI_PATH": "/opt/cni/bin", "CNI_ARGS": "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p"}  # fmt: skip
    cases = [
        ("0.4.0", env, spec.INVALID_CONFIG, "0.4.0"),
        ("1.0.0", env, spec.INVALID_CONFIG, "1.0.0"),
        ("9.9.9", env, spec.INCOMPATIBLE_VERSION, spec.CURRENT_VERSION),
        ("0.4.0", {k: v for k, v in env.items() if k != "CNI_ARGS"}, 4, "0.4.0"),
    ]
    for version, environment, code, answered in cases:
        out = io.StringIO()
        stdin = json.dumps({"cniVersion": version, "name": "n", "type": "palisade", "timeout": -1}).encode()
        assert plugin.run(environment, stdin, out) == 1
        error = json.loads(out.getvalue())
        assert (error["code"], error["cniVersion"]) == (code, answered), error


def test_keys_of_runtimes_and_other_plugins_are_left_alone() -> None:
    conf = spec.parse_config(config(**{"cni.dev/valid-attachments": [], "mtu": 1450, "capabilities": {}}), "ADD")
    assert conf.raw["mtu"] == 1450
