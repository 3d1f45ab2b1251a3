"""Raw-socket SCTP: checksums and the INIT / INIT-ACK step, as packets on the wire."""

from __future__ import annotations

import struct

import pytest

from services.devstack import sctp


def test_crc32c_matches_the_standard_check_value() -> None:
    assert sctp.crc32c(b"123456789") == 0xE3069283
    assert sctp.crc32c(b"") == 0


def test_an_init_is_answered_by_an_init_ack_that_the_initiator_recognises() -> None:
    init = sctp.Packet(40000, 80, 0, sctp.INIT, initiate_tag=0x01020304)
    wire = init.encode()
    assert len(wire) == 12 + 20  # common header + INIT chunk (RFC 9260 3.3.2)
    assert struct.unpack("!HHI", wire[:8]) == (40000, 80, 0)
    got = sctp.decode(wire)
    assert got == init
    ack = sctp.answer(got)
    back = sctp.decode(ack.encode())
    assert back is not None and back.chunk_type == sctp.INIT_ACK
    assert (back.sport, back.dport, back.vtag) == (80, 40000, 0x01020304)
    assert back.initiate_tag != 0 and len(back.cookie) == 16


@pytest.mark.parametrize("flip", [0, 5, 9, 13, 20])
def test_a_corrupted_packet_is_refused(flip: int) -> None:
    wire = bytearray(sctp.Packet(1, 2, 0, sctp.INIT, initiate_tag=7).encode())
    wire[flip] ^= 0x40
    assert sctp.decode(bytes(wire)) is None


@pytest.mark.parametrize("data", [b"", b"\x00" * 11, b"\x00" * 15])
def test_short_data_is_not_a_packet(data: bytes) -> None:
    assert sctp.decode(data) is None
