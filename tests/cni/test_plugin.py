"""palisade-cni as a runtime runs it: exec'd with the CNI environment and configuration, against a datapath.

The datapath is the agent in this process over the in-memory BPF fake and a fake pod network,
with real NATS, real gRPC on its unix socket, and real network namespace paths (root).
Every command, both modes, and the error paths a runtime can meet, through the executable a
runtime starts (services/cni/shim.c, built by `make setup`), and what it hands to the Python plugin.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.datapath.fake import FakeDatapath
from services.datapath.netns import PodLink
from services.datapath.state import STATE_FILE
from testkit.controlplane import ControlPlane
from testkit.harness import ROOT, NatsServer
from tests.datapath_service.agent import InProcessAgent
from tests.datapath_service.helpers import eventually

pytestmark = pytest.mark.root

INIT = 5
#: The plugin executable as `make setup` builds it, beside the Python plugin it hands to.
PLUGIN = Path(sys.executable).parent / "palisade-cni"


def sandbox_netns(agent: InProcessAgent) -> Iterator[str]:
    """A real network namespace, as the runtime makes for a sandbox, known to the fake pod network."""
    name = f"cnitest-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    path = f"/run/netns/{name}"
    agent.network.namespaces.add(path)
    yield path
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def netns(agent: InProcessAgent) -> Iterator[str]:
    yield from sandbox_netns(agent)


@pytest.fixture
def second_netns(agent: InProcessAgent) -> Iterator[str]:
    """Another sandbox's."""
    yield from sandbox_netns(agent)


def conf(agent: InProcessAgent, version: str = "1.0.0", **extra: Any) -> dict[str, Any]:
    return {"cniVersion": version, "name": "k8s-pod-network", "type": "palisade",
            "socket": agent.config.cni_socket_path, "timeout": 2, **extra}  # fmt: skip


async def cni(
    command: str,
    config: dict[str, Any] | bytes,
    *,
    netns: str = "",
    cid: str = "c1",
    pod: str = "web",
    plugin: Path | str = PLUGIN,
    **env: str,
) -> tuple[int, dict[str, Any]]:
    """Exec palisade-cni as a runtime does; returns (exit status, the JSON it printed)."""
    environment = {
        "PATH": os.environ["PATH"],
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=x;K8S_POD_NAME={pod};K8S_POD_UID=u-1",
        **env,
    }
    data = config if isinstance(config, bytes) else json.dumps(config).encode()
    proc = await asyncio.create_subprocess_exec(
        plugin, cwd=ROOT, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await proc.communicate(data)
    status = proc.returncode
    # 0 is success and 1 an error object: anything else is a crash or a signal, never an answer.
    assert status is not None and status in (0, 1), f"palisade-cni ended with {status} (stderr: {err.decode()[-2000:]})"
    text = out.decode().strip()
    # Success of DEL, CHECK, STATUS and GC prints nothing, as the specification says.
    assert text or status == 0, f"no error object (stderr: {err.decode()[-2000:]})"
    printed = json.loads(text) if text else {}
    if status == 1:
        assert {"cniVersion", "code", "msg"} <= printed.keys(), f"not a CNI error object: {printed}"
    return status, printed


def endpoints(agent: InProcessAgent) -> dict[str, Any]:
    assert agent.agent is not None
    return {ep.record.container_id: ep for ep in agent.agent.manager.endpoints.values()}


async def test_version_answers_the_supported_versions(agent: InProcessAgent) -> None:
    code, out = await cni("VERSION", {"cniVersion": "1.0.0"})
    assert code == 0 and out["cniVersion"] == "1.0.0"
    assert {"0.3.1", "0.4.0", "1.0.0", "1.1.0"} <= set(out["supportedVersions"])


async def test_standalone_add_check_del_and_del_again(agent: InProcessAgent, cp: ControlPlane, netns: str) -> None:
    code, out = await cni("ADD", conf(agent), netns=netns)
    assert code == 0, out
    assert out["cniVersion"] == "1.0.0"
    host, pod = out["interfaces"]
    assert host["name"].startswith("lxc") and "sandbox" not in host
    assert (pod["name"], pod["sandbox"]) == ("eth0", netns)
    (ip,) = out["ips"]
    assert ip["address"].endswith("/32") and ip["gateway"] == "169.254.1.1" and ip["interface"] == 1
    assert "version" not in ip
    assert out["routes"] == [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}]
    ep = endpoints(agent)["c1"]
    assert ep.record.key == "x/web" and ep.record.netns == netns and not ep.record.netns_owned

    # The pod object was not known: init first, its own identity once ipam publishes it.
    assert ep.identity == INIT
    await cp.relabel_pod("x", "web", 4242)
    await eventually(lambda: endpoints(agent)["c1"].identity == 4242)

    code, out = await cni("CHECK", conf(agent, prevResult=out), netns=netns)
    assert code == 0 and out == {}
    code, out = await cni("DEL", conf(agent), netns=netns)
    assert (code, out) == (0, {})
    assert endpoints(agent) == {} and cp.ips == {}
    assert agent.agent is not None
    await agent.agent.manager.settled()  # the veth goes after the answer (see the test below)
    assert ep.record.host_ifname not in agent.network.links
    # DEL is idempotent, and never fails for a namespace that is gone.
    code, _ = await cni("DEL", conf(agent), netns=netns)
    assert code == 0
    code, _ = await cni("DEL", conf(agent), netns="/run/netns/long-gone")
    assert code == 0


