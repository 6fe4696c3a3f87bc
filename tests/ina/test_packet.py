"""Packet format (§5.2): one declarative field table, network-byte-order codec."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atp_pipeline.ina.packet import ATP_APP_TYPE, DecodeError, Packet, PacketFormat, atp_fields


def test_default_format_matches_the_released_frame_budget():
    fmt = PacketFormat()
    assert fmt.payload_k == 62
    assert fmt.header_bits % 8 == 0 and fmt.header_bytes == 29
    assert fmt.atp_bytes == 29 + 62 * 4 and fmt.wire_bytes == fmt.atp_bytes + 42
    names = [f.name for f in fmt.fields]
    for required in ("worker_id", "fan_in0", "fan_in1", "resend", "edge", "seq", "job", "agg_index",
                     "bitmap0", "bitmap1", "ecn", "collision", "overflow", "is_param"):
        assert required in names
    assert {f.name: f.bits for f in fmt.fields}["bitmap0"] == 32
    assert len(names) == len(set(names))


def test_layout_is_contiguous_and_introspectable():
    fmt = PacketFormat(payload_k=8, bitmap_bits=1024)
    off = 0
    for name, o, bits in fmt.layout():
        assert o == off
        off += bits
    assert off == fmt.header_bits
    assert dict((n, b) for n, _, b in fmt.layout())["fan_in0"] >= 11  # can count 1,024 children


def test_encoding_is_big_endian_and_follows_table_order():
    fmt = PacketFormat(payload_k=2)
    p = fmt.packet(job=0x0102, seq=0x03040506, worker_id=0x0708, fan_in0=9, bitmap0=1,
                   payload=np.array([1, -2], dtype=np.int32))
    b = fmt.encode(p)
    assert b[0] == ATP_APP_TYPE
    assert b[1:3] == bytes([1, 2]) and b[3:7] == bytes([3, 4, 5, 6]) and b[7:9] == bytes([7, 8])
    assert b[9] == 9  # fan_in0 follows worker_id
    assert b[-8:] == struct.pack(">ii", 1, -2)


field_values = st.fixed_dictionaries({f.name: st.integers(0, (1 << f.bits) - 1)
                                      for f in atp_fields(32) if f.name not in ("app_type", "reserved")})


@settings(max_examples=200, deadline=None)
@given(field_values, st.lists(st.integers(-2**31, 2**31 - 1), min_size=5, max_size=5))
def test_roundtrip(fields, payload):
    fmt = PacketFormat(payload_k=5)
    p = fmt.packet(**fields, payload=np.array(payload, dtype=np.int32))
    q = fmt.decode(fmt.encode(p))
    assert q.header() == p.header()
    assert q.payload.dtype == np.int32 and (q.payload == p.payload).all()


def test_decode_rejects_bad_buffers():
    fmt = PacketFormat(payload_k=4)
    good = fmt.encode(fmt.packet(fan_in0=1, bitmap0=1))
    with pytest.raises(DecodeError, match="truncated"):
        fmt.decode(good[:-1])
    with pytest.raises(DecodeError, match="oversized"):
        fmt.decode(good + b"\0")
    with pytest.raises(DecodeError, match="not ATP"):
        fmt.decode(b"\x00" + good[1:])
    fmt2 = PacketFormat(payload_k=4, bitmap_bits=33)  # 1 + 7 reserved pad bits
    assert fmt2.fields[-1].name == "reserved"
    b = bytearray(fmt2.encode(fmt2.packet()))
    b[fmt2.header_bytes - 1] |= 1
    with pytest.raises(DecodeError, match="reserved"):
        fmt2.decode(bytes(b))


def test_encode_refuses_values_that_do_not_fit():
    fmt = PacketFormat(payload_k=1)
    with pytest.raises(ValueError, match="job"):
        fmt.encode(fmt.packet(job=1 << 16))
    with pytest.raises(ValueError, match="lanes"):
        fmt.encode(fmt.packet(payload=np.zeros(3, dtype=np.int32)))


def test_copy_is_independent():
    p = Packet(job=1, seq=2, payload=np.arange(3, dtype=np.int32))
    q = p.copy()
    q.seq = 9
    assert p.seq == 2 and q.header()["job"] == 1 and q.payload is p.payload
