"""deploy/compose: valid against the Compose specification, and consistent with the code.

The PyPI ``docker-compose`` (v1) cannot be installed next to PyYAML 6, so the file is
validated against the Compose specification's JSON schema as vendored by
``check-jsonschema``; a Compose v2 CLI on PATH, when there is one, also renders it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.common import natsconfig
from services.common.config import DEFAULT_GRPC_PORTS
from services.common.trust import Credentials
from services.datapath.config import DatapathConfig
from services.datapath.netns import NETNS_DIR
from testkit.harness import ROOT
from tests.deploy.manifests import (
    COMPOSE_FILE,
    DNS_PROXY,
    SERVICES,
    Upstream,
    check_container_config,
    check_dns_proxy,
    compose_mounts,
    disagreements,
    image_of,
    load_yaml,
    port_of,
    resolve_default,
    upstreams,
)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = load_yaml(COMPOSE_FILE)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def _palisade(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The Palisade services, by service name (the compose service names are the same)."""
    return {
        name: svc
        for name, svc in services.items()
        if image_of(svc).startswith("palisade:")
        and svc["command"][:2] == ["python", "-m"]
        and svc["command"][2].removeprefix("services.") in SERVICES
    }


def _env(svc: dict[str, Any]) -> dict[str, str]:
    """The service's environment as it runs with nothing set on the host (``${VAR:-default}`` resolved)."""
    return {str(k): resolve_default(str(v)) for k, v in (svc.get("environment") or {}).items()}