async def test_an_older_version_gets_its_own_result_shape(agent: InProcessAgent, netns: str) -> None:
    code, out = await cni("ADD", conf(agent, "0.3.1"), netns=netns)
    assert code == 0, out
    assert out["cniVersion"] == "0.3.1" and out["ips"][0]["version"] == "4"


async def test_add_again_replaces_the_endpoint_and_a_new_sandbox_replaces_the_old(
    agent: InProcessAgent, cp: ControlPlane, netns: str
) -> None:
    assert (await cni("ADD", conf(agent), netns=netns))[0] == 0
    code, out = await cni("ADD", conf(agent), netns=netns)
    assert code == 0, out
    assert list(endpoints(agent)) == ["c1"]
    # The runtime made a new sandbox for the pod before the old one's DEL.
    other = netns + "b"
    await asyncio.to_thread(subprocess.run, ["ip", "netns", "add", os.path.basename(other)], check=True)
    agent.network.namespaces.add(other)
    try:
        code, out = await cni("ADD", conf(agent), netns=other, cid="c2")
        assert code == 0, out
        assert list(endpoints(agent)) == ["c2"]
        assert len(cp.ips) == 1
    finally:
        await asyncio.to_thread(subprocess.run, ["ip", "netns", "del", os.path.basename(other)], capture_output=True)


def state_dirs(state: Path) -> list[str]:
    return sorted(d.name for d in state.iterdir() if d.is_dir())


