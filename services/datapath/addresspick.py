"""The next address of this node's pod CIDR, picked on the node. Pure.

Cilium's agent allocates its pods' addresses from its node's CIDR itself (cluster-pool
IPAM), so a pod's network is made without a round trip first. Palisade keeps ipam the
authority on who holds an address (its transaction refuses an address another owner
holds), but the datapath picks the address a standalone create asks ipam to record, so
the recording runs beside the pod's network and programs instead of before them.

The node's CIDR per family is learnt from ipam's answers (any allocation on this node
carries it); the cursor moves past every address picked or handed out automatically, so
a released address is picked again last, as ipam's own choice does. What is taken is the
caller's to say (an endpoint here has it, a create here is taking it, the ipcache says
someone holds it); a pick that ipam refuses anyway (another process took it meanwhile)
costs the create one fallback to ipam's own choice.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from services.common.podcidr import IPNetwork, next_free_address
from services.datapath import types as dt


class _Taken:
    """``next_free_address``'s view (integers) of the caller's test (address text)."""

    __slots__ = ("_family", "_test")

    def __init__(self, family: int, test: Callable[[str], bool]) -> None:
        self._family = family
        self._test = test

    def __contains__(self, value: object) -> bool:
        assert isinstance(value, int)
        address = ipaddress.IPv4Address(value) if self._family == 4 else ipaddress.IPv6Address(value)
        return self._test(str(address))


class AddressPicker:
    """Per family, this node's pod CIDR as ipam last said it, and where the next pick starts."""

    def __init__(self) -> None:
        self._cidrs: dict[int, tuple[IPNetwork, str]] = {}
        self._cursor: dict[int, int] = {}

    def learn(self, address: dt.Address, *, chosen_by_ipam: bool) -> None:
        """ipam's answer for an address of this node: the CIDR it carries (and, for an address ipam
        chose itself, the cursor moves past it)."""
        try:
            cidr = ipaddress.ip_network(address.cidr)
            ip = ipaddress.ip_address(address.ip)
        except ValueError:
            return  # no CIDR in the answer: nothing learnt
        if cidr.version != address.family or ip.version != cidr.version:
            return
        self._cidrs[cidr.version] = (cidr, address.gateway)
        if chosen_by_ipam and ip in cidr:
            self._cursor[cidr.version] = int(ip)

    def forget(self, family: int) -> None:
        """ipam refused a pick for a reason other than its holder (the node's CIDR changed): ask it again."""
        self._cidrs.pop(family, None)
        self._cursor.pop(family, None)

    def pick(self, family: int, taken: Callable[[str], bool]) -> dt.Address | None:
        """The next address of ``family`` that is not ``taken`` (None: the CIDR is not known yet, or
        every address is taken as far as this node knows; ipam then decides)."""
        known = self._cidrs.get(family)
        if known is None:
            return None
        cidr, gateway = known
        address = next_free_address(cidr, _Taken(family, taken), self._cursor.get(family))
        if address is None:
            return None
        self._cursor[family] = int(address)
        return dt.Address(ip=str(address), cidr=str(cidr), gateway=gateway, family=family)
