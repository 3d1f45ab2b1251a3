"""The pure parts of ipam: pool arithmetic, node CIDR priority, label classification, GC timing, pod parsing."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from palisade.v1 import common_pb2, k8s_pb2
from services.common.config import ConfigError, load_config
from services.common.errors import Code
from services.common.labels import LabelSet, ReservedIdentity
from services.common.podcidr import assignable_problem, capacity, gateway, host_range, next_free_address
from services.ipam import keys
from services.ipam.config import IPAMConfig, IPAMMode
from services.ipam.errors import IpamError
from services.ipam.gc import GcTracker
from services.ipam.model import CIDR_RANGE, CLUSTER_RANGE, Kind, carries, classify, kind_of
from services.ipam.nodecidr import CIDRSource, NodeCIDR, NodeRecord, desired
from services.ipam.podwatch import BadObject, ObjectKind, decode, host_prefix, parse_owner, parse_pod, pod_owner
from services.ipam.pool import next_free_subnet
from testkit.ipam import node, pod

net = ipaddress.ip_network


# -- pool --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clusters", "mask", "used", "expected"),
    [
        (["10.0.0.0/16"], 24, [], "10.0.0.0/24"),
        (["10.0.0.0/16"], 24, ["10.0.0.0/24", "10.0.1.0/24"], "10.0.2.0/24"),
        # A node CIDR from a node spec inside the pool blocks every subnet it overlaps.
        (["10.0.0.0/16"], 24, ["10.0.0.0/23"], "10.0.2.0/24"),
        (["10.0.0.0/16"], 24, ["10.0.0.128/25"], "10.0.1.0/24"),
        # Exhausted first cluster CIDR: carve from the next one.
        (["10.0.0.0/23", "10.1.0.0/16"], 24, ["10.0.0.0/24", "10.0.1.0/24"], "10.1.0.0/24"),
        (["10.0.0.0/23"], 24, ["10.0.0.0/24", "10.0.1.0/24"], None),
        (["fd00::/104"], 112, ["fd00::/112"], "fd00::1:0/112"),
        # A cluster CIDR smaller than a node CIDR yields nothing.
        (["10.0.0.0/25"], 24, [], None),
    ],
)
def test_next_free_subnet(clusters: list[str], mask: int, used: list[str], expected: str | None) -> None:
    got = next_free_subnet([net(c) for c in clusters], mask, [net(u) for u in used])
    assert (str(got) if got else None) == expected


@given(st.sets(st.integers(0, 63), max_size=64), st.integers(0, 63))
def test_next_free_subnet_never_overlaps_used(taken: set[int], extra: int) -> None:
    cluster = ipaddress.IPv4Network("10.8.0.0/18")
    subnets = list(cluster.subnets(new_prefix=24))
    used = [subnets[i] for i in taken] + [ipaddress.IPv4Network(f"10.8.{extra}.0/25")]
    got = next_free_subnet([cluster], 24, used)
    if got is None:
        assert all(any(s.overlaps(u) for u in used) for s in subnets)
    else:
        assert got in subnets and not any(got.overlaps(u) for u in used)


@pytest.mark.parametrize(
    ("cidr", "first", "last", "cap", "gw"),
    [
        ("10.0.0.0/24", "10.0.0.2", "10.0.0.254", 253, "10.0.0.1"),
        ("10.0.0.0/30", "10.0.0.2", "10.0.0.2", 1, "10.0.0.1"),
        ("fd00::/120", "fd00::2", "fd00::ff", 254, "fd00::1"),
    ],
)
def test_host_range_skips_network_gateway_broadcast(cidr: str, first: str, last: str, cap: int, gw: str) -> None:
    lo, hi = host_range(net(cidr))
    assert (str(ipaddress.ip_address(lo)), str(ipaddress.ip_address(hi))) == (first, last)
    assert capacity(net(cidr)) == cap
    assert str(gateway(net(cidr))) == gw


@given(st.sets(st.integers(2, 14)), st.one_of(st.none(), st.integers(0, 15)))
def test_next_free_address_is_free_and_assignable(used_offsets: set[int], after: int | None) -> None:
    cidr = net("10.0.0.0/28")
    used = {int(cidr.network_address) + o for o in used_offsets}
    got = next_free_address(cidr, used, None if after is None else int(cidr.network_address) + after)
    if got is None:
        assert len(used_offsets) == capacity(cidr)
    else:
        assert int(got) not in used
        assert assignable_problem(cidr, got) is None


def test_next_free_address_goes_round_robin_after_the_cursor() -> None:
    cidr = net("10.0.0.0/29")  # hosts .2 .. .6
    used = {int(ipaddress.ip_address("10.0.0.3"))}
    assert str(next_free_address(cidr, used, int(ipaddress.ip_address("10.0.0.2")))) == "10.0.0.4"
    assert str(next_free_address(cidr, used, int(ipaddress.ip_address("10.0.0.6")))) == "10.0.0.2"


@pytest.mark.parametrize(
    ("ip", "problem"),
    [
        ("10.0.0.5", None),
        ("10.0.0.0", "network"),
        ("10.0.0.1", "gateway"),
        ("10.0.0.255", "broadcast"),
        ("10.0.1.5", "outside"),
        ("fd00::5", "outside"),
    ],
)
def test_assignable_problem(ip: str, problem: str | None) -> None:
    got = assignable_problem(net("10.0.0.0/24"), ipaddress.ip_address(ip))
    assert (got is None) if problem is None else (got is not None and problem in got)


# -- node CIDR priority ------------------------------------------------------

V4_ANN = "io.cilium.network.ipv4-pod-cidr"


@pytest.mark.parametrize(
    ("obj", "mode", "v4", "v6"),
    [
        (
            node("n", pod_cidrs=["10.1.0.0/24"], annotations={V4_ANN: "10.2.0.0/24"}),
            IPAMMode.KUBERNETES,
            ("10.1.0.0/24", CIDRSource.NODE_SPEC),
            None,
        ),
        (
            node("n", annotations={V4_ANN: "10.2.0.0/24"}),
            IPAMMode.KUBERNETES,
            ("10.2.0.0/24", CIDRSource.ANNOTATION),
            None,
        ),
        (
            node("n", annotations={"network.cilium.io/ipv4-pod-cidr": "10.3.0.0/24"}),
            IPAMMode.KUBERNETES,
            ("10.3.0.0/24", CIDRSource.ANNOTATION),
            None,
        ),
        (node("n"), IPAMMode.KUBERNETES, None, None),
        (None, IPAMMode.KUBERNETES, None, None),
        # Per family: spec gives IPv4 only, the annotation fills in IPv6.
        (
            node("n", pod_cidrs=["10.1.0.0/24"], annotations={"io.cilium.network.ipv6-pod-cidr": "fd00:1::/112"}),
            IPAMMode.KUBERNETES,
            ("10.1.0.0/24", CIDRSource.NODE_SPEC),
            ("fd00:1::/112", CIDRSource.ANNOTATION),
        ),
        # A typo falls through to the next source instead of breaking the node.
        (
            node("n", pod_cidrs=["10.1.0.0/33"], annotations={V4_ANN: "10.2.0.0/24"}),
            IPAMMode.KUBERNETES,
            ("10.2.0.0/24", CIDRSource.ANNOTATION),
            None,
        ),
        (node("n", annotations={V4_ANN: "nonsense"}), IPAMMode.KUBERNETES, None, None),
        # Cluster-pool mode: the pool always decides.
        (node("n", pod_cidrs=["10.1.0.0/24"], annotations={V4_ANN: "10.2.0.0/24"}), IPAMMode.CLUSTER_POOL, None, None),
    ],
)
def test_node_cidr_priority_spec_over_annotation_over_pool(
    obj: dict[str, Any] | None, mode: IPAMMode, v4: tuple[str, CIDRSource] | None, v6: tuple[str, CIDRSource] | None
) -> None:
    got, _problems = desired(obj, (4, 6), mode)
    expect = {4: v4, 6: v6}
    for family in (4, 6):
        found = got[family]
        assert ((str(found.cidr), found.source) if found else None) == expect[family]


def test_node_cidr_problems_are_reported() -> None:
    _, problems = desired(node("n", annotations={V4_ANN: "nonsense"}), (4,), IPAMMode.KUBERNETES)
    assert problems and V4_ANN in problems[0]


def test_node_record_round_trips_through_json() -> None:
    record = NodeRecord(
        "n", (NodeCIDR(net("10.0.0.0/24"), CIDRSource.POOL), NodeCIDR(net("fd00::/112"), CIDRSource.POOL))
    )
    again = NodeRecord.from_json("n", record.to_json(), 7)
    assert again.cidrs == record.cidrs and again.mod_revision == 7 and again.source == CIDRSource.POOL


# -- identities --------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "kind", "reserved"),
    [
        (["k8s:app=web", "k8s:io.kubernetes.pod.namespace=x"], Kind.CLUSTER, None),
        (["reserved:host"], Kind.RESERVED, ReservedIdentity.HOST),
        (["reserved:host", "k8s:node=a"], Kind.RESERVED, ReservedIdentity.HOST),
        (["reserved:world"], Kind.RESERVED, ReservedIdentity.WORLD),
        (["reserved:kube-apiserver"], Kind.RESERVED, ReservedIdentity.KUBE_APISERVER),
        (["cidr:10.0.0.0/8"], Kind.CIDR, None),
        (["cidr:10.0.0.0/8", "reserved:world"], Kind.CIDR, None),
        (["cidr:fd00--/8"], Kind.CIDR, None),
    ],
)
def test_classify(labels: list[str], kind: Kind, reserved: ReservedIdentity | None) -> None:
    got_kind, got_labels, got_reserved = classify(LabelSet.of(labels))
    assert got_kind == kind
    assert (got_reserved.id if got_reserved else None) == (int(reserved) if reserved else None)
    if kind == Kind.CIDR:
        assert "reserved:world" in got_labels.to_strings()


def test_classify_drops_noisy_labels_so_pods_of_one_deployment_share_an_identity() -> None:
    a = classify(LabelSet.of(["k8s:app=web", "k8s:pod-template-hash=abc"]))[1]
    b = classify(LabelSet.of(["k8s:app=web", "k8s:pod-template-hash=def"]))[1]
    assert a == b == LabelSet.of(["k8s:app=web"])


@pytest.mark.parametrize(
    "labels",
    [
        [],
        ["k8s:pod-template-hash=x"],
        ["reserved:world", "k8s:app=x"],
        ["cidr:10.0.0.0/8", "cidr:11.0.0.0/8"],
        ["cidr:10.0.0.0/8", "k8s:app=x"],
        ["cidr:not-a-prefix"],
        ["reserved:unknown-thing"],
    ],
)
def test_classify_rejects_what_cannot_be_an_identity(labels: list[str]) -> None:
    with pytest.raises(IpamError) as err:
        classify(LabelSet.of(labels))
    assert err.value.code == Code.INVALID_ARGUMENT


def test_identity_ranges_are_disjoint_and_kinds_follow() -> None:
    assert CLUSTER_RANGE.high < CIDR_RANGE.low
    assert (kind_of(3), kind_of(256), kind_of(65535), kind_of(1 << 24)) == (
        Kind.RESERVED,
        Kind.CLUSTER,
        Kind.CLUSTER,
        Kind.CIDR,
    )


def test_carries_matches_any_source_for_unspec() -> None:
    labels = LabelSet.of(["k8s:app=web"])
    assert carries(labels, LabelSet.of(["unspec:app=web"]).labels[0])
    assert carries(labels, LabelSet.of(["k8s:app=web"]).labels[0])
    assert not carries(labels, LabelSet.of(["k8s:app=db"]).labels[0])
    assert not carries(labels, LabelSet.of(["container:app=web"]).labels[0])


# -- collector timing --------------------------------------------------------


def test_gc_waits_the_grace_period_and_restarts_it_on_use() -> None:
    gc = GcTracker(grace=10)
    assert gc.observe({300: 5, 301: 5}, referenced={301}, now=0) == []
    assert gc.observe({300: 5, 301: 5}, referenced={301}, now=9) == []
    assert gc.observe({300: 5, 301: 5}, referenced={301}, now=10) == [(300, 5)]
    # A reference taken and dropped between passes rewrote the id key: the wait starts over.
    assert gc.observe({300: 8}, referenced=set(), now=11) == []
    assert gc.observe({300: 8}, referenced=set(), now=20) == []
    assert gc.observe({300: 8}, referenced=set(), now=21) == [(300, 8)]
    # Referenced again: forgotten.
    gc.observe({300: 8}, referenced={300}, now=22)
    assert gc.pending() == 0


def test_gc_zero_grace_collects_on_first_sight() -> None:
    assert GcTracker(grace=0).observe({400: 1}, referenced=set(), now=5) == [(400, 1)]


# -- pods --------------------------------------------------------------------


def _delta(
    obj: dict[str, Any],
    op: k8s_pb2.DeltaOp.ValueType = k8s_pb2.DELTA_OP_UPSERT,
    kind: k8s_pb2.K8sKind.ValueType = k8s_pb2.K8S_KIND_POD,
) -> k8s_pb2.K8sDelta:
    meta = obj.get("metadata", {})
    return k8s_pb2.K8sDelta(
        kind=kind,
        op=op,
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        object_json=json.dumps(obj).encode(),
    )


def test_decode_pod_and_parse_its_addresses_ports_and_state() -> None:
    obj = pod("ns", "p", {"app": "web"}, node="n1", ip="10.0.0.7", ports={"http": 8080})
    obj["status"]["podIPs"] = [{"ip": "fd00::7"}, {"ip": "10.0.0.7"}]
    change = decode(_delta(obj))
    assert change is not None and change.kind == ObjectKind.POD and change.obj is not None
    p = parse_pod(change)
    assert p.ips == ("10.0.0.7", "fd00::7")
    assert p.named_ports[0][0] == "http" and p.named_ports[0][1].port == 8080
    assert p.named_ports[0][1].protocol == common_pb2.PROTOCOL_TCP
    assert p.active and p.owner == "pod/ns/p"


@pytest.mark.parametrize(
    ("mutate", "active"),
    [
        (lambda o: o["spec"].pop("nodeName"), False),
        (lambda o: o["status"].update(phase="Succeeded"), False),
        (lambda o: o["status"].update(phase="Failed"), False),
        (lambda o: o["spec"].update(hostNetwork=True), False),
        (lambda o: o["status"].update(phase="Pending"), True),
    ],
)
def test_pod_active(mutate, active: bool) -> None:
    obj = pod("ns", "p", {"app": "web"})
    mutate(obj)
    change = decode(_delta(obj))
    assert change is not None
    assert parse_pod(change).active is active


def test_decode_tombstone_other_kinds_and_bad_json() -> None:
    gone = decode(k8s_pb2.K8sDelta(kind=k8s_pb2.K8S_KIND_POD, op=k8s_pb2.DELTA_OP_DELETE, namespace="a", name="b"))
    assert gone is not None and gone.obj is None
    assert decode(k8s_pb2.K8sDelta(kind=k8s_pb2.K8S_KIND_NETWORK_POLICY, op=k8s_pb2.DELTA_OP_UPSERT)) is None
    with pytest.raises(BadObject, match="pod a/b: object_json is not JSON"):
        decode(
            k8s_pb2.K8sDelta(
                kind=k8s_pb2.K8S_KIND_POD, op=k8s_pb2.DELTA_OP_UPSERT, namespace="a", name="b", object_json=b"{nope"
            )
        )


def test_owner_and_prefix_helpers() -> None:
    assert parse_owner(pod_owner("ns", "p")) == ("ns", "p")
    assert parse_owner("endpoint/12") is None
    assert host_prefix("10.0.0.1") == "10.0.0.1/32" and host_prefix("fd00::1") == "fd00::1/128"


def test_keys_round_trip_owners_with_slashes() -> None:
    assert keys.parse_identity_ref(keys.identity_ref(300, "n1", "pod/ns/p")) == (300, "n1", "pod/ns/p")
    assert keys.parse_identity_owner(keys.identity_owner("n1", "pod/ns/p")) == ("n1", "pod/ns/p")
    assert keys.parse_ipam_ip(keys.ipam_ip("n1", "fd00::5")) == ("n1", "fd00::5")
    assert keys.identity_ref(30, "n", "o").startswith(keys.identity_refs_of(30))
    assert not keys.identity_ref(300, "n", "o").startswith(keys.identity_refs_of(30))


# -- config ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--ipam-mode", "magic"], "--ipam-mode"),
        (["--cluster-cidrs", "10.0.0.0/33"], "--cluster-cidrs"),
        (["--cluster-cidrs", "10.0.0.1/16"], "--cluster-cidrs"),
        (["--node-mask-v4", "31"], "--node-mask-v4"),
        (["--cluster-cidrs", "10.0.0.0/24", "--node-mask-v4", "16"], "--node-mask-v4"),
        (["--identity-lease-ttl", "1"], "--identity-lease-ttl"),
        (["--identity-gc-grace", "-1"], "--identity-gc-grace"),
    ],
)
def test_config_rejects_bad_values_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        load_config(IPAMConfig, argv, env={})


def test_config_dual_stack() -> None:
    cfg = load_config(IPAMConfig, ["--cluster-cidrs", "10.0.0.0/16, fd00::/104", "--ipam-mode", "kubernetes"], env={})
    assert [n.version for n in cfg.cluster_networks()] == [4, 6] and cfg.mode == IPAMMode.KUBERNETES
