"""The node's DNS proxy beside the datapath service process, with real BPF and packets (root, bcc).

A pod made by the datapath resolves names at a table DNS server in a namespace of the test's
(the outside world) and connects to the answers, steadily, while the datapath is killed (-9) and
started again: the proxy is a process of its own, so no lookup and no connection fails. And what
the proxy learned is what `palisade fqdn cache list`, `fqdn names` and `observe` show.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

import pytest

from palisade.v1 import common_pb2, datapath_pb2
from services.cli.main import main as palisade
from services.datapath import dnsrouting, netns
from services.datapath.types import IDENTITY_WORLD
from testkit.builders import policy_entry as entry
from testkit.controlplane import ControlPlane
from testkit.dnsserver import DnsServer, Record, SteadyLookups, addresses, query
from testkit.harness import ServiceProcess, pki
from testkit.traffic import EchoServer, tcp_exchange
from tests.datapath_service.helpers import create_endpoint, started
from tests.datapath_service.pods import Pods
from tests.datapath_service.test_service_root import cp, start_datapath

pytestmark = [pytest.mark.root, pytest.mark.bcc]

__all__ = ["cp", "start_datapath"]

EGR = common_pb2.DIRECTION_EGRESS
UDP, TCP = common_pb2.PROTOCOL_UDP, common_pb2.PROTOCOL_TCP
PORT = 8080


FQDN = common_pb2.FqdnRule(selector="*.example.test", protocol=TCP, port_low=PORT, verdict=common_pb2.VERDICT_ALLOW)
DNS = common_pb2.DnsRule(protocol=common_pb2.PROTOCOL_ANY, port=53, selectors=["*.example.test"])


def _start_proxy(bpffs: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    """The node's DNS proxy process, as a DaemonSet's second container runs it."""
    cmd = [sys.executable, "-m", "services.datapath.dnsproxyd", "--bpffs", bpffs, "--state-dir",
           str(tmp_path / "state"), "--log-format", "text"]  # fmt: skip
    with open(tmp_path / "dnsproxy.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def outside() -> AsyncIterator[tuple[str, str, str]]:
    """A namespace standing for the outside world: a DNS server address and a server address."""
    name = "pdx" + secrets.token_hex(2)
    o3 = secrets.randbelow(250)
    dns_ip, server_ip = f"10.252.{o3}.53", f"10.252.{o3}.80"
    link = await asyncio.to_thread(netns.create_pod, name, name, [dns_ip, server_ip])
    echo = EchoServer(link.name, (PORT,), ())
    try:
        yield link.name, dns_ip, server_ip
    finally:
        echo.close()
        await asyncio.to_thread(netns.delete_pod, link)


async def test_datapath_kill_9_loses_no_lookup(
    start_datapath: Callable[[], ServiceProcess],
    cp: ControlPlane,
    pods: Pods,
    outside: tuple[str, str, str],
    bpffs: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _free_port()
    monkeypatch.setenv("PALISADE_DNS_PROXY_PORT", str(port))  # both processes read it
    proc, stub = await started(start_datapath)
    ext, dns_ip, server_ip = outside
    server = DnsServer(ext, dns_ip)
    server.table["api.example.test"] = Record([server_ip])
    await server.start()
    proxy = await asyncio.to_thread(_start_proxy, bpffs, tmp_path)
    try:
        a = await create_endpoint(stub, pods.namespace, "a", "a")
        pod = pods.netns("a")
        dns_allowed = [entry(EGR, IDENTITY_WORLD, 53, UDP), entry(EGR, IDENTITY_WORLD, 53, TCP)]
        await cp.set_policy(a.identity, dns_allowed, ingress=False, egress=True)
        rev = await cp.set_names(a.identity, [FQDN], [DNS])
        await cp.wait_realized(rev, [a.id])
        assert not await asyncio.to_thread(tcp_exchange, pod, server_ip, PORT, 0.5), "not resolved yet"
        first = None
        for _ in range(50):  # the proxy opens its sockets once it has the maps and its names
            first = await asyncio.to_thread(query, pod, dns_ip, "api.example.test", timeout=0.2)
            if first is not None:
                break
        assert addresses(first) == [server_ip]

        connect = partial(tcp_exchange, pod, port=PORT, timeout=2.0)
        async with SteadyLookups(pod, dns_ip, "api.example.test", [server_ip], connect) as load:
            await asyncio.sleep(1)
            proc.kill()  # kill -9 of the datapath
            await asyncio.sleep(2)
            proc, stub = await started(start_datapath)
            await asyncio.sleep(2)
        assert load.rounds > 20 and load.failures == [], load.failures
        assert proc.terminate() == 0, proc.logs()[-3000:]
    finally:
        proxy.terminate()
        await asyncio.to_thread(proxy.wait, 10)
        await server.stop()
        await asyncio.to_thread(dnsrouting.remove)


def _cli(*argv: str) -> tuple[int, str, str]:
    """`palisade ARGV` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = palisade(list(argv))
    return code, out.getvalue(), err.getvalue()


