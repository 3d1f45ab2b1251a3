"""Addresses in BPF keys and values: 16 bytes in network order (IPv4 in the first 4) and a family byte."""

from __future__ import annotations

import ctypes
import ipaddress

FAMILY_V4 = 4
FAMILY_V6 = 6


def family_of(ip: str) -> int:
    return FAMILY_V4 if ipaddress.ip_address(ip).version == 4 else FAMILY_V6


def put(field: ctypes.Array[ctypes.c_uint8], ip: str) -> int:
    """Write ``ip`` into a 16-byte field; returns its family."""
    addr = ipaddress.ip_address(ip)
    ctypes.memmove(field, addr.packed, len(addr.packed))
    return FAMILY_V4 if addr.version == 4 else FAMILY_V6


def get(field: ctypes.Array[ctypes.c_uint8], family: int) -> str:
    return str(ipaddress.ip_address(bytes(field[: 4 if family == FAMILY_V4 else 16])))
