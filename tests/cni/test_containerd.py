"""Pods that a real runtime creates: containerd's CRI calls palisade-cni, standalone and chained after ptp.

The whole system runs as `make run` brings it up (no dev-node pods); containerd plays the
kubelet's runtime, with a conflist naming Palisade. The watcher publishes the Pod objects
from the manifest folder; one of them arrives only after its sandbox exists. A policy is
applied and real packets between the sandboxes' namespaces are allowed and denied as
`palisade analyze` says; removing the sandboxes leaves no endpoint, address or link.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from palisade.v1 import ipam_pb2, ipam_pb2_grpc
from services.cni import install
from testkit.builders import netpol
from testkit.containerd import Containerd, Cri, missing
from testkit.stack import Stack, analyze, pod_server, probe, running_stack, wait_for

pytestmark = [pytest.mark.root, pytest.mark.bcc]

NS = "cri"
INIT = 5
POLICY = netpol("server-from-client", {"app": "server"}, {"app": "client"}, 80, NS)


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}, "uid": f"uid-{name}"},
        "spec": {"nodeName": "dev-node", "containers": [{"name": "c", "image": "i", "ports": [{"containerPort": 80}]}]},
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    problem = missing()
    if problem:
        pytest.skip(problem)
    with running_stack(tmp_path_factory.mktemp("cni"), None, "--no-pods") as s:
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS, "labels": {"team": NS}}}
        (s.manifests / "00-ns.yaml").write_text(yaml.safe_dump_all([namespace, pod("client"), pod("server"), POLICY]))
        yield s


@pytest.fixture
def runtime(stack: Stack, tmp_path: Path) -> Iterator[tuple[Containerd, Cri]]:
    containerd = Containerd(tmp_path / "ctd")
    containerd.start(str(Path(sys.executable).parent / "palisade-cni"))
    cri = containerd.cri()
    try:
        yield containerd, cri
    finally:
        cri.close()
        containerd.stop()


def allocations(stack: Stack) -> list[str]:
    with stack.channel("ipam") as ch:
        listing = ipam_pb2_grpc.IPAMServiceStub(ch).ListAllocations(ipam_pb2.ListAllocationsRequest(), timeout=10)
    return [a.owner for a in listing.allocations if a.owner.startswith(f"pod/{NS}/")]


MODES = ("standalone", "chained")


@pytest.mark.parametrize("mode", MODES)
def test_sandboxes_from_containerd_are_enforced_by_identity_and_leave_nothing(
    stack: Stack, runtime: tuple[Containerd, Cri], mode: str, tmp_path: Path
) -> None:
    containerd, cri = runtime
    socket = str(stack.run_dir / "datapath" / "cni.sock")
    if mode == "standalone":
        containerd.write_conflist([{"type": "palisade", "socket": socket}])
    else:
        # The node's primary plugin, and Palisade chained after it by the node installer.
        ptp = {
            "type": "ptp",
            "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.77.0.0/24"}]], "dataDir": str(tmp_path / "ipam")},
        }
        (containerd.cni_conf / "10-ptp.conflist").write_text(
            json.dumps({"cniVersion": "1.0.0", "name": "ptp-net", "plugins": [ptp]})
        )
        assert (
            install.main(
                [
                    "--chain",
                    "--no-runtime",
                    "--socket",
                    socket,
                    "--conf-dir",
                    str(containerd.cni_conf),
                    "--bin-dir",
                    str(tmp_path / "unused-bin"),
                    "--runtime-dir",
                    str(tmp_path / "rt"),
                ]
            )
            == 0
        )
    late = stack.manifests / "10-late.yaml"
    sandboxes: dict[str, str] = {}
    try:
        for name in ("client", "server"):
            sandboxes[name] = cri.run_sandbox(NS, name, f"uid-{name}", tmp_path / "logs")
        # A pod whose object arrives after its sandbox: init first, then its own identity.
        sandboxes["late"] = cri.run_sandbox(NS, "late", "uid-late", tmp_path / "logs")
        eps = stack.endpoints()
        assert set(eps) == {f"{NS}/client", f"{NS}/server", f"{NS}/late"}, eps
        assert eps[f"{NS}/late"]["identity"] == INIT
        assert all(e["container_id"] == sandboxes[k.split("/")[1]] for k, e in eps.items())
        late.write_text(yaml.safe_dump(pod("late")))
        started = time.monotonic()
        assert wait_for(lambda: stack.endpoints()[f"{NS}/late"]["identity"] != INIT, 15)
        print(f"late pod moved from init to its identity {time.monotonic() - started:.2f}s after its object")
        eps = stack.endpoints()
        assert len({e["identity"] for e in eps.values()}) == 3 and INIT not in {e["identity"] for e in eps.values()}
        for name, sid in sandboxes.items():
            ep = eps[f"{NS}/{name}"]
            assert ep["ips"] == [cri.ip(sid)], (mode, ep, cri.ip(sid))
            assert Path(ep["netns"]).resolve() == Path(cri.netns(sid)).resolve()
        if mode == "chained":
            assert all(e["ips"][0].startswith("10.77.0.") for e in eps.values())

        # Real packets, as analyze says: client -> server allowed, late -> server denied.
        server_ep = eps[f"{NS}/server"]
        with pod_server(server_ep["netns"], "server", "--tcp", "80"):
            assert wait_for(lambda: stack.palisade("policy", "get", "networkpolicy", "server-from-client", "-n", NS)
                            .returncode == 0)  # fmt: skip
            matrix = analyze("-f", str(stack.manifests), "--probe", "80/TCP")["probes"][0]["matrix"]
            for src in ("client", "late"):
                want = matrix[f"{NS}/{src}"][f"{NS}/server"]
                src_netns = str(eps[f"{NS}/{src}"]["netns"])
                assert wait_for(lambda n=src_netns, w=want: probe(n, server_ep["ips"][0], 80) == w)  # type: ignore[misc]
        assert matrix[f"{NS}/client"][f"{NS}/server"] and not matrix[f"{NS}/late"][f"{NS}/server"]
    finally:
        for sid in sandboxes.values():
            cri.remove(sid)
        late.unlink(missing_ok=True)
    # Nothing left: no endpoint, no address, no host link of ours.
    assert wait_for(lambda: stack.endpoints() == {}, 15), stack.endpoints()
    assert wait_for(lambda: allocations(stack) == [], 15), allocations(stack)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in links.splitlines() if " lxc" in line and "@" in line and NS in line]
    if mode == "standalone":
        for ep in eps.values():
            assert ep["host_ifname"] not in links