async def test_del_answers_before_its_veth_goes_and_an_add_of_the_same_pod_waits_for_the_veth_to_go(
    agent: InProcessAgent, cp: ControlPlane, netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert agent.agent is not None and agent.datapath is not None
    code, out = await cni("ADD", conf(agent), netns=netns)
    assert code == 0, out
    ep = endpoints(agent)["c1"]
    state = Path(agent.config.state_dir)
    # The kernel's veth deletion, held until the test lets it go.
    going = threading.Event()
    teardown = agent.network.teardown

    def held_teardown(link: PodLink) -> None:
        assert going.wait(30)
        teardown(link)

    monkeypatch.setattr(agent.network, "teardown", held_teardown)
    code, out = await cni("DEL", conf(agent), netns=netns)
    assert (code, out) == (0, {})
    # Answered: out of the table, the maps and IPAM; the veth still going, its state kept aside
    # (a restart finishes the teardown, and never restores the endpoint).
    assert endpoints(agent) == {} and cp.ips == {}
    assert ep.id not in {p.id for p in agent.datapath.pinned_endpoints()}
    assert ep.record.host_ifname in agent.network.links
    assert [name.split("-")[:2] for name in state_dirs(state)] == [["going", str(ep.id)]]

    # A new sandbox of the same pod gets the same veth name: its ADD waits for the old one to go.
    other = netns + "b"
    await asyncio.to_thread(subprocess.run, ["ip", "netns", "add", os.path.basename(other)], check=True)
    agent.network.namespaces.add(other)
    try:
        add = asyncio.create_task(cni("ADD", conf(agent), netns=other, cid="c2"))
        await asyncio.sleep(0.5)
        assert not add.done() and list(endpoints(agent)) == []
        going.set()
        code, out = await add
        assert code == 0, out
        new = endpoints(agent)["c2"]
        assert (
            new.record.host_ifname == ep.record.host_ifname and agent.network.pod_side[new.record.host_ifname] == other
        )
        await agent.agent.manager.settled()
        assert state_dirs(state) == [str(new.id)]
    finally:
        going.set()
        await asyncio.to_thread(subprocess.run, ["ip", "netns", "del", os.path.basename(other)], capture_output=True)


async def test_chained_adopts_the_previous_plugins_veth_and_passes_its_result_on(
    agent: InProcessAgent, cp: ControlPlane, netns: str
) -> None:
    agent.network.plug_other(netns, "veth0a1b2c3d")
    prev = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "veth0a1b2c3d", "mac": "aa:bb:cc:dd:ee:01"},
                       {"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "sandbox": netns}],
        "ips": [{"address": "10.22.0.5/24", "gateway": "10.22.0.1", "interface": 1}],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {},
    }  # fmt: skip
    code, out = await cni("ADD", conf(agent, prevResult=prev), netns=netns)
    assert code == 0, out
    assert out == prev
    ep = endpoints(agent)["c1"]
    assert ep.record.host_ifname == "veth0a1b2c3d" and ep.record.ips == ("10.22.0.5",) and not ep.record.link_owned
    assert cp.ips == {"10.22.0.5": "pod/x/web"}  # so the address reaches the ipcache with the pod's identity
    code, _ = await cni("CHECK", conf(agent, prevResult=prev), netns=netns)
    assert code == 0
    code, _ = await cni("DEL", conf(agent, prevResult=prev), netns=netns)
    assert code == 0
    assert endpoints(agent) == {} and "veth0a1b2c3d" in agent.network.links  # not ours to delete


def state_files(agent: InProcessAgent) -> list[Path]:
    return list(Path(agent.config.state_dir).glob(f"*/{STATE_FILE}"))


def plugged(agent: InProcessAgent, netns: str, host_ifname: str) -> FakeDatapath:
    """The veth another plugin made in ``netns``; returns the agent's BPF fake."""
    agent.network.plug_other(netns, host_ifname)
    assert agent.datapath is not None
    return agent.datapath


def chained_prev(netns: str, host_ifname: str, ip: str) -> dict[str, Any]:
    """The result ptp leaves for the next plugin: its veth and the address host-local chose."""
    return {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": host_ifname}, {"name": "eth0", "sandbox": netns}],
        "ips": [{"address": f"{ip}/24", "gateway": "10.22.0.1", "interface": 1}],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {},
    }


async def test_chained_reserves_the_address_while_the_programs_go_in_and_its_entries_after(
    agent: InProcessAgent, cp: ControlPlane, netns: str
) -> None:
    dp = plugged(agent, netns, "veth0a1b2c3e")
    seen: dict[str, object] = {}

    async def slow_ipam(request: Any) -> None:
        # IPAM answers only once the programs are attached (or after 1 s): a create that waited
        # for the reservation before attaching would show nothing attached here.
        for _ in range(100):
            if dp.attached_here:
                break
            await asyncio.sleep(0.01)
        seen["attached"] = bool(dp.attached_here)
        seen["entry"] = dp.ipcache_dump().get("10.22.0.6/32")
        seen["state"] = state_files(agent)

    cp.reserving = slow_ipam
    code, out = await cni("ADD", conf(agent, prevResult=chained_prev(netns, "veth0a1b2c3e", "10.22.0.6")), netns=netns)
    assert code == 0, out
    # The programs went in meanwhile; the pod's ipcache entry and its state waited for IPAM.
    assert seen == {"attached": True, "entry": None, "state": []}
    ep = endpoints(agent)["c1"]
    assert ep.record.addresses[0].gateway == cp.gateway  # IPAM's answer, not the provisional one
    assert dp.ipcache_dump().get("10.22.0.6/32") == ep.identity
    assert state_files(agent) == [Path(agent.config.state_dir) / str(ep.id) / STATE_FILE]


