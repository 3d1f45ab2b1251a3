"""Pod networks as the service, the tests and the benchmarks all wire them (netns.create_pod), root only."""

from __future__ import annotations

import errno
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.datapath import netns

pytestmark = [pytest.mark.root]


@pytest.fixture
def name() -> Iterator[str]:
    ns = "pn" + secrets.token_hex(3)
    yield ns
    for left in (ns, ns + "b"):
        subprocess.run(["ip", "link", "del", left], capture_output=True, check=False)
    netns.delete_netns(ns)


def test_created_adopted_and_refused_namespaces(name: str) -> None:
    pod = netns.create_pod(name, name, ["10.251.250.9"])
    assert pod.netns == f"/run/netns/{name}" and pod.netns_owned and pod.host_ifindex > 0
    assert netns.pod_alive(pod)

    # The same namespace again: it exists, so creating it is refused by name.
    with pytest.raises(FileExistsError) as err:
        netns.create_pod(name, name + "b", ["10.251.250.10"])
    assert err.value.errno == errno.EEXIST and f"network namespace {name} already exists" in str(err.value)

    # Adopting it for a second pod: its eth0 is taken. Refused by name (not a bare netlink error),
    # and the refusal leaves the first pod's network as it was.
    with pytest.raises(FileExistsError) as err:
        netns.create_pod(pod.netns, name + "b", ["10.251.250.10"], create=False)
    assert err.value.errno == errno.EEXIST and "already has an interface eth0" in str(err.value)
    assert netns.pod_alive(pod)
    assert subprocess.run(["ip", "link", "show", name + "b"], capture_output=True).returncode != 0

    netns.delete_pod(pod)
    assert not netns.pod_alive(pod)


def test_an_adopted_namespace_is_left_to_its_owner(name: str) -> None:
    netns.create_netns(name)
    pod = netns.create_pod(f"/run/netns/{name}", name, ["10.251.250.11"], create=False)
    assert not pod.netns_owned and netns.pod_alive(pod)
    netns.delete_pod(pod)
    assert not netns.pod_alive(pod)
    assert netns.NetnsPodNetwork().exists(pod.netns), "the caller's namespace stays"


def test_a_named_namespace_is_made_and_removed_as_ip_netns_does_it(name: str) -> None:
    netns.create_netns(name)
    # ip sees it and enters it: a namespace of its own (only a loopback), under a shared /run/netns.
    assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-n", name, "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    propagation = subprocess.run(
        ["findmnt", "-n", "-o", "PROPAGATION", netns.NETNS_DIR], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "shared" in propagation
    with pytest.raises(FileExistsError, match=f"network namespace {name} already exists"):
        netns.create_netns(name)

    netns.delete_netns(name)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    netns.delete_netns(name)  # gone already: nothing to do


def test_a_pod_is_plugged_first_and_addressed_after(name: str) -> None:
    """The service plugs a pod (namespace, veth) while IPAM allocates its addresses, then addresses
    it: nothing is routed to the pod before, and its interface does no duplicate address detection
    (the namespace's default, set as it was made)."""
    plug = netns.plug_pod(name, name)
    try:
        assert plug.link.ips == () and plug.link.host_ifindex > 0 and plug.inside is not None
        routes = subprocess.run(["ip", "-o", "route", "show", "dev", name], capture_output=True, text=True).stdout
        assert routes == "", "nothing is routed to a plugged pod"
        dad = netns.in_netns(name, Path("/proc/sys/net/ipv6/conf/eth0/accept_dad").read_text)
        assert dad.strip() == "0"
        pod = netns.address_pod(plug, ["10.251.250.12", "fd00:251:250::12"])
        assert plug.inside is None, "the plug's socket is closed once it is addressed"
        assert pod.ips == ("10.251.250.12", "fd00:251:250::12") and netns.pod_alive(pod)
        routes = subprocess.run(["ip", "-o", "route", "show", "dev", name], capture_output=True, text=True).stdout
        assert "10.251.250.12" in routes
        inside = subprocess.run(["ip", "-n", name, "-o", "addr", "show", "eth0"], capture_output=True, text=True)
        assert "10.251.250.12/32" in inside.stdout and "fd00:251:250::12/128" in inside.stdout
    finally:
        netns.delete_pod(plug.link)
    assert not netns.pod_alive(plug.link) and name not in netns.list_netns(name)
