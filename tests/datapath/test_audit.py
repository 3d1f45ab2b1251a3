"""Audit mode on real packets: what only an audited policy would drop passes and is reported with
verdict audit; what an enforced policy drops is dropped beside it; audited deny rules likewise.

The maps are written as the datapath writes an order carrying audited entries: AUDIT (an audited
deny), AUDIT_ALLOW (an audited allow where only audited policies enforce) and the audit bits of
the enforcement flags. The Python reference (policymap.verdict) must agree with the kernel.
"""

from __future__ import annotations

import pytest

from services.datapath.maps import policymap
from services.datapath.types import Direction, Enforcement, FlowEvent, L4Proto, PolicyEntry, PolicyKey, Reason, Verdict
from testkit.datapathnode import Node, drops
from testkit.traffic import DENY_TIMEOUT, tcp_exchange

pytestmark = [pytest.mark.root, pytest.mark.bcc]

ING = Direction.INGRESS


def entry(verdict: Verdict, identity: int, port: int) -> PolicyEntry:
    return PolicyEntry(PolicyKey(ING, identity, L4Proto.TCP, port, port), verdict)


def events_to(net: Node, ep_id: int, port: int) -> list[FlowEvent]:
    return [e for e in net.dp.read_flows(200) if e.endpoint_id == ep_id and e.destination_port == port]


def reference(net: Node, enforcement: Enforcement, entries: list[PolicyEntry], remote: int, port: int) -> Verdict:
    prefixes = policymap.encode(net.b.ep_id, policymap.normalize(entries))
    verdict, _ = policymap.evaluate(
        prefixes, enforcement, ep_id=net.b.ep_id, direction=ING, remote_identity=remote, protocol=6, port=port
    )
    return verdict


def test_a_would_be_drop_of_an_audited_default_deny_passes_reported_as_audit(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    # Only an audited policy selects b's ingress; it allows a on 8080.
    enforcement = Enforcement(audit_ingress=True)
    entries = [entry(Verdict.AUDIT_ALLOW, a.identity, 8080)]
    dp.sync_policy(b.ep_id, enforcement, entries)
    dp.skip_flows(0)
    before = drops(dp, b.ep_id, ING)

    assert tcp_exchange(a.name, b.v4, 8080)  # what the audited policy allows: plainly forwarded
    (allowed,) = events_to(net, b.ep_id, 8080)
    assert (allowed.verdict, allowed.reason) == (Verdict.ALLOW, Reason.NOT_ENFORCED)

    assert tcp_exchange(c.name, b.v4, 8080)  # it would drop c: c passes, reported as audit
    (audited,) = events_to(net, b.ep_id, 8080)
    assert (audited.verdict, audited.reason, audited.source_identity) == (
        Verdict.AUDIT,
        Reason.DEFAULT_DENY,
        c.identity,
    )
    assert drops(dp, b.ep_id, ING) == before
    for remote, want in ((a.identity, Verdict.ALLOW), (c.identity, Verdict.AUDIT)):
        assert reference(net, enforcement, entries, remote, 8080) is want


def test_an_enforced_drop_beside_an_audited_policy_still_drops(net: Node) -> None:
    dp, a, b, c = net.dp, net.a, net.b, net.c
    # An enforced policy admits a only; an audited one would admit c too, and deny a on 8081.
    enforcement = Enforcement(ingress=True)
    entries = [
        entry(Verdict.ALLOW, a.identity, 8080),
        entry(Verdict.ALLOW, a.identity, 8081),
        entry(Verdict.AUDIT_ALLOW, c.identity, 8080),
        entry(Verdict.AUDIT, a.identity, 8081),
    ]
    dp.sync_policy(b.ep_id, enforcement, entries)
    dp.skip_flows(0)

    assert not tcp_exchange(c.name, b.v4, 8080, timeout=DENY_TIMEOUT)  # enforced: dropped whatever audit says
    dropped = events_to(net, b.ep_id, 8080)
    assert dropped and all((e.verdict, e.reason) == (Verdict.DENY, Reason.DEFAULT_DENY) for e in dropped)

    assert tcp_exchange(a.name, b.v4, 8080)
    assert [e.verdict for e in events_to(net, b.ep_id, 8080)] == [Verdict.ALLOW]
    assert tcp_exchange(a.name, b.v4, 8081)  # allowed, but an audited deny names it
    (audited,) = events_to(net, b.ep_id, 8081)
    assert (audited.verdict, audited.reason) == (Verdict.AUDIT, Reason.POLICY_DENY)
    for remote, port, want in (
        (c.identity, 8080, Verdict.DENY),
        (a.identity, 8080, Verdict.ALLOW),
        (a.identity, 8081, Verdict.AUDIT),
    ):
        assert reference(net, enforcement, entries, remote, port) is want


def test_an_audited_deny_passes_and_an_enforced_deny_beside_it_drops(net: Node) -> None:
    dp, b, c = net.dp, net.b, net.c
    enforcement = Enforcement()
    entries = [entry(Verdict.AUDIT, c.identity, 9000), entry(Verdict.DENY, c.identity, 9001)]
    dp.sync_policy(b.ep_id, enforcement, entries)
    dp.skip_flows(0)

    assert tcp_exchange(c.name, b.v4, 9000)
    (audited,) = events_to(net, b.ep_id, 9000)
    assert (audited.verdict, audited.reason) == (Verdict.AUDIT, Reason.POLICY_DENY)
    assert not tcp_exchange(c.name, b.v4, 9001, timeout=DENY_TIMEOUT)
    denied = events_to(net, b.ep_id, 9001)
    assert denied and all((e.verdict, e.reason) == (Verdict.DENY, Reason.POLICY_DENY) for e in denied)
    # the maps read back as written: audit keys kept apart from enforced ones
    assert dp.dump_policy(b.ep_id) == (enforcement, sorted(entries))
    assert reference(net, enforcement, entries, c.identity, 9000) is Verdict.AUDIT
    assert reference(net, enforcement, entries, c.identity, 9001) is Verdict.DENY
