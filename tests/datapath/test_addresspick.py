"""The node's own pick of pod addresses: learnt from ipam's answers, never an address known taken."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from services.datapath import types as dt
from services.datapath.addresspick import AddressPicker


def answer(ip: str, cidr: str = "10.244.1.0/24", gateway: str = "10.244.1.1") -> dt.Address:
    return dt.Address(ip=ip, cidr=cidr, gateway=gateway, family=ipaddress.ip_address(ip).version)


def free(ip: str) -> bool:
    return False


def test_nothing_is_picked_before_ipam_said_the_nodes_cidr() -> None:
    picker = AddressPicker()
    assert picker.pick(4, free) is None
    picker.learn(dt.Address(ip="10.244.1.7", cidr="", gateway="", family=4), chosen_by_ipam=True)
    assert picker.pick(4, free) is None  # an answer without a CIDR teaches nothing


def test_picks_go_on_after_ipams_own_choice_and_after_each_other() -> None:
    picker = AddressPicker()
    picker.learn(answer("10.244.1.9"), chosen_by_ipam=True)
    first = picker.pick(4, free)
    assert first == answer("10.244.1.10")
    assert picker.pick(4, free) == answer("10.244.1.11")


def test_an_address_ipam_reserved_as_asked_moves_no_cursor() -> None:
    # A restored endpoint's exact address says the CIDR, not where new addresses go on.
    picker = AddressPicker()
    picker.learn(answer("10.244.1.40"), chosen_by_ipam=True)
    picker.learn(answer("10.244.1.3"), chosen_by_ipam=False)
    assert picker.pick(4, free) == answer("10.244.1.41")


def test_taken_addresses_are_skipped_and_the_cidr_wraps_past_network_gateway_and_broadcast() -> None:
    picker = AddressPicker()
    picker.learn(answer("10.244.1.5", cidr="10.244.1.0/29"), chosen_by_ipam=True)
    taken = {"10.244.1.6", "10.244.1.2"}
    assert picker.pick(4, taken.__contains__) == answer("10.244.1.3", cidr="10.244.1.0/29")
    # .4 and .5 left, then nothing this node knows to be free: ipam decides.
    assert picker.pick(4, taken.__contains__) is not None
    assert picker.pick(4, taken.__contains__) is not None
    assert picker.pick(4, (taken | {"10.244.1.3", "10.244.1.4", "10.244.1.5"}).__contains__) is None


def test_a_forgotten_family_is_asked_of_ipam_again_and_families_are_apart() -> None:
    picker = AddressPicker()
    picker.learn(answer("10.244.1.9"), chosen_by_ipam=True)
    picker.learn(answer("fd00:1::a", cidr="fd00:1::/120", gateway="fd00:1::1"), chosen_by_ipam=True)
    assert picker.pick(6, free) == answer("fd00:1::b", cidr="fd00:1::/120", gateway="fd00:1::1")
    picker.forget(4)
    assert picker.pick(4, free) is None
    assert picker.pick(6, free) == answer("fd00:1::c", cidr="fd00:1::/120", gateway="fd00:1::1")


def test_an_address_outside_the_cidr_teaches_the_cidr_but_not_the_cursor() -> None:
    # A chained create's address from another plugin's pool (reserved outside the node's CIDR).
    picker = AddressPicker()
    picker.learn(answer("10.22.0.6"), chosen_by_ipam=False)
    assert picker.pick(4, free) == answer("10.244.1.2")


@given(
    cursor=st.integers(min_value=2, max_value=30),
    taken=st.sets(st.integers(min_value=0, max_value=31)),
)
def test_a_pick_is_never_taken_nor_reserved_and_always_in_the_cidr(cursor: int, taken: set[int]) -> None:
    picker = AddressPicker()
    picker.learn(answer(f"10.244.1.{cursor}", cidr="10.244.1.0/27"), chosen_by_ipam=True)
    held = {f"10.244.1.{n}" for n in taken}
    picked = picker.pick(4, held.__contains__)
    free_left = set(range(2, 31)) - taken
    if not free_left:
        assert picked is None
        return
    assert picked is not None
    n = int(picked.ip.rsplit(".", 1)[1])
    assert n in free_left
    # The first free one after the cursor, wrapping around: released addresses come back last.
    after = sorted(free_left, key=lambda m: (m <= cursor, m))
    assert n == after[0]
