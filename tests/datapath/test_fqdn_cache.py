"""The DNS proxy's pure parts: name matching, the learned-name cache, its disk form, rule decoding."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from palisade.v1 import common_pb2
from palisade.v1 import common_pb2 as pb
from services.common.fqdn import matches as match
from services.datapath import wire
from services.datapath.dnsnames import Published, decode, encode, steering_of
from services.datapath.dnsproxy import Decision, ProxyConfig, judge, rule_allows
from services.datapath.errors import OrderError
from services.datapath.fqdncache import CacheLimits, NameCache
from services.datapath.fqdnmaps import CidrPrefixes, NameEndpoint, NameMaps, desired
from services.datapath.fqdnstore import NameStore
from services.datapath.types import (
    IDENTITY_WORLD,
    Direction,
    DnsRule,
    FqdnRule,
    L4Proto,
    NameRules,
    PolicyChange,
    PolicyEntry,
    PolicyKey,
    Verdict,
    is_local_identity,
)
from services.datapath.types import (
    MAX_LOCAL_IDENTITY as MAX_LOCAL_ID,
)
from services.datapath.types import (
    MIN_LOCAL_IDENTITY as MIN_LOCAL_ID,
)


@pytest.mark.parametrize(
    ("selector", "name", "expected"),
    [
        ("api.example.test", "api.example.test", True),
        ("api.example.test", "API.Example.Test.", True),
        ("api.example.test", "x.api.example.test", False),
        ("*", "anything.test", True),
        ("*.example.test", "api.example.test", True),
        ("*.example.test", "example.test", False),
        ("*.example.test", "a.b.example.test", False),
        ("api-*.example.test", "api-eu1.example.test", True),
        ("api-*.example.test", "api.example.test", False),
        ("*.example.test", "apiexample.test", False),
    ],
)
def test_match(selector: str, name: str, expected: bool) -> None:
    assert match(selector, name) is expected


def test_local_identities_never_collide_with_cluster_or_cidr_ones() -> None:
    from services.ipam import model

    assert MIN_LOCAL_ID > model.MAX_CIDR_ID and MIN_LOCAL_ID > model.MAX_CLUSTER_ID
    assert is_local_identity(MIN_LOCAL_ID) and is_local_identity(MAX_LOCAL_ID)
    assert not is_local_identity(model.MAX_CIDR_ID) and not is_local_identity(MAX_LOCAL_ID + 1)


def test_ttl_floor_and_expiry_kept_while_in_use() -> None:
    cache = NameCache(CacheLimits(min_ttl=30))
    cache.learn(1, "a.test", [("192.0.2.1", 1)], now=100)
    assert cache.expire(now=120, in_use=set()) == [], "raised to the 30 s floor"
    assert cache.expire(now=131, in_use={"192.0.2.1"}) == [], "an open connection keeps it"
    assert cache.expire(now=131, in_use=set()) == [("a.test", "192.0.2.1")]
    assert cache.ipcache() == {}


def test_per_name_bound_evicts_the_oldest() -> None:
    cache = NameCache(CacheLimits(max_per_name=2))
    lookup = cache.learn(1, "s3.test", [("192.0.2.1", 60), ("192.0.2.2", 60), ("192.0.2.3", 60)], now=0)
    assert lookup.evicted == (("s3.test", "192.0.2.1"),)
    cache.learn(1, "s3.test", [("192.0.2.2", 60)], now=1)  # re-answered: now the newest
    cache.learn(1, "s3.test", [("192.0.2.4", 60)], now=2)
    assert cache.names() == {"s3.test": ["192.0.2.2", "192.0.2.4"]}


def test_per_endpoint_bound_releases_only_that_endpoints_hold() -> None:
    cache = NameCache(CacheLimits(max_per_endpoint=2))
    cache.learn(2, "a.test", [("192.0.2.1", 60)], now=0)
    cache.learn(1, "a.test", [("192.0.2.1", 60)], now=0)
    cache.learn(1, "b.test", [("192.0.2.2", 60)], now=1)
    cache.learn(1, "c.test", [("192.0.2.3", 60)], now=2)
    # Endpoint 1 let go of a.test's pair, which endpoint 2 still holds.
    assert cache.names() == {"a.test": ["192.0.2.1"], "b.test": ["192.0.2.2"], "c.test": ["192.0.2.3"]}
    cache.learn(1, "d.test", [("192.0.2.4", 60)], now=3)
    assert "b.test" not in cache.names()


def test_one_identity_per_address_freed_when_unused() -> None:
    cache = NameCache()
    cache.learn(1, "a.test", [("192.0.2.1", 1)], now=0)
    cache.learn(1, "b.test", [("192.0.2.1", 60)], now=0)
    ident = cache.identity("192.0.2.1")
    assert ident is not None and is_local_identity(ident)
    cache.expire(now=10, in_use=set())
    assert cache.identity("192.0.2.1") == ident, "b.test still holds the address"
    cache.expire(now=100, in_use=set())
    assert cache.identity("192.0.2.1") is None


def test_store_restores_snapshot_and_journal(tmp_path: pytest.TempPathFactory) -> None:
    limits = CacheLimits(min_ttl=0, max_per_name=2)
    store = NameStore(str(tmp_path))
    cache = NameCache(limits)
    cache.learn(7, "a.test", [("192.0.2.1", 60)], now=10)
    store.compact(cache, now=10, wall=1000)
    for ip in ("192.0.2.2", "192.0.2.3"):
        cache.learn(7, "a.test", [(ip, 60)], now=11)
        store.append(7, "a.test", [(ip, 60)], wall=1001)
    store.close()
    with open(store.journal_path, "a") as f:
        f.write('{"endpoint": 7, "name"')  # cut short by a kill
    restored = NameStore(str(tmp_path)).load(limits, now=500, wall=1010)
    assert restored.names() == cache.names() == {"a.test": ["192.0.2.2", "192.0.2.3"]}
    assert restored.identity("192.0.2.2") == cache.identity("192.0.2.2")
    # Expiries carried over in wall-clock time: learned 9 s before the restart, 60 s TTL.
    assert restored.expire(now=500 + 50, in_use=set()) == []
    assert len(restored.expire(now=500 + 52, in_use=set())) == 2


def test_store_rejects_a_bad_snapshot_by_name(tmp_path: pytest.TempPathFactory) -> None:
    store = NameStore(str(tmp_path))
    with open(store.snapshot_path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"fqdn\.json.*move the file away"):
        store.load(CacheLimits(), now=0, wall=0)


RULES = NameRules(
    fqdn=(FqdnRule("*.example.test", L4Proto.TCP, 443),),
    dns=(DnsRule(0, L4Proto.ANY, 53, ("*.example.test",)), DnsRule(0, L4Proto.UDP, 5353, ("*",))),
)


def test_desired_entries_for_every_selecting_endpoint() -> None:
    cache = NameCache()
    cache.learn(1, "api.example.test", [("192.0.2.1", 60)], now=0)
    cache.learn(1, "other.test", [("192.0.2.9", 60)], now=0)
    eps = [
        NameEndpoint(1, 1001, ("10.0.0.1",), RULES),
        NameEndpoint(2, 1002, ("10.0.0.2",), RULES),
        NameEndpoint(3, 1003, ("10.0.0.3",), NameRules()),
    ]
    ipcache, entries = desired(cache, eps, lambda ip: IDENTITY_WORLD)
    ident = cache.identity("192.0.2.1")
    assert ident is not None
    assert ipcache["192.0.2.1/32"] == ident
    assert set(entries[1]) == set(entries[2]) == {FqdnRule("*.example.test", L4Proto.TCP, 443).entry(ident)}
    assert not entries[3]


def test_steering_and_rule_checks() -> None:
    keys, problems = steering_of([NameEndpoint(1, 1001, ("10.0.0.1",), RULES)])
    assert keys == {(1, 53, 17), (1, 53, 6)}
    assert len(problems) == 1 and "port 5353 is not steered" in problems[0]
    assert rule_allows(RULES.dns, 2, 53, L4Proto.UDP, "api.example.test")
    assert not rule_allows(RULES.dns, 2, 53, L4Proto.UDP, "api.other.test")
    server_rule = (DnsRule(4242, L4Proto.UDP, 53, ("*",)),)
    assert rule_allows(server_rule, 4242, 53, L4Proto.UDP, "x.test")
    assert not rule_allows(server_rule, 2, 53, L4Proto.UDP, "x.test"), "another server"
    assert not rule_allows(server_rule, 4242, 53, L4Proto.TCP, "x.test"), "another protocol"


@pytest.mark.parametrize(
    ("rules", "name", "expected"),
    [
        ((DnsRule(0, L4Proto.UDP, 53, ("a.test",), audit=True),), "a.test", Decision.ALLOW),
        ((DnsRule(0, L4Proto.UDP, 53, ("a.test",), audit=True),), "b.test", Decision.AUDIT),
        # An enforced rule covering the same server decides: audited rules never widen it.
        (
            (DnsRule(0, L4Proto.UDP, 53, ("a.test",), audit=True), DnsRule(0, L4Proto.UDP, 53, ("c.test",))),
            "b.test",
            Decision.REFUSE,
        ),
        (
            (DnsRule(0, L4Proto.UDP, 53, ("b.test",), audit=True), DnsRule(0, L4Proto.UDP, 53, ("c.test",))),
            "b.test",
            Decision.ALLOW,
        ),
        ((DnsRule(0, L4Proto.UDP, 53, ("a.test",)),), "b.test", Decision.REFUSE),
        ((), "a.test", Decision.REFUSE),
    ],
)
def test_audited_dns_rules_forward_what_they_would_refuse(
    rules: tuple[DnsRule, ...], name: str, expected: Decision
) -> None:
    assert judge(rules, 7, 53, L4Proto.UDP, name) is expected


def test_wire_decodes_an_audited_dns_rule() -> None:
    rule = common_pb2.DnsRule(
        protocol=common_pb2.PROTOCOL_UDP, port=53, selectors=["a.test"], verdict=common_pb2.VERDICT_AUDIT_ALLOW
    )
    assert wire.dns_rule_from_proto(rule).audit is True
    rule.verdict = common_pb2.VERDICT_DENY
    with pytest.raises(OrderError, match="neither ALLOW nor AUDIT_ALLOW"):
        wire.dns_rule_from_proto(rule)


def test_wire_decodes_name_rules() -> None:
    diff = common_pb2.IdentityPolicyDiff(
        identity=1001,
        full=True,
        names_changed=True,
        fqdn_rules=[
            common_pb2.FqdnRule(
                selector="*.example.test",
                protocol=pb.PROTOCOL_TCP,
                port_low=443,
                verdict=pb.VERDICT_ALLOW,
            )
        ],
        dns_rules=[
            common_pb2.DnsRule(remote_identity=0, protocol=pb.PROTOCOL_UDP, port=53, selectors=["*.example.test"])
        ],
    )
    names = wire.diff_from_proto(diff).names
    assert names == NameRules(
        fqdn=(FqdnRule("*.example.test", L4Proto.TCP, 443, 0, Verdict.ALLOW),),
        dns=(DnsRule(0, L4Proto.UDP, 53, ("*.example.test",)),),
    )
    unchanged = common_pb2.IdentityPolicyDiff(identity=1001)
    assert wire.diff_from_proto(unchanged).names is None


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (common_pb2.FqdnRule(selector="API.test", verdict=pb.VERDICT_ALLOW), "lower-case"),
        (common_pb2.FqdnRule(selector="api.test.", verdict=pb.VERDICT_ALLOW), "trailing dot"),
        (common_pb2.FqdnRule(selector="api.test", verdict=pb.VERDICT_DENY), "not allow"),
        (
            common_pb2.FqdnRule(selector="api.test", protocol=pb.PROTOCOL_ICMP, port_low=80, verdict=pb.VERDICT_ALLOW),
            "has no ports",
        ),
    ],
)
def test_wire_rejects_bad_fqdn_rules(rule: common_pb2.FqdnRule, message: str) -> None:
    policy = common_pb2.IdentityPolicy(identity=1001, fqdn_rules=[rule])
    with pytest.raises(OrderError, match=message):
        wire.snapshot_from_proto(policy)


def test_wire_rejects_bad_dns_rules() -> None:
    with pytest.raises(OrderError, match="UDP, TCP or ANY"):
        wire.snapshot_from_proto(
            common_pb2.IdentityPolicy(dns_rules=[common_pb2.DnsRule(protocol=pb.PROTOCOL_ICMP, port=53)])
        )
    with pytest.raises(OrderError, match="1-65535"):
        wire.snapshot_from_proto(
            common_pb2.IdentityPolicy(dns_rules=[common_pb2.DnsRule(protocol=pb.PROTOCOL_UDP, port=0)])
        )


def test_published_endpoints_round_trip() -> None:
    eps = [NameEndpoint(2, 1002, ("10.0.0.2", "fd00::2"), RULES), NameEndpoint(1, 1001, ("10.0.0.1",), NameRules())]
    assert decode(encode(eps)).endpoints == sorted(eps, key=lambda e: e.ep_id)


class RecordingMaps:
    """The maps as the proxy writes them: ipcache and each endpoint's entries."""

    def __init__(self) -> None:
        self.ipcache: dict[str, int] = {}
        self.entries: dict[int, set[PolicyEntry]] = {}

    def ipcache_upsert(self, prefix: str, identity: int) -> None:
        self.ipcache[prefix] = identity

    def ipcache_delete(self, prefix: str) -> bool:
        return self.ipcache.pop(prefix, None) is not None

    def apply_entries(
        self,
        ep_id: int,
        add: Iterable[PolicyEntry] = (),
        remove: Iterable[PolicyEntry] = (),
        keep: Iterable[PolicyEntry] = (),
    ) -> PolicyChange:
        held = self.entries.setdefault(ep_id, set())
        added, removed = set(add), set(remove)
        assert not added & held, "an entry written twice"
        assert removed <= held, "an entry removed that was not written"
        # What the writer re-encodes beside them: every entry held before and after that shares
        # a changed entry's (remote identity, protocol, verdict), and nothing else.
        groups = {(e.key.remote_identity, e.key.protocol, e.verdict) for e in added | removed}
        assert set(keep) == {e for e in held - removed if (e.key.remote_identity, e.key.protocol, e.verdict) in groups}
        held |= added
        held -= removed
        return PolicyChange(added=len(added), removed=len(removed), enforcement_changed=False)