async def test_fqdn_cli_shows_what_the_proxy_learned(
    start_datapath: Callable[[], ServiceProcess],
    cp: ControlPlane,
    pods: Pods,
    outside: tuple[str, str, str],
    bpffs: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PALISADE_DNS_PROXY_PORT", str(_free_port()))
    proc, stub = await started(start_datapath)
    ext, dns_ip, server_ip = outside
    server = DnsServer(ext, dns_ip)
    server.table["api.example.test"] = Record([server_ip], ttl=120)
    await server.start()
    proxy = await asyncio.to_thread(_start_proxy, bpffs, tmp_path)
    try:
        a = await create_endpoint(stub, pods.namespace, "a", "a")
        pod = pods.netns("a")
        dns_allowed = [entry(EGR, IDENTITY_WORLD, 53, UDP), entry(EGR, IDENTITY_WORLD, 53, TCP)]
        await cp.set_policy(a.identity, dns_allowed, ingress=False, egress=True)
        await cp.wait_realized(await cp.set_names(a.identity, [FQDN], [DNS]), [a.id])
        answer = None
        for _ in range(50):  # the proxy opens its sockets once it has the maps and its names
            answer = await asyncio.to_thread(query, pod, dns_ip, "api.example.test", timeout=0.2)
            if answer is not None:
                break
        assert addresses(answer) == [server_ip]
        assert await asyncio.to_thread(tcp_exchange, pod, server_ip, PORT, 2.0)

        flags = ("--datapath-address", proc.address, "--tls-dir", str(pki()))
        code, out, err = await asyncio.to_thread(_cli, "fqdn", "cache", "list", *flags, "-o", "json")
        assert code == 0, err
        (name,) = json.loads(out)["names"]
        (learned,) = name["addresses"]
        assert (name["node"], name["name"], learned["ip"], learned["pods"]) == (
            "node-a", "api.example.test", server_ip, [f"{pods.namespace}/a"]
        )  # fmt: skip
        assert 100 <= learned["ttl_seconds"] <= 120 and learned["endpoint_ids"] == [str(a.id)]
        identity = learned["identity"]
        code, out, _ = await asyncio.to_thread(_cli, "fqdn", "cache", "list", *flags, "--pod", f"{pods.namespace}/a")
        assert code == 0 and f"node-a  api.example.test  {server_ip}  {identity}" in out
        code, _, err = await asyncio.to_thread(_cli, "fqdn", "cache", "list", *flags, "--pod", f"{pods.namespace}/zz")
        assert code == 2 and f"{pods.namespace}/zz" in err
        code, _, err = await asyncio.to_thread(_cli, "fqdn", "cache", "list", *flags, "--node", "node-b")
        assert code == 2 and "no datapath serves node 'node-b'; the nodes are: node-a" in err

        code, out, err = await asyncio.to_thread(_cli, "fqdn", "names", *flags, "-o", "json")
        assert code == 0, err
        (selector,) = json.loads(out)["selectors"]
        assert selector["selector"] == "*.example.test" and selector["pods"] == [f"{pods.namespace}/a"]
        assert selector["selected"] == [{"identity": identity, "ip": server_ip, "names": ["api.example.test"]}]

        # The connection's flow, from the datapath's ring: to the learned address, by its name.
        code, out, err = await asyncio.to_thread(
            _cli, "observe", *flags, "--last", "1", "--fqdn", "*.example.test", "-o", "json"
        )
        assert code == 0, err
        (flow,) = [json.loads(x) for x in out.splitlines()]
        assert (flow["destination_ip"], flow["destination_names"]) == (server_ip, ["api.example.test"])
        assert flow["destination_identity"] == identity and flow["verdict"] == "VERDICT_ALLOW"
        code, out, _ = await asyncio.to_thread(_cli, "observe", *flags, "--last", "1", "--fqdn", "*.example.test")
        assert code == 0 and f"-> api.example.test ({server_ip}):{PORT} (id {identity})" in out
        flows = [e async for e in stub.Observe(datapath_pb2.ObserveRequest(last=100))]
        assert {tuple(e.destination_names) for e in flows if e.destination_ip == server_ip} == {("api.example.test",)}
    finally:
        proxy.terminate()
        await asyncio.to_thread(proxy.wait, 10)
        await server.stop()
        await asyncio.to_thread(dnsrouting.remove)