async def test_chained_with_an_address_another_pod_holds_fails_and_leaves_nothing_behind(
    agent: InProcessAgent, cp: ControlPlane, netns: str
) -> None:
    dp = plugged(agent, netns, "veth0a1b2c3f")
    cp.ips["10.22.0.7"] = "pod/x/other"
    await cp.publish_ipcache("10.22.0.7/32", 777)  # the other pod's entry, as every node has it
    await eventually(lambda: dp.ipcache_lookup("10.22.0.7") == 777)
    code, out = await cni("ADD", conf(agent, prevResult=chained_prev(netns, "veth0a1b2c3f", "10.22.0.7")), netns=netns)
    assert code == 1 and "10.22.0.7 belongs to pod/x/other" in out["details"], out
    assert endpoints(agent) == {} and dp.pinned_endpoints() == []
    assert dp.ipcache_dump().get("10.22.0.7/32") == 777  # the other pod's entry untouched
    assert state_files(agent) == []
    assert cp.ips == {"10.22.0.7": "pod/x/other"} and "veth0a1b2c3f" in agent.network.links


async def test_chained_with_an_address_an_endpoint_here_has_asks_ipam_before_touching_the_programs(
    agent: InProcessAgent, cp: ControlPlane, netns: str, second_netns: str
) -> None:
    dp = plugged(agent, netns, "veth0a1b2c40")
    code, out = await cni("ADD", conf(agent, prevResult=chained_prev(netns, "veth0a1b2c40", "10.22.0.8")), netns=netns)
    assert code == 0, out
    first = endpoints(agent)["c1"]
    attached: list[set[int]] = []

    async def watching_ipam(request: Any) -> None:
        attached.append(set(dp.attached_here))

    cp.reserving = watching_ipam
    # Another sandbox given the same address (the other plugin's IPAM handed it out twice).
    agent.network.plug_other(second_netns, "veth0a1b2c41")
    prev = chained_prev(second_netns, "veth0a1b2c41", "10.22.0.8")
    code, out = await cni("ADD", conf(agent, prevResult=prev), netns=second_netns, cid="c2", pod="dup")
    assert code == 1 and "10.22.0.8 belongs to pod/x/web" in out["details"], out
    assert attached == [{first.id}]  # IPAM refused before the new endpoint's programs went in
    assert set(endpoints(agent)) == {"c1"} and dp.ipcache_dump().get("10.22.0.8/32") == first.identity


async def first_standalone(agent: InProcessAgent, netns: str) -> FakeDatapath:
    """A standalone ADD (ipam chooses its address: the node has not learnt its CIDR yet); returns
    the agent's BPF fake."""
    code, out = await cni("ADD", conf(agent), netns=netns)
    assert code == 0, out
    assert endpoints(agent)["c1"].record.ips == ("10.244.7.2",)
    assert agent.datapath is not None
    return agent.datapath


def addresses_asked(cp: ControlPlane) -> list[str]:
    """The address of every AllocateIP call from now on ("": ipam chooses)."""
    asked: list[str] = []

    async def recording(request: Any) -> None:
        asked.append(request.ip)

    cp.reserving = recording
    return asked


