"""The node installer: the launcher and the network configuration, standalone and chained, and removal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cni import install


def run(tmp_path: Path, *extra: str) -> int:
    return install.main(
        ["--bin-dir", str(tmp_path / "bin"), "--conf-dir", str(tmp_path / "conf"), "--runtime-dir",
         str(tmp_path / "rt"), "--runtime-path", "/opt/palisade-cni", "--no-runtime", *extra]
    )  # fmt: skip


def test_standalone_writes_palisade_alone_the_executable_and_a_launcher_on_the_copied_runtime(tmp_path: Path) -> None:
    assert run(tmp_path, "--socket", "/var/run/palisade/datapath/cni.sock") == 0
    conf = json.loads((tmp_path / "conf" / install.CONFLIST).read_text())
    assert conf["plugins"] == [{"type": "palisade", "socket": "/var/run/palisade/datapath/cni.sock"}]
    # The runtime starts the built executable; what it hands over runs the launcher beside it.
    plugin = tmp_path / "bin" / "palisade"
    assert plugin.stat().st_mode & 0o111 and plugin.read_bytes() == install.SHIM.read_bytes()
    launcher = tmp_path / "bin" / "palisade-python"
    assert launcher.stat().st_mode & 0o111
    text = launcher.read_text()
    assert text.startswith("#!/bin/sh") and 'PYTHONHOME="/opt/palisade-cni/python"' in text
    assert "-m services.cni.plugin" in text


def test_the_executable_must_be_built(tmp_path: Path) -> None:
    (tmp_path / "not-built").write_text("#!/bin/sh\n")
    for missing in (tmp_path / "absent", tmp_path / "not-built"):
        with pytest.raises(install.InstallError, match="make setup"):
            install.shim_binary(missing)


def test_chained_goes_after_the_nodes_plugins_under_their_network_name(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    kindnet = {"cniVersion": "0.3.1", "name": "kindnet", "plugins": [{"type": "ptp"}, {"type": "portmap"}]}
    (tmp_path / "conf" / "10-kindnet.conflist").write_text(json.dumps(kindnet))
    assert run(tmp_path, "--chain") == 0
    conf = json.loads((tmp_path / "conf" / install.CONFLIST).read_text())
    assert conf["name"] == "kindnet" and conf["cniVersion"] == "0.3.1"
    assert [p["type"] for p in conf["plugins"]] == ["ptp", "portmap", "palisade"]
    # Installing again (a datapath restart) does not chain Palisade twice.
    assert run(tmp_path, "--chain") == 0
    conf = json.loads((tmp_path / "conf" / install.CONFLIST).read_text())
    assert [p["type"] for p in conf["plugins"]] == ["ptp", "portmap", "palisade"]
    # A single-plugin .conf counts too.
    (tmp_path / "conf" / "10-kindnet.conflist").unlink()
    (tmp_path / "conf" / "10-flannel.conf").write_text(
        json.dumps({"cniVersion": "1.0.0", "name": "cbr0", "type": "flannel"})
    )
    assert run(tmp_path, "--chain") == 0
    conf = json.loads((tmp_path / "conf" / install.CONFLIST).read_text())
    assert [p["type"] for p in conf["plugins"]] == ["flannel", "palisade"] and conf["name"] == "cbr0"


def test_chained_without_a_primary_plugin_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path, "--chain") == 1
    assert "no other CNI configuration" in capsys.readouterr().err
    assert not (tmp_path / "conf" / install.CONFLIST).exists()


def test_uninstall_removes_what_install_put_there(tmp_path: Path) -> None:
    assert run(tmp_path) == 0
    (tmp_path / "conf" / "10-other.conflist").write_text("{}")
    assert run(tmp_path, "--uninstall") == 0
    assert sorted(p.name for p in (tmp_path / "conf").iterdir()) == ["10-other.conflist"]
    assert not (tmp_path / "bin" / "palisade").exists() and not (tmp_path / "bin" / "palisade-python").exists()