def _check_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_matches_the_compose_specification() -> None:
    result = _check_schema(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validator really validates: an unknown condition is an error."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("service_healthy", "service_happy", 1))
    result = _check_schema(broken)
    assert result.returncode != 0
    assert "service_happy" in result.stdout


def test_runs_nats_with_jetstream_etcd_3_5_and_the_four_services(services: dict[str, dict[str, Any]]) -> None:
    assert set(_palisade(services)) == SERVICES
    nats = services["nats"]
    assert image_of(nats).startswith("nats:")
    # The public image's entrypoint runs a command as given; the local image has no entrypoint.
    assert nats["command"] == ["nats-server", "--config", "/etc/nats/nats.conf"]
    assert _mounts(nats)["/etc/nats/nats.conf"]["source"] == "./nats.conf"
    assert "jetstream" in json.loads((COMPOSE_FILE.parent / "nats.conf").read_text())
    assert image_of(services["etcd"]).startswith(("quay.io/coreos/etcd:v3.5.", "gcr.io/etcd-development/etcd:v3.5."))


def test_every_palisade_container_runs_its_service_with_known_settings(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in _palisade(services).items():
        service, config = check_container_config(f"compose service {name}", svc["command"], _env(svc))
        assert service == name
        assert port_of(config.grpc_listen) == DEFAULT_GRPC_PORTS[name]


def test_the_dns_proxy_runs_beside_the_datapath_on_its_pins_and_state(services: dict[str, dict[str, Any]]) -> None:
    proxy, datapath = services["dns-proxy"], services["datapath"]
    assert proxy["command"] == DNS_PROXY and image_of(proxy) == image_of(datapath)
    check_dns_proxy("compose service dns-proxy", _env(proxy), _env(datapath))
    assert proxy["network_mode"] == "host" and proxy["privileged"] is True
    assert "/sys/fs/bpf" in _mounts(proxy)
    assert (
        "datapath-state:/var/run/palisade" in proxy["volumes"]
        and "datapath-state:/var/run/palisade" in datapath["volumes"]
    )
    assert proxy["depends_on"]["datapath"] == {"condition": "service_healthy"}


def test_the_capabilities_override_covers_every_privileged_service(services: dict[str, dict[str, Any]]) -> None:
    # Where privileged cannot be given, a privileged service the override forgets fails to start.
    override = load_yaml(COMPOSE_FILE.parent / "docker-compose.capabilities.yml")["services"]
    privileged = {name for name, svc in services.items() if svc.get("privileged")}
    assert privileged == set(override), f"privileged: {sorted(privileged)}, in the override: {sorted(override)}"
    for name in privileged:
        assert override[name]["privileged"] is False and override[name]["cap_add"] == ["ALL"], name


def _published(services: dict[str, dict[str, Any]]) -> dict[int, tuple[str, int]]:
    """Host port -> (service, container port) for ports published on the host's loopback."""
    out: dict[int, tuple[str, int]] = {}
    for name, svc in services.items():
        for mapping in svc.get("ports", []):
            host_ip, host_port, container_port = str(mapping).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {mapping} beyond the host's loopback"
            out[int(host_port)] = (name, int(container_port))
    return out


def _listens(svc: dict[str, Any]) -> set[int]:
    ports = {int(str(m).split(":")[-1]) for m in svc.get("ports", [])}
    listen = (svc.get("environment") or {}).get("PALISADE_GRPC_LISTEN")
    if listen:
        ports.add(port_of(listen))
    return ports


EXPECTED_TARGET = {"nats_url": "nats", "etcd_endpoints": "etcd", "policy_address": "policy", "ipam_address": "ipam"}


def _reaches(services: dict[str, dict[str, Any]], client: str, up: Upstream) -> None:
    target = EXPECTED_TARGET[up.setting]
    where = f"{client}'s {up.setting} {up.host}:{up.port}"
    if services[client].get("network_mode") == "host":
        assert up.host in ("127.0.0.1", "localhost"), f"{where}: on the host network, use the loopback"
        assert _published(services).get(up.port) == (target, up.port), f"{where}: {target} does not publish it"
    else:
        assert up.host == target, f"{where} should name the compose service {target}"
        assert up.port in _listens(services[target]), f"{where}: {target} listens on {_listens(services[target])}"


def test_every_address_reaches_the_right_service(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in _palisade(services).items():
        _, config = check_container_config(name, svc["command"], _env(svc))
        for up in upstreams(name, config):
            _reaches(services, name, up)


def test_services_wait_for_the_health_of_what_they_connect_to(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in _palisade(services).items():
        _, config = check_container_config(name, svc["command"], _env(svc))
        wanted = {EXPECTED_TARGET[up.setting] for up in upstreams(name, config)}
        depends = svc["depends_on"]
        assert set(depends) == wanted, name
        for dep, cond in depends.items():
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}"
            assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"


def test_settings_shared_by_services_agree(services: dict[str, dict[str, Any]]) -> None:
    configs = {
        name: check_container_config(name, svc["command"], _env(svc))[1] for name, svc in _palisade(services).items()
    }
    assert disagreements(configs) == []


def test_palisade_healthchecks_ask_grpc_health_on_the_service_port(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in _palisade(services).items():
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "palisade-healthcheck"], name
        assert port_of(test[2]) == DEFAULT_GRPC_PORTS[name], name
        # All certificates share the mounted directory here: say whose to present and expect.
        assert test[3:] == ["--server", name], name


def _mounts(svc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose_mounts(svc)


def test_datapath_is_privileged_on_the_host_network_with_bpffs_and_kernel_headers(
    services: dict[str, dict[str, Any]],
) -> None:
    dp = services["datapath"]
    assert dp["privileged"] is True
    assert dp["network_mode"] == "host"
    assert str(dp["user"]).split(":")[0] == "0"
    mounts = _mounts(dp)
    # Pinned maps and the pods' namespaces are the host's: shared both ways.
    for path in ("/sys/fs/bpf", NETNS_DIR):
        assert mounts[path]["source"] == path
        assert not mounts[path].get("read_only", False), path
        assert mounts[path]["bind"]["propagation"] == "rshared", path
    for path in ("/lib/modules", "/usr/src"):
        assert mounts[path]["source"] == path
        assert mounts[path]["read_only"] is True, f"{path} should be read-only"
    _, config = check_container_config("datapath", dp["command"], _env(dp))
    assert isinstance(config, DatapathConfig)
    assert Path(config.bpffs).is_relative_to("/sys/fs/bpf")
    volumes = [str(v).split(":")[1] for v in dp["volumes"] if isinstance(v, str) and not v.startswith("/")]
    assert any(Path(config.state_dir).is_relative_to(v) for v in volumes), "endpoint state must be on a volume"


def test_other_palisade_services_are_unprivileged(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in _palisade(services).items():
        if name == "datapath":
            continue
        assert not svc.get("privileged", False), name
        assert "user" not in svc, f"{name} should keep the image's unprivileged user"
        assert svc["read_only"] is True, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert "network_mode" not in svc and "pid" not in svc, name


def test_watcher_reads_the_repository_examples_read_only(services: dict[str, dict[str, Any]]) -> None:
    watcher = services["watcher"]
    env = watcher["environment"]
    assert env["PALISADE_SOURCE"] == "manifests"
    mount = _mounts(watcher)[env["PALISADE_MANIFESTS"]]
    assert (COMPOSE_FILE.parent / resolve_default(mount["source"])).resolve() == ROOT / "examples"
    assert mount["read_only"] is True


def test_certificates_are_made_once_and_mounted_read_only_everywhere(services: dict[str, dict[str, Any]]) -> None:
    init = services["tls-init"]
    assert "palisade tls init --dir /tls" in " ".join(init["command"])
    assert _mounts(init)["/tls"]["source"] == "./tls"
    # Each container its own bundle (what is in them: test_compose_tls.py).
    for name in (*SERVICES, "nats", "etcd"):
        mount = _mounts(services[name])["/etc/palisade/tls"]
        assert mount["source"] == f"./tls/{name}" and mount["read_only"] is True, name
    # Nothing starts before the certificates exist (the services wait on nats, which waits on them).
    for name in ("nats", "etcd"):
        assert services[name]["depends_on"]["tls-init"] == {"condition": "service_completed_successfully"}


def test_nats_runs_the_configuration_generated_from_the_code() -> None:
    wanted = natsconfig.render(
        listen="0.0.0.0:4222",
        store_dir="/data",
        tls=Credentials("nats", Path("/etc/palisade/tls")),
        http="0.0.0.0:8222",
    )
    assert (COMPOSE_FILE.parent / "nats.conf").read_text() == wanted, (
        "regenerate: python -m services.common.natsconfig > deploy/compose/nats.conf"
    )


def test_etcd_speaks_tls_and_serves_only_ipam(services: dict[str, dict[str, Any]]) -> None:
    flags = dict(str(a).removeprefix("--").partition("=")[::2] for a in services["etcd"]["command"][1:])
    assert flags["listen-client-urls"].startswith("https://")
    assert "client-cert-auth" in flags and flags["client-cert-allowed-hostname"] == "ipam"
    assert _env(services["ipam"])["PALISADE_ETCD_ENDPOINTS"] == "etcd:2379"