async def test_standalone_picks_the_next_address_here_and_ipam_records_it_while_the_programs_go_in(
    agent: InProcessAgent, cp: ControlPlane, netns: str, second_netns: str
) -> None:
    dp = await first_standalone(agent, netns)
    first = endpoints(agent)["c1"].id
    seen: dict[str, object] = {}

    async def slow_ipam(request: Any) -> None:
        # IPAM answers only once the new endpoint's programs are attached (or after 1 s): a create
        # that waited for IPAM's choice before making the pod's network would show nothing here.
        for _ in range(100):
            if dp.attached_here - {first}:
                break
            await asyncio.sleep(0.01)
        entry = dp.ipcache_dump().get(f"{request.ip}/32")
        seen.update(ip=request.ip, attached=bool(dp.attached_here - {first}), entry=entry)

    cp.reserving = slow_ipam
    code, out = await cni("ADD", conf(agent), netns=second_netns, cid="c2", pod="db")
    assert code == 0, out
    # The next address, picked here; IPAM recorded it after the programs went in, and the pod's
    # ipcache entry waited for IPAM's answer.
    assert seen == {"ip": "10.244.7.3", "attached": True, "entry": None}
    ep = endpoints(agent)["c2"]
    assert out["ips"][0]["address"] == "10.244.7.3/32" and cp.ips["10.244.7.3"] == "pod/x/db"
    (address,) = ep.record.addresses
    assert (address.cidr, address.gateway) == (str(cp.net), cp.gateway)  # IPAM's answer
    assert dp.ipcache_dump().get("10.244.7.3/32") == ep.identity
    assert len(state_files(agent)) == 2
    assert agent.agent is not None and agent.agent.manager.address_picks == (1, 0)


async def test_standalone_address_another_process_took_meanwhile_is_given_up_for_one_ipam_chooses(
    agent: InProcessAgent, cp: ControlPlane, netns: str, second_netns: str
) -> None:
    dp = await first_standalone(agent, netns)
    # Taken through IPAM by another process; no ipcache entry has reached this node yet.
    cp.ips["10.244.7.3"] = "pod/x/other"
    asked = addresses_asked(cp)
    code, out = await cni("ADD", conf(agent), netns=second_netns, cid="c2", pod="db")
    assert code == 0, out
    # The pick was refused; the create was undone and made again with the address IPAM chose.
    assert asked == ["10.244.7.3", ""]
    assert endpoints(agent)["c2"].record.ips == ("10.244.7.4",)
    assert cp.ips == {"10.244.7.2": "pod/x/web", "10.244.7.3": "pod/x/other", "10.244.7.4": "pod/x/db"}
    assert "10.244.7.3/32" not in dp.ipcache_dump()
    assert agent.agent is not None and agent.agent.manager.address_picks == (0, 1)
    assert sorted(p.id for p in dp.pinned_endpoints()) == sorted(ep.id for ep in endpoints(agent).values())
    assert len(state_files(agent)) == 2


async def test_standalone_does_not_pick_an_address_the_ipcache_has(
    agent: InProcessAgent, cp: ControlPlane, netns: str, second_netns: str
) -> None:
    dp = await first_standalone(agent, netns)
    await cp.publish_ipcache("10.244.7.3/32", 777)  # held by a pod this node has not heard of from IPAM
    await eventually(lambda: dp.ipcache_lookup("10.244.7.3") == 777)
    asked = addresses_asked(cp)
    code, out = await cni("ADD", conf(agent), netns=second_netns, cid="c2", pod="db")
    assert code == 0, out
    assert asked == ["10.244.7.4"] and endpoints(agent)["c2"].record.ips == ("10.244.7.4",)
    assert dp.ipcache_lookup("10.244.7.3") == 777