NAMES = ["a.example.test", "b.example.test", "api.other.test"]
ADDRESSES = [f"192.0.2.{i}" for i in range(1, 7)]
CIDR_ID = 1 << 24
EPS = [
    NameEndpoint(1, 1001, ("10.0.0.1",), NameRules(fqdn=(FqdnRule("*.example.test", L4Proto.TCP, 443),))),
    NameEndpoint(2, 1002, ("10.0.0.2",), NameRules(fqdn=(FqdnRule("a.example.test"), FqdnRule("*.test")))),
    # No name rules: a world allow and a CIDR deny, which learned addresses keep.
    NameEndpoint(
        3,
        1003,
        ("10.0.0.3",),
        NameRules(),
        (
            PolicyEntry(PolicyKey(Direction.EGRESS, IDENTITY_WORLD, L4Proto.TCP, 80)),
            PolicyEntry(PolicyKey(Direction.EGRESS, CIDR_ID), Verdict.DENY),
        ),
    ),
]


def former(ip: str) -> int:
    """Half the addresses sit in a CIDR prefix, the rest are world."""
    return CIDR_ID if int(ip.rsplit(".", 1)[1]) % 2 else IDENTITY_WORLD


@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("learn"),
                st.sampled_from([1, 2, 3]),
                st.sampled_from(NAMES),
                st.lists(st.sampled_from(ADDRESSES), min_size=1, max_size=4, unique=True),
                st.integers(1, 20),
            ),
            st.tuples(st.just("expire"), st.integers(0, 30)),
        ),
        max_size=25,
    )
)
def test_incremental_writes_match_a_full_sync(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    """Answers and expiries applied incrementally leave the maps where a full sync would."""
    cache = NameCache(CacheLimits(min_ttl=0, max_per_name=3, max_per_endpoint=4))
    maps = RecordingMaps()
    names = NameMaps(maps, former)
    names.sync(cache, EPS)
    now = 0.0
    for step in steps:
        now += 1
        if step[0] == "learn":
            _, ep, name, ips, ttl = step
            lookup = cache.learn(ep, name, [(ip, ttl) for ip in ips], now)
            names.change(cache, EPS, lookup.added, lookup.evicted)
        else:
            gone = cache.expire(now + step[1], in_use=set())
            names.change(cache, EPS, (), gone)
        ipcache, entries = desired(cache, EPS, former)
        assert maps.ipcache == ipcache
        assert {ep: maps.entries.get(ep, set()) for ep in entries} == {ep: set(c) for ep, c in entries.items()}


def test_learned_address_keeps_its_former_identitys_entries() -> None:
    cache = NameCache()
    cache.learn(1, "a.example.test", [("192.0.2.1", 60), ("192.0.2.2", 60)], now=0)
    _, entries = desired(cache, EPS, former)
    one, two = cache.identity("192.0.2.1"), cache.identity("192.0.2.2")
    assert one is not None and two is not None
    assert set(entries[3]) == {
        PolicyEntry(PolicyKey(Direction.EGRESS, one), Verdict.DENY),  # .1 was in the denied CIDR
        PolicyEntry(PolicyKey(Direction.EGRESS, two, L4Proto.TCP, 80)),  # .2 was world
    }


def test_published_aliased_entries_and_prefixes_round_trip() -> None:
    prefixes = {"192.0.2.0/25": CIDR_ID, "2001:db8::/64": CIDR_ID + 1}
    assert decode(encode(EPS, prefixes)) == Published(EPS, prefixes)
    # A file written before the prefixes were published: none known.
    assert decode(encode(EPS).replace(', "prefixes": []', "")) == Published(EPS, {})


@pytest.mark.parametrize(
    ("ip", "want"),
    [
        ("192.0.2.1", CIDR_ID + 2),  # the /32 is the longest holding it
        ("192.0.2.2", CIDR_ID + 1),  # the /25
        ("192.0.2.200", CIDR_ID),  # only the /24
        ("192.0.3.1", CIDR_ID + 3),  # 0.0.0.0/0 holds everything v4
        ("2001:db8::5", CIDR_ID + 4),
        ("2001:db9::5", None),  # no v6 prefix holds it
    ],
)
def test_a_learned_address_former_identity_is_its_longest_cidr_prefix(ip: str, want: int | None) -> None:
    prefixes = CidrPrefixes({
        "192.0.2.0/24": CIDR_ID, "192.0.2.0/25": CIDR_ID + 1, "192.0.2.1/32": CIDR_ID + 2,
        "0.0.0.0/0": CIDR_ID + 3, "2001:db8::/64": CIDR_ID + 4,
    })  # fmt: skip
    assert prefixes.longest(ip) == want


def test_learned_entries_follow_a_cidr_prefix_added_and_removed_after_the_lookup() -> None:
    """The learned /32 hides any prefix holding the address, so its inherited entries follow the
    prefixes the datapath publishes: a toCIDR added later allows through it, a removed one stops."""
    prefixes = CidrPrefixes({})
    cache, maps = NameCache(), RecordingMaps()
    names = NameMaps(maps, lambda ip: prefixes.longest(ip) or IDENTITY_WORLD, lambda p: prefixes.exact(p))
    lookup = cache.learn(1, "a.example.test", [("192.0.2.1", 60)], now=0)
    names.change(cache, EPS, lookup.added, lookup.evicted)
    learned = cache.identity("192.0.2.1")
    assert learned is not None
    world_allow = PolicyEntry(PolicyKey(Direction.EGRESS, learned, L4Proto.TCP, 80))
    cidr_deny = PolicyEntry(PolicyKey(Direction.EGRESS, learned), Verdict.DENY)
    assert maps.entries[3] == {world_allow}
    prefixes = CidrPrefixes({"192.0.2.1/32": CIDR_ID})  # a toCIDR names exactly the address
    names.sync(cache, EPS)
    assert maps.entries[3] == {cidr_deny}
    gone = cache.expire(120, in_use=set())
    names.change(cache, EPS, (), gone)
    assert maps.entries[3] == set()
    assert maps.ipcache == {"192.0.2.1/32": CIDR_ID}, "the CIDR's own entry put back, not deleted"


@pytest.mark.parametrize(
    ("journaled", "pairs", "due"),
    [
        (1999, 0, False),  # a small cache: every compact_every answers
        (2000, 0, True),
        (2000, 400, True),
        (2000, 10_000, False),  # a large one: in proportion to it (a snapshot of it costs more)
        (39_999, 10_000, False),
        (40_000, 10_000, True),
    ],
)
def test_snapshots_are_made_in_proportion_to_the_cache(journaled: int, pairs: int, due: bool) -> None:
    config = ProxyConfig(state_dir="/nonexistent", compact_every=2000, compact_ratio=4.0)
    assert config.compact_due(journaled, pairs) is due


@pytest.mark.parametrize("settings", [{"compact_every": 0}, {"compact_ratio": -1.0}])
def test_compaction_settings_out_of_range_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="compact"):
        ProxyConfig(state_dir="/nonexistent", **settings)  # type: ignore[arg-type]
