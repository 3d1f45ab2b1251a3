"""The dev cluster's world DNS: its zone file, its answers, and a file edited while it serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import pytest

from services.devstack import world
from services.devstack.dnsserver import Record, ZoneError, ZoneFile, answer, parse_zone, render_zone, serve
from services.devstack.hosts import plan
from testkit.harness import free_port


def _ask(table: dict[str, Record], name: str, rdtype: str = "A") -> dns.message.Message:
    got = answer(table, dns.message.make_query(name, rdtype).to_wire())
    assert got is not None
    return dns.message.from_wire(got[1])


def test_a_zone_file_reads_back_what_was_written() -> None:
    table = {"api.example.test": Record(("192.0.2.10",), 5), "s3.example.test": Record(("203.0.113.1", "2001:db8::1"))}
    assert parse_zone(render_zone(table, "a comment\nover two lines")) == table
    assert parse_zone("names:\n  API.Example.Test.: {addresses: [192.0.2.1]}\n") == {
        "api.example.test": Record(("192.0.2.1",), 30)
    }
    assert parse_zone("") == {}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("names: {a.test: {addresses: [192.0.2.300]}}", "names.a.test.addresses[0]: '192.0.2.300'"),
        ("names: {a.test: {addresses: []}}", "names.a.test.addresses: a non-empty list"),
        ("names: {a.test: {addresses: [192.0.2.1], ttl: -1}}", "names.a.test.ttl: -1"),
        ("names: {a.test: {addresses: [192.0.2.1], tll: 5}}", "names.a.test: write"),
        ("name: {}", "unknown key(s) ['name']"),
        ("names: [a.test]", "names: a mapping"),
        ("names: {a.test: [", "not YAML"),
    ],
)
def test_a_bad_zone_file_is_an_error_naming_the_entry(text: str, named: str) -> None:
    with pytest.raises(ZoneError, match=r"^zone: ") as err:
        parse_zone(text)
    assert named in str(err.value)


def test_answers_by_family_and_nxdomain_for_other_names() -> None:
    table = {"s3.example.test": Record(("203.0.113.1", "203.0.113.2", "2001:db8::1"), 7)}
    a = _ask(table, "S3.example.test.")
    assert a.rcode() == dns.rcode.NOERROR and a.flags & dns.flags.AA
    assert [(r.ttl, sorted(rd.address for rd in r)) for r in a.answer] == [(7, ["203.0.113.1", "203.0.113.2"])]
    aaaa = _ask(table, "s3.example.test", "AAAA")
    assert [rd.address for r in aaaa.answer for rd in r] == ["2001:db8::1"]
    assert _ask(table, "other.example.test").rcode() == dns.rcode.NXDOMAIN
    assert answer(table, b"\x00\x01garbage") is None


def test_the_zone_file_is_read_again_when_it_changes_and_a_bad_edit_keeps_the_last_table(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(render_zone({"a.test": Record(("192.0.2.1",))}))
    zone = ZoneFile(path)
    assert zone.table() == {"a.test": Record(("192.0.2.1",))}
    path.write_text(render_zone({"a.test": Record(("192.0.2.2", "192.0.2.3"))}))
    assert zone.table() == {"a.test": Record(("192.0.2.2", "192.0.2.3"))}
    # An edit of the same size right after the last one is seen too.
    path.write_text(render_zone({"a.test": Record(("192.0.2.4", "192.0.2.5"))}))
    assert zone.table() == {"a.test": Record(("192.0.2.4", "192.0.2.5"))}
    path.write_text("names: {a.test: {addresses: [nope]}}")
    assert zone.table() == {"a.test": Record(("192.0.2.4", "192.0.2.5"))}


def test_the_server_answers_over_udp_and_tcp(tmp_path: Path) -> None:
    path = tmp_path / "zone.yaml"
    path.write_text(render_zone({"api.example.test": Record(("192.0.2.10",), 3)}))
    port = free_port()

    async def run() -> tuple[list[str], list[str]]:
        import dns.asyncquery

        ready = asyncio.Event()
        task = asyncio.create_task(serve(ZoneFile(path), "127.0.0.1", port, ready))
        await ready.wait()
        try:
            q = dns.message.make_query("api.example.test", "A")
            udp = await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=5)
            path.write_text(render_zone({"api.example.test": Record(("192.0.2.11",), 3)}))
            tcp = await dns.asyncquery.tcp(q, "127.0.0.1", port=port, timeout=5)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return [rd.address for r in udp.answer for rd in r], [rd.address for r in tcp.answer for rd in r]

    assert asyncio.run(run()) == (["192.0.2.10"], ["192.0.2.11"])


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
def test_the_world_has_a_free_address_on_every_bridge(mode: str) -> None:
    network = plan(["dev-node-1", "dev-node-2", "dev-node-3"], "172.31.200.0/24", "0123abcd", mode)
    w = world.plan(network, "0123abcd")
    assert len(w.legs) == len(network.bridges)
    taken = {a for n in network.nodes for a in (n.address, n.gateway, n.router)}
    assert not {leg.address for leg in w.legs} & taken
    assert {netns for netns, _ in w.gateways} == {n.netns for n in network.nodes}
    by_bridge = {leg.bridge: leg.address for leg in w.legs}
    assert dict(w.gateways) == {n.netns: by_bridge[n.bridge] for n in network.nodes}
    assert len({leg.link for leg in w.legs}) == len(w.legs) and all(len(leg.link) <= 15 for leg in w.legs)