@pytest.mark.parametrize(
    ("config", "env", "code", "words"),
    [
        (b"{not json", {}, 6, "not JSON"),
        (b"[1, 2]", {}, 6, "not a JSON object"),
        ({"cniVersion": "9.9.9", "type": "palisade"}, {}, 1, "cniVersion 9.9.9"),
        ({"type": "palisade"}, {}, 7, "cniVersion is missing"),
        ({"cniVersion": "1.0.0", "type": "bridge"}, {}, 7, "this plugin is type"),
        ({"cniVersion": "1.0.0", "type": "palisade", "socket": "relative.sock"}, {}, 7, "socket"),
        ({"cniVersion": "1.0.0", "type": "palisade", "timeout": -1}, {}, 7, "timeout"),
        ({"cniVersion": "1.0.0", "type": "palisade", "name": 5}, {}, 7, "name must be a string"),
        ({"cniVersion": "1.0.0", "type": "palisade", "sockett": "/x.sock"}, {}, 7, "did you mean 'socket'"),
        ({"cniVersion": "1.0.0", "type": "palisade"}, {"CNI_NETNS": ""}, 4, "CNI_NETNS"),
        ({"cniVersion": "1.0.0", "type": "palisade"}, {"CNI_CONTAINERID": ""}, 4, "CNI_CONTAINERID"),
        ({"cniVersion": "1.0.0", "type": "palisade"}, {"CNI_ARGS": "IgnoreUnknown=1"}, 4, "K8S_POD_NAME"),
        ({"cniVersion": "1.0.0", "type": "palisade"}, {"CNI_COMMAND": "FROB"}, 4, "CNI_COMMAND"),
        ({"cniVersion": "1.0.0", "type": "palisade", "prevResult": {"interfaces": [{"name": "eth0", "sandbox": "/x"}]}},
         {}, 7, "host-side interface"),
    ],
)  # fmt: skip
async def test_bad_input_gets_the_specs_error_object(
    agent: InProcessAgent, netns: str, config: Any, env: dict[str, str], code: int, words: str
) -> None:
    if isinstance(config, dict):
        config = {"socket": agent.config.cni_socket_path, "name": "k8s-pod-network", **config}
    status, out = await cni("ADD", config, netns=env.pop("CNI_NETNS", netns), **env)
    assert status == 1
    assert out["code"] == code and words in out["msg"] + out.get("details", ""), out
    assert endpoints(agent) == {}


async def test_add_in_a_namespace_that_is_gone_is_container_unknown(agent: InProcessAgent) -> None:
    status, out = await cni("ADD", conf(agent), netns="/run/netns/never-was")
    assert status == 1 and out["code"] == 3 and "never-was" in out["msg"]


async def test_with_the_datapath_down_add_says_try_again_and_del_is_queued_for_its_return(
    agent: InProcessAgent, netns: str, nats_server: NatsServer
) -> None:
    assert (await cni("ADD", conf(agent), netns=netns))[0] == 0
    await agent.stop()
    status, out = await cni("ADD", conf(agent), netns=netns, cid="c9")
    assert status == 1 and out["code"] == 11, out
    status, out = await cni("STATUS", conf(agent, "1.1.0"))
    assert status == 1 and out["code"] == 50
    status, _ = await cni("DEL", conf(agent), netns=netns)
    assert status == 0
    queued = Path(agent.config.cni_socket_path).parent / "delete-queue" / "c1.json"
    assert json.loads(queued.read_text())["container_id"] == "c1"
    # Back: the restored endpoint is deleted from the queue.
    await agent.start()
    await agent.wait_synced()
    await eventually(lambda: endpoints(agent) == {} and not queued.exists(), timeout=15)
    status, _ = await cni("STATUS", conf(agent, "1.1.0"))
    assert status == 0


async def test_gc_removes_attachments_the_runtime_no_longer_has(agent: InProcessAgent, netns: str) -> None:
    assert (await cni("ADD", conf(agent), netns=netns))[0] == 0
    status, _ = await cni(
        "GC", conf(agent, "1.1.0", **{"cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]})
    )
    assert status == 0 and list(endpoints(agent)) == ["c1"]
    status, _ = await cni("GC", conf(agent, "1.1.0", **{"cni.dev/valid-attachments": []}))
    assert status == 0 and endpoints(agent) == {}


async def test_an_endpoint_whose_namespace_vanished_without_del_is_collected(agent: InProcessAgent, netns: str) -> None:
    assert (await cni("ADD", conf(agent), netns=netns))[0] == 0
    agent.network.namespaces.discard(netns)  # the runtime removed the sandbox and never called DEL
    assert agent.agent is not None
    await agent.agent.manager.sweep(Path(agent.config.cni_socket_path).parent / "delete-queue")
    assert endpoints(agent) == {}


async def test_a_pod_known_while_its_endpoint_is_made_gets_its_identity_not_init(
    agent: InProcessAgent, cp: ControlPlane, netns: str
) -> None:
    # ResolvePod says "unknown", then the object lands: its ipcache entry comes with the address,
    # before the endpoint exists. The endpoint must still end up with the pod's identity.
    cp.arriving["x/web"] = 777
    code, out = await cni("ADD", conf(agent), netns=netns)
    assert code == 0, out
    assert endpoints(agent)["c1"].identity == 777
