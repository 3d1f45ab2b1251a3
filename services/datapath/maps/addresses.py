"""Addresses in BPF keys and values: 16 bytes in network order (IPv4 in the first 4) and a family byte.

The only place the family numbers (FAMILY_V4 / FAMILY_V6 in the program, generated from here by
``maps.constants``) and the address layout are spelled.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket

#: The family byte of an IPv4 address.
FAMILY_V4 = 4
#: The family byte of an IPv6 address.
FAMILY_V6 = 6
#: Bytes of the 16-byte field an address of each family uses.
_LENGTHS = {FAMILY_V4: 4, FAMILY_V6: 16}


def family_of(ip: str) -> int:
    return FAMILY_V4 if ipaddress.ip_address(ip).version == 4 else FAMILY_V6


def put(field: ctypes.Array[ctypes.c_uint8], ip: str) -> int:
    """Write ``ip`` into a 16-byte field; returns its family."""
    addr = ipaddress.ip_address(ip)
    ctypes.memmove(field, addr.packed, len(addr.packed))
    return FAMILY_V4 if addr.version == 4 else FAMILY_V6


def get(field: ctypes.Array[ctypes.c_uint8], family: int) -> str:
    """The address of ``family`` in ``field`` (any family but IPv4 reads all 16 bytes)."""
    if family == FAMILY_V4:
        # What ipaddress would write, at a fraction of the cost (every flow event is decoded while
        # the node records flows); IPv6 keeps ipaddress's form (mapped addresses differ).
        return socket.inet_ntop(socket.AF_INET, bytes(field[:4]))
    return str(ipaddress.ip_address(bytes(field[: _LENGTHS.get(family, 16)])))
