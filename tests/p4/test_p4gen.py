"""The generated P4 header matches the Python packet codec field for field."""

import re

import numpy as np

from atp_pipeline.ina.p4 import codegen
from atp_pipeline.ina.packet import PacketFormat

from . import GENERATED_DIR


def _parse_header(text: str, name: str):
    body = re.search(r"header\s+" + name + r"\s*\{(.*?)\}", text, re.S).group(1)
    return [(m.group(2), int(m.group(1))) for m in re.finditer(r"bit<(\d+)>\s+(\w+)\s*;", body)]


def test_generated_header_matches_codec_field_for_field():
    fmt = PacketFormat()
    text = (GENERATED_DIR / "atp_headers.p4").read_text()
    fields = _parse_header(text, "atp_t")
    assert fields == [(f.name, f.bits) for f in fmt.fields]
    assert sum(b for _, b in fields) == 8 * fmt.header_bytes
    lanes = _parse_header(text, "atp_data_t")
    assert [b for _, b in lanes] == [32] * fmt.payload_k
    assert (sum(b for _, b in fields) + sum(b for _, b in lanes)) // 8 == fmt.atp_bytes
    assert f"#define ATP_K {fmt.payload_k}\n" in text
    assert f"#define ATP_HEADER_BYTES {fmt.header_bytes}\n" in text
    # every bit offset agrees with the codec: set one field, find its bit in the encoding
    for name, off, bits in fmt.layout():
        assert re.search(rf"#define ATP_BITOFF_{name.upper()} {off}\b", text)
        if name in ("app_type", "reserved"):
            continue
        p = fmt.packet(**{name: 1})
        h = int.from_bytes(fmt.encode(p)[: fmt.header_bytes], "big") & ~(0xFF << (8 * fmt.header_bytes - 8))
        assert h == 1 << (fmt.header_bits - off - bits), name


def test_lane_order_matches_payload_order():
    fmt = PacketFormat()
    names = [n for n, _ in _parse_header(codegen.render_headers(fmt), "atp_data_t")]
    buf = fmt.encode(fmt.packet(payload=np.arange(fmt.payload_k, dtype=np.int32)))
    for i, n in enumerate(names):
        assert n == codegen.lane_name(i, fmt.payload_k)
        assert int.from_bytes(buf[fmt.header_bytes + 4 * i: fmt.header_bytes + 4 * i + 4], "big") == i


def test_other_formats_render_their_own_table():
    fmt = PacketFormat(payload_k=8, bitmap_bits=64)
    fields = _parse_header(codegen.render_headers(fmt), "atp_t")
    assert fields == [(f.name, f.bits) for f in fmt.fields]
    assert sum(b for _, b in fields) == 8 * fmt.header_bytes
    assert codegen.render_lanes_tna(fmt).count("Register<bit<32>, bit<32>>") == 8


def test_checked_in_generated_files_are_fresh():
    assert codegen.stale_files(GENERATED_DIR) == [], "run: python -m atp_pipeline.ina.p4.codegen"


def test_check_mode_detects_stale_file(tmp_path, capsys):
    assert codegen.main(["--out-dir", str(tmp_path)]) == 0
    assert codegen.main(["--check", "--out-dir", str(tmp_path)]) == 0
    f = tmp_path / "atp_headers.p4"
    f.write_text(f.read_text().replace("bit<16> job;", "bit<15> job;"))
    assert codegen.main(["--check", "--out-dir", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().err
