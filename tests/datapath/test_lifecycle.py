"""Policy map dumps, write ordering, the template cache, attach/detach, pinning across processes."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from services.datapath import netns
from services.datapath.datapath import Datapath, teardown_all
from services.datapath.loader import Loader, ProgramConfig, program_ids
from services.datapath.maps import metricsmap, policymap
from services.datapath.maps.bpf import MapSpec, MapType, PinnedMap, ensure_bpffs
from services.datapath.maps.sizes import MapSizes
from services.datapath.types import (
    Direction,
    EndpointSpec,
    Enforcement,
    L4Proto,
    PolicyEntry,
    Reason,
    Verdict,
)
from testkit.datapathnode import TCP_PORTS, UDP_PORTS, Node, Pod, drops
from testkit.traffic import DENY_TIMEOUT, EchoServer, host_sent, streams, tcp_exchange
from tests.datapath.entries import entry

pytestmark = [pytest.mark.root, pytest.mark.bcc]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


POLICY = [
    entry(Direction.INGRESS, 1001, L4Proto.TCP, 8080),
    entry(Direction.INGRESS, 1001, L4Proto.TCP, 1000, 1999),
    entry(Direction.INGRESS, 1001, L4Proto.TCP, 2000, 2999),  # adjacent to the range above
    entry(Direction.INGRESS, 1001, L4Proto.UDP, 1, 65535),
    entry(Direction.INGRESS, 0, L4Proto.SCTP, 3868),
    entry(Direction.INGRESS, 1003, L4Proto.ANY),
    entry(Direction.INGRESS, 1003, L4Proto.TCP, 22, deny=True),
    entry(Direction.EGRESS, 0, L4Proto.ANY),
    entry(Direction.EGRESS, 2, L4Proto.TCP, 0, deny=True),
    entry(Direction.EGRESS, 1002, L4Proto.ICMP),
]


def test_policy_dump_matches_applied_entries(net: Node) -> None:
    dp, b = net.dp, net.b
    enforcement = Enforcement(ingress=True, egress=True)
    change = dp.sync_policy(b.ep_id, enforcement, POLICY)
    assert change.added == len(dp.policy.read(b.ep_id)[b.ep_id])

    assert dp.dump_policy(b.ep_id) == (enforcement, sorted(POLICY))
    # A range costs a handful of prefixes, never one per port.
    prefixes = dp.policy.read(b.ep_id)[b.ep_id]
    ranged = [p for p, owner in prefixes.items() if owner == (1000, 1999)]
    assert 1 < len(ranged) <= 2 * 16

    # Incremental: remove one, overwrite one's verdict, add one (the others of their groups are kept).
    removed = POLICY[1]
    flipped = PolicyEntry(POLICY[0].key, Verdict.DENY)
    added = entry(Direction.INGRESS, 1002, L4Proto.UDP, 5353)
    change = dp.apply_policy(b.ep_id, enforcement, add=[flipped, added], remove=[removed, POLICY[0]], keep=POLICY[2:])
    assert change.removed == len(policymap.prefixes_of(b.ep_id, removed)) + 1
    assert change.added == 2
    expected = sorted({*POLICY[2:], flipped, added})
    assert dp.dump_policy(b.ep_id) == (enforcement, expected)

    # Enforcement alone.
    dp.apply_policy(b.ep_id, Enforcement(ingress=True))
    assert dp.dump_policy(b.ep_id) == (Enforcement(ingress=True), expected)


def test_sync_policy_repairs_drift(net: Node) -> None:
    dp, b = net.dp, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), POLICY)
    prefixes = dp.policy.read(b.ep_id)[b.ep_id]
    lost = next(iter(prefixes))
    dp.policy.delete([lost])  # behind the facade's back
    foreign = {policymap.Prefix(b.ep_id, Direction.INGRESS, 7777, L4Proto.TCP, Verdict.ALLOW, 443, 16): (443, 443)}
    dp.policy.write(foreign)
    assert dp.dump_policy(b.ep_id)[1] != sorted(POLICY)

    change = dp.sync_policy(b.ep_id, Enforcement(ingress=True), POLICY)
    assert (change.added, change.removed) == (1, 1)
    assert dp.dump_policy(b.ep_id) == (Enforcement(ingress=True), sorted(POLICY))


def test_policy_writes_add_before_enforce_before_remove(net: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """No window denies traffic both policies allow: adds land before removals."""
    dp, b = net.dp, net.b
    dp.sync_policy(b.ep_id, Enforcement(), [entry(Direction.INGRESS, 1001, L4Proto.TCP, 8080)])
    calls: list[str] = []
    real_write, real_delete, real_set = dp.policy.write, dp.policy.delete, dp.enforcement.set

    def write(prefixes):
        calls.extend("add" for _ in prefixes)
        real_write(prefixes)

    def delete(prefixes):
        prefixes = list(prefixes)
        calls.extend("remove" for _ in prefixes)
        real_delete(prefixes)

    def set_enforcement(ep_id, enforcement, hints):
        calls.append("enforce")
        real_set(ep_id, enforcement, hints)

    monkeypatch.setattr(dp.policy, "write", write)
    monkeypatch.setattr(dp.policy, "delete", delete)
    monkeypatch.setattr(dp.enforcement, "set", set_enforcement)
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [entry(Direction.INGRESS, 1001, L4Proto.TCP, 9000, 9010)])
    assert calls and "remove" in calls and "enforce" in calls
    assert calls == sorted(calls, key=["add", "enforce", "remove"].index)


def test_one_template_serves_every_endpoint(net: Node, bpf_base: str) -> None:
    dp = net.dp
    attachments = {net.dp._loader.attachment(p.net.host_ifindex).template() for p in net.pods}
    assert attachments == {dp.template.short}
    # Asking again is a cache hit; a fresh loader (as after a restart) reuses the pinned programs.
    assert dp._loader.template(dp.config) is dp.template
    fresh = Loader(bpf_base)
    try:
        reused = fresh.template(dp.config)
        assert reused.origin == "pinned" and reused.compile_seconds == 0.0
        assert program_ids(reused) == program_ids(dp.template)
    finally:
        fresh.close()


def test_reattach_swaps_the_program_in_place(net: Node, bpf_base: str) -> None:
    dp, a, b = net.dp, net.a, net.b
    dp.sync_policy(b.ep_id, Enforcement(ingress=True), [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    other = Loader(bpf_base)
    try:
        variant = other.template(ProgramConfig(ct_other_lifetime_s=61))
        assert variant.hash != dp.template.hash and variant.origin == "compiled"
        with streams((a.name, b.v4, 8080)) as (stream,):
            assert stream.ping()
            other.attach(variant, b.net.host_ifindex)
            assert dp._loader.attachment(b.net.host_ifindex).template() == variant.short
            assert stream.ping(), "established flows continue across the swap"
            assert not tcp_exchange(a.name, b.v4, 8081, timeout=DENY_TIMEOUT), "the new program enforces too"
            dp.attach_endpoint(b.spec)  # back to the datapath's template
            assert dp._loader.attachment(b.net.host_ifindex).template() == dp.template.short
            assert stream.ping()
        attachment = dp._loader.attachment(b.net.host_ifindex)
        assert attachment.programs == 2, "one program per hook, replaced not added"
        assert _bpf_filter_count(b.net.host_ifindex) == 0, "tcx: no tc filters"
    finally:
        other.close()


def _bpf_filter_count(ifindex: int) -> int:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return sum(
            1
            for parent in (0xFFFFFFF2, 0xFFFFFFF3)
            for f in ipr.get_filters(index=ifindex, parent=parent)
            if f.get_attr("TCA_KIND") == "bpf" and f["handle"] != 0  # handle 0: the prio's chain header
        )


@pytest.fixture
def extra_pods(node: Node) -> Iterator[list[Pod]]:
    """Two pods of their own (not attached by the session datapath)."""
    pods, servers = [], []
    v4 = node.a.v4.rsplit(".", 1)[0]
    v6 = node.a.v6.rsplit("::", 1)[0]
    try:
        for idx, letter in ((61, "p"), (62, "q")):
            name = f"{node.run_id}{letter}"
            ip6 = str(ipaddress.ip_address(f"{v6}::{idx}"))
            net = netns.create_pod(name, name, [f"{v4}.{idx}", ip6])
            pods.append(Pod(name, net, ep_id=idx, identity=2000 + idx, v4=f"{v4}.{idx}", v6=ip6))
            servers.append(EchoServer(name, TCP_PORTS, UDP_PORTS))
        yield pods
    finally:
        for server in servers:
            server.close()
        for pod in pods:
            netns.delete_pod(pod.net)


def test_detach_endpoint_removes_programs_and_state(net: Node, extra_pods: list[Pod]) -> None:
    dp, a = net.dp, net.a
    p = extra_pods[0]
    dp.attach_endpoint(p.spec)
    dp.sync_policy(p.ep_id, Enforcement(ingress=True), [])
    assert not tcp_exchange(a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
    assert any(e.id == p.ep_id and e.attached for e in dp.pinned_endpoints())
    assert dp.counters().packets(endpoint_id=p.ep_id, reason=Reason.DEFAULT_DENY, direction=Direction.INGRESS) >= 1

    assert dp.detach_endpoint(p.ep_id)
    assert not dp.detach_endpoint(p.ep_id)
    assert not dp._loader.attachment(p.net.host_ifindex).complete
    assert all(e.id != p.ep_id for e in dp.pinned_endpoints())
    assert dp.dump_policy(p.ep_id) == (Enforcement(), [])
    assert tcp_exchange(a.name, p.v4, 8080), "no program, no policy"

    dp.attach_endpoint(p.spec)
    try:
        # Its counters went with it: the default-deny drops are gone. The exchange just made may
        # still have a closing segment in flight, which the program (no policy now) passes as
        # not enforced; nothing else may be counted.
        counters = dp.counters()
        assert counters.packets(endpoint_id=p.ep_id, reason=Reason.DEFAULT_DENY) == 0, "the id starts from zero"
        assert counters.packets(endpoint_id=p.ep_id) == counters.packets(
            endpoint_id=p.ep_id, reason=Reason.NOT_ENFORCED
        )
    finally:
        dp.detach_endpoint(p.ep_id)


def test_an_endpoint_whose_veth_is_deleted_first_detaches_to_nothing(net: Node, extra_pods: list[Pod]) -> None:
    """How a pod of its own veth is deleted: the veth goes first (its tcx links go with it, where
    detaching them first costs a grace period each), then the endpoint: no pin, entry or program is left."""
    dp = net.dp
    p = extra_pods[1]
    dp.attach_endpoint(p.spec)
    dp.sync_policy(p.ep_id, Enforcement(ingress=True), [])
    links = os.path.dirname(dp._loader._link_path(p.net.host_ifindex, "from_container"))
    assert dp._loader.attachment(p.net.host_ifindex).complete
    assert dp._loader.mechanism != "tcx" or os.listdir(links)

    netns.delete_pod(p.net)
    assert dp.detach_endpoint(p.ep_id)
    assert not os.path.exists(links)
    assert all(e.id != p.ep_id for e in dp.pinned_endpoints())
    assert dp.dump_policy(p.ep_id) == (Enforcement(), [])
    assert not dp.detach_endpoint(p.ep_id)


def test_a_chained_delete_leaves_its_links_to_the_veths_deletion_and_the_reap_releases_them(
    net: Node, extra_pods: list[Pod]
) -> None:
    """A chained DEL: the other plugin deletes the veth next, so its tcx links are not detached
    (a grace period each); the endpoint leaves the maps at once and its programs pass everything."""
    dp, a = net.dp, net.a
    if dp._loader.mechanism != "tcx":
        pytest.skip("deferred only for tcx links (tc filters are not pinned and go with the veth)")
    p, q = extra_pods
    for pod in (p, q):
        dp.attach_endpoint(pod.spec)
        dp.sync_policy(pod.ep_id, Enforcement(ingress=True), [])
    assert not tcp_exchange(a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
    links = {
        pod.ep_id: os.path.dirname(dp._loader._link_path(pod.net.host_ifindex, "from_container")) for pod in (p, q)
    }

    assert dp.detach_endpoint(p.ep_id, veth_going=True)
    assert all(e.id != p.ep_id for e in dp.pinned_endpoints())
    assert dp.dump_policy(p.ep_id) == (Enforcement(), [])
    assert dp._loader.attachment(p.net.host_ifindex).complete and os.listdir(links[p.ep_id])
    assert tcp_exchange(a.name, p.v4, 8080), "no endpoint is the programs': they pass"

    # Reattached before the reap (the same veth under a new endpoint): the reap leaves it alone.
    again = dataclasses.replace(p.spec, id=p.ep_id + 2)
    dp.attach_endpoint(again)
    dp.sync_policy(again.id, Enforcement(ingress=True), [])
    try:
        dp.reap_links()
        assert dp._loader.attachment(p.net.host_ifindex).complete
        assert not tcp_exchange(a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
        assert dp.detach_endpoint(again.id, veth_going=True)
    finally:
        dp.detach_endpoint(again.id)

    # The other plugin deletes q's veth (its links go defunct); p's stays: the reap releases both.
    assert dp.detach_endpoint(q.ep_id, veth_going=True)
    netns.delete_pod(q.net)
    assert os.listdir(links[q.ep_id])
    assert dp.reap_links() >= 2
    assert not os.path.exists(links[p.ep_id]) and not os.path.exists(links[q.ep_id])
    assert not dp._loader.attachment(p.net.host_ifindex).programs
    assert tcp_exchange(a.name, p.v4, 8080)
    assert net.a.ep_id in {e.id for e in dp.pinned_endpoints() if e.attached}, "live endpoints keep theirs"
    assert dp._loader.attachment(net.a.net.host_ifindex).complete


def test_a_veth_attached_again_under_another_endpoint_is_judged_as_that_endpoint(
    net: Node, extra_pods: list[Pod]
) -> None:
    """The programs cache each veth's endpoint per CPU; no packet may see the earlier one."""
    dp, a = net.dp, net.a
    p = extra_pods[0]
    dp.attach_endpoint(p.spec)
    try:
        for _ in range(3):  # through the caches of whichever CPUs carry it
            assert tcp_exchange(a.name, p.v4, 8080)
        dp.detach_endpoint(p.ep_id)
        again = dataclasses.replace(p.spec, id=p.ep_id + 2)
        dp.attach_endpoint(again)
        dp.sync_policy(again.id, Enforcement(ingress=True), [])
        for _ in range(3):
            assert not tcp_exchange(a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
        assert dp.counters().packets(endpoint_id=again.id, reason=Reason.DEFAULT_DENY) >= 3
        dp.set_identity(again.id, p.identity + 1)
        dp.sync_policy(again.id, Enforcement(ingress=True), [])
        dp.read_flows(0)
        assert not tcp_exchange(a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
        flows = [f for f in dp.read_flows(500) if f.endpoint_id == again.id]
        assert flows and all(f.destination_identity == p.identity + 1 for f in flows), flows
    finally:
        dp.detach_endpoint(p.ep_id)
        dp.detach_endpoint(p.ep_id + 2)


def test_a_counters_map_of_an_older_layout_is_recreated_and_the_rest_kept(bpf_base: str) -> None:
    base = bpf_base + "-upgrade"
    ensure_bpffs(base)
    old = MapSpec(metricsmap.NAME, MapType.PERCPU_HASH, 8, 16, 65536)  # the per-CPU hash counters once were
    PinnedMap.open_or_create(base, old).close()
    dp = Datapath.open(base)
    try:
        pinned = PinnedMap.open_any(base, metricsmap.NAME)
        assert pinned.spec.type is MapType.PERCPU_ARRAY
        pinned.close()
        assert dp.counters().events_lost == 0
    finally:
        dp.teardown()
    assert not os.path.exists(base)


def test_the_highest_endpoint_id_the_metrics_map_holds_is_counted_and_the_next_refused(
    node: Node, extra_pods: list[Pod], bpf_base: str
) -> None:
    p, q = extra_pods  # endpoint ids 61 and 62
    base = bpf_base + "-bound"
    dp = Datapath.open(base, config=ProgramConfig(sizes=MapSizes(metrics=(p.ep_id + 1) * metricsmap.SLOTS)))
    try:
        assert dp.max_endpoint_id == p.ep_id
        with pytest.raises(ValueError, match=f"endpoint id {q.ep_id} is past {p.ep_id}, the highest the metrics map"):
            dp.attach_endpoint(q.spec)
        assert dp.pinned_endpoints() == []

        dp.attach_endpoint(p.spec)
        dp.sync_policy(p.ep_id, Enforcement(ingress=True), [])
        assert not tcp_exchange(node.a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
        counters = dp.counters()
        assert counters.packets(endpoint_id=p.ep_id, reason=Reason.DEFAULT_DENY, direction=Direction.INGRESS) >= 1
    finally:
        dp.teardown()
    assert not os.path.exists(base)


RESTORE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from services.datapath.datapath import Datapath
    from services.datapath.types import Direction, Enforcement, PolicyEntry, PolicyKey, L4Proto, Reason

    base, ep, identity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dp = Datapath.open(base)
    enforcement, entries = dp.dump_policy(ep)
    report = {
        "origin": dp.template.origin,
        "endpoints": [
            [e.id, e.identity, e.attached, list(e.ips), e.enforcement.ingress] for e in dp.pinned_endpoints()
        ],
        "entries": [[e.key.remote_identity, e.key.port_low, e.verdict.value] for e in entries],
        "default_deny": dp.counters().packets(endpoint_id=ep, reason=Reason.DEFAULT_DENY),
    }
    dp.apply_policy(ep, enforcement, add=[PolicyEntry(PolicyKey(Direction.INGRESS, identity, L4Proto.TCP, 8081))])
    dp.close()
    print(json.dumps(report))
    """
)

SETUP_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from services.datapath.datapath import Datapath
    from services.datapath.types import Direction, EndpointSpec, Enforcement, PolicyEntry, PolicyKey, L4Proto

    base = sys.argv[1]
    p, q = [a.split(",") for a in sys.argv[2:4]]
    dp = Datapath.open(base)
    for ep, ifindex, name, identity, *ips in (p, q):
        dp.attach_endpoint(EndpointSpec(int(ep), int(ifindex), name, tuple(ips), int(identity)))
    dp.sync_policy(int(q[0]), Enforcement(ingress=True),
                   [PolicyEntry(PolicyKey(Direction.INGRESS, int(p[3]), L4Proto.TCP, 8080))])
    print("ready", flush=True)
    time.sleep(600)  # killed by the test: nothing is closed or cleaned up
    """
)


def _pod_arg(pod: Pod) -> str:
    return ",".join([str(pod.ep_id), str(pod.net.host_ifindex), pod.net.host_ifname, str(pod.identity), *pod.net.ips])


def test_enforcement_outlives_the_process_and_a_new_one_restores(
    node: Node, extra_pods: list[Pod], bpf_base: str
) -> None:
    p, q = extra_pods
    base = bpf_base + "-restore"
    env = {**os.environ, "PYTHONPATH": ROOT}
    setup = subprocess.Popen(
        [sys.executable, "-c", SETUP_SCRIPT, base, _pod_arg(p), _pod_arg(q)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert setup.stdout is not None
        line = setup.stdout.readline()
        assert line.strip() == "ready", setup.stderr.read() if setup.stderr else ""
        setup.send_signal(signal.SIGKILL)
        setup.wait(10)

        # Nobody holds the datapath open: the programs and pinned maps still enforce, and the pinned
        # program array still holds deliver (no packet of the exchange went through the host).
        with host_sent((p, q), p, q) as forwarded:
            assert tcp_exchange(p.name, q.v4, 8080)
            assert forwarded() == 0
        assert not tcp_exchange(p.name, q.v4, 8081, timeout=DENY_TIMEOUT)
        assert not tcp_exchange(p.name, q.v6, 8081, timeout=DENY_TIMEOUT)

        restore = subprocess.run(
            [sys.executable, "-c", RESTORE_SCRIPT, base, str(q.ep_id), str(p.identity)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert restore.returncode == 0, restore.stderr
        report = json.loads(restore.stdout.strip().splitlines()[-1])
        assert report["origin"] == "pinned", "the restarted process reused the pinned programs"
        assert sorted(map(tuple, (e[:3] for e in report["endpoints"]))) == [
            (p.ep_id, p.identity, True),
            (q.ep_id, q.identity, True),
        ]
        assert next(e for e in report["endpoints"] if e[0] == q.ep_id)[3:] == [sorted(q.net.ips), True]
        assert report["entries"] == [[p.identity, 8080, "allow"]]
        assert report["default_deny"] >= 2, "the drops made while no process was up were counted"

        # The restoring process's change is live after it closed.
        assert tcp_exchange(p.name, q.v4, 8081)

        dp = Datapath.open(base)
        try:
            assert {(e.id, e.template) for e in dp.pinned_endpoints()} == {
                (p.ep_id, dp.template.short),
                (q.ep_id, dp.template.short),
            }
            assert drops(dp, q.ep_id) >= 2
            dp.apply_policy(
                q.ep_id,
                Enforcement(ingress=True),
                remove=[entry(Direction.INGRESS, p.identity, L4Proto.TCP, 8081)],
            )
        finally:
            dp.close()
        assert not tcp_exchange(p.name, q.v4, 8081, timeout=DENY_TIMEOUT)
    finally:
        if setup.poll() is None:
            setup.kill()
            setup.wait(10)
        # The no-compile cleanup path: detaches by the pinned endpoints map, unpins everything.
        assert teardown_all(base)
    assert not os.path.exists(base)
    assert not teardown_all(base)
    probe = Loader(bpf_base)
    try:
        assert not any(probe.attachment(pod.net.host_ifindex).complete for pod in (p, q))
    finally:
        probe.close()
    assert tcp_exchange(p.name, q.v4, 8081), "teardown removed the programs"


def test_policy_before_attach_is_enforced_from_the_first_packet(net: Node, extra_pods: list[Pod]) -> None:
    dp, a = net.dp, net.a
    p = extra_pods[0]
    dp.sync_policy(p.ep_id, Enforcement(ingress=True), [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    dp.attach_endpoint(EndpointSpec(p.ep_id, p.net.host_ifindex, p.net.host_ifname, p.net.ips, p.identity))
    try:
        assert tcp_exchange(a.name, p.v4, 8080)
        assert not tcp_exchange(a.name, p.v4, 8081, timeout=DENY_TIMEOUT)
        assert dp.dump_policy(p.ep_id)[1] == [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)]
    finally:
        dp.detach_endpoint(p.ep_id)


def test_tc_and_tcx_attachments_enforce_alike_and_replace_each_other(
    net: Node, extra_pods: list[Pod], bpf_base: str
) -> None:
    """The tc fallback (kernels before 6.6) enforces as tcx does; either replaces the other in place."""
    dp, a = net.dp, net.a
    p = extra_pods[0]
    ifindex = p.net.host_ifindex
    dp.sync_policy(p.ep_id, Enforcement(ingress=True), [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    dp.attach_endpoint(p.spec)
    tc = Loader(bpf_base, "tc")
    try:
        assert dp._loader.mechanism == "tcx" and tc.mechanism == "tc"
        with streams((a.name, p.v4, 8080)) as (stream,):
            for loader, mechanism, filters in ((tc, "tc", 2), (dp._loader, "tcx", 0), (tc, "tc", 2)):
                if loader is tc:
                    tc.attach(dp.template, ifindex)
                else:
                    dp.attach_endpoint(p.spec)
                attachment = dp._loader.attachment(ifindex)
                assert (attachment.mechanism, attachment.programs) == (mechanism, 2)
                assert attachment.template() == dp.template.short
                assert _bpf_filter_count(ifindex) == filters
                assert os.path.isdir(os.path.join(bpf_base, "links", str(ifindex))) == (mechanism == "tcx")
                assert stream.ping(), f"established flows continue onto {mechanism}"
                assert tcp_exchange(a.name, p.v4, 8080)
                assert not tcp_exchange(a.name, p.v4, 8081, timeout=DENY_TIMEOUT), f"{mechanism} enforces"
        assert dp.detach_endpoint(p.ep_id)
        assert dp._loader.attachment(ifindex) == tc.attachment(ifindex)
        assert not dp._loader.attachment(ifindex).complete and _bpf_filter_count(ifindex) == 0
        assert tcp_exchange(a.name, p.v4, 8081), "detached: nothing enforces"
    finally:
        tc.close()


def test_tc_filters_are_replaced_in_place_and_a_refusal_names_its_step(
    net: Node, extra_pods: list[Pod], bpf_base: str
) -> None:
    """The tc attach (qdisc and both filters in one netlink send): again is a replace, not a third
    filter; detach says whether there was an attachment; a missing veth is refused by name."""
    dp = net.dp
    ifindex = extra_pods[0].net.host_ifindex
    tc = Loader(bpf_base, "tc")
    try:
        for _ in range(2):
            tc.attach(dp.template, ifindex)
            attachment = tc.attachment(ifindex)
            assert (attachment.mechanism, attachment.programs, attachment.template()) == ("tc", 2, dp.template.short)
            assert _bpf_filter_count(ifindex) == 2
        assert tc.detach(ifindex) and _bpf_filter_count(ifindex) == 0
        assert not tc.detach(ifindex), "nothing left to detach"
        missing = ifindex + 100000
        with pytest.raises(OSError, match=f"adding the clsact qdisc to interface {missing}: No such device"):
            tc.attach(dp.template, missing)
    finally:
        tc.close()


def test_a_pinned_link_of_another_veth_is_replaced(net: Node, extra_pods: list[Pod], bpf_base: str) -> None:
    """A link pinned for an ifindex whose veth was deleted (and the number reused) is not updated but
    replaced: updating it would run the program on the wrong veth, or on none."""
    from services.datapath.maps.bpf import BPF_TCX_INGRESS, link_create, obj_pin

    dp, a = net.dp, net.a
    p, q = extra_pods
    dp.sync_policy(p.ep_id, Enforcement(ingress=True), [])
    path = os.path.join(bpf_base, "links", str(p.net.host_ifindex), "from_container")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    stray = link_create(dp.template.from_container_fd, q.net.host_ifindex, BPF_TCX_INGRESS)
    try:
        obj_pin(stray, path)
    finally:
        os.close(stray)
    assert dp._loader.attachment(q.net.host_ifindex).from_container == dp.template.short
    dp.attach_endpoint(p.spec)
    try:
        assert dp._loader.attachment(p.net.host_ifindex).programs == 2
        assert dp._loader.attachment(q.net.host_ifindex).from_container is None, "the stray link is gone"
        assert not tcp_exchange(a.name, p.v4, 8080, timeout=DENY_TIMEOUT)
    finally:
        dp.detach_endpoint(p.ep_id)


def test_unknown_attach_mode_is_refused(bpf_base: str) -> None:
    with pytest.raises(ValueError, match="attach mode 'xdp': give one of auto, tcx, tc"):
        Loader(bpf_base, "xdp")


def test_auto_falls_back_to_tc_where_the_kernel_has_no_tcx(
    net: Node, extra_pods: list[Pod], bpf_base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel before 6.6 answers a tcx link with EINVAL: "auto" attaches with tc filters from
    then on; "tcx" asked for explicitly fails instead."""
    import errno as errnos

    from services.datapath import loader as loader_module
    from services.datapath.maps.bpf import BpfError

    def no_tcx(prog_fd: int, ifindex: int, attach_type: int) -> int:
        raise BpfError(errnos.EINVAL, "bpf_link_create: Invalid argument")

    dp, a = net.dp, net.a
    p = extra_pods[0]
    ifindex = p.net.host_ifindex
    dp.sync_policy(p.ep_id, Enforcement(ingress=True), [entry(Direction.INGRESS, a.identity, L4Proto.TCP, 8080)])
    dp.attach_endpoint(p.spec)
    assert dp._loader.detach(ifindex)  # registered in the maps, no program on the veth
    monkeypatch.setattr(loader_module, "link_create", no_tcx)
    strict, auto = Loader(bpf_base, "tcx"), Loader(bpf_base, "auto")
    try:
        with pytest.raises(BpfError, match="Invalid argument"):
            strict.attach(dp.template, p.net.host_ifindex + 100000)  # no such veth: nothing to undo
        assert auto.mechanism == "tcx"
        auto.attach(dp.template, ifindex)
        assert auto.mechanism == "tc", "the loader remembers the kernel has no tcx"
        attachment = auto.attachment(ifindex)
        assert (attachment.mechanism, attachment.programs, attachment.template()) == ("tc", 2, dp.template.short)
        assert not os.path.exists(os.path.join(bpf_base, "links", str(ifindex))), "the tcx links were removed"
        assert tcp_exchange(a.name, p.v4, 8080)
        assert not tcp_exchange(a.name, p.v4, 8081, timeout=DENY_TIMEOUT)
    finally:
        strict.close()
        auto.close()
        dp.detach_endpoint(p.ep_id)
    assert _bpf_filter_count(ifindex) == 0


def test_the_default_attach_follows_local_delivery(net: Node, extra_pods: list[Pod], bpf_base: str) -> None:
    """With local delivery a packet crosses one hook and tc filters (no grace period per attach) are
    the default; without it every packet crosses both, and the default is tcx links where the
    kernel has them. Asked for explicitly, either is kept."""
    p = extra_pods[0]
    ifindex = p.net.host_ifindex
    host_routed = dataclasses.replace(net.dp.config, local_delivery=False)
    for config, attach, mechanism in (
        (net.dp.config, "", "tc"),
        (host_routed, "", "tcx"),
        (host_routed, "tc", "tc"),
    ):
        dp = Datapath.open(bpf_base, config=config, attach=attach)
        try:
            dp.attach_endpoint(p.spec)
            assert dp._loader.attachment(ifindex).mechanism == mechanism, (config.local_delivery, attach)
            assert dp.detach_endpoint(p.ep_id)
        finally:
            dp.close()
