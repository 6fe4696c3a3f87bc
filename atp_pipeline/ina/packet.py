"""ATP packet format (§5.2, Figure 2): ONE declarative field table, codec derived from it.

The gradient packet and the parameter packet share one header (the parameter packet is
the gradient header with ``is_param`` set — the released code does the same with its ACK
flag), followed by a payload of ``K`` big-endian int32 lanes (62 by default, the authors'
308-byte frame). Everything about the wire layout lives in :attr:`PacketFormat.fields`:
an ordered tuple of :class:`Field` (name, bit width, meaning). :meth:`PacketFormat.encode`
and :meth:`PacketFormat.decode` are generic over that table (network byte order, fields
packed MSB-first in table order), and a later issue generates the P4 ``header_type`` from
the very same table (``[(f.name, f.bits) for f in fmt.fields]`` plus ``fmt.payload_k``
lanes of ``bit<32>``).

Fields (widths for the default 32-bit bitmaps; see :func:`atp_fields`):

========== ==== ==========================================================================
app_type      8 constant :data:`ATP_APP_TYPE`; the switch's ATP classifier (§5.3)
job          16 job id (the released code's appID)
seq          32 sequence number of the element (§5.2); unique within a job
worker_id    16 sender's worker id inside its job (§5.1); identifies the origin rack
fan_in0   8..11 fan-in degree at the first edge switch (§5.1)
fan_in1   8..11 fan-in degree at the second edge switch; 0 = no second level (§4.1)
bitmap0   B=32  contributors at level 0 (children of the first edge switch)
bitmap1   B=32  contributors at level 1 (children of the second edge switch)
agg_index    32 CRC32(job, seq), written by the switch that hashed the packet (§5.3)
watermark    32 parameter packets: the PS shard's low watermark — every sequence of this
                shard below it is complete (used by switches to refuse stale allocations)
ps_index      2 parameter-server shard (seq mod #PS), ≤ 4 shards (released code: 2 bits)
edge          1 edge-switch identifier: 0 = en route to the first, 1 = to the second (§5.2)
agg1          1 the payload was aggregated at the second level: bitmap1 names contributors
is_param      1 parameter (ACK) packet, PS → workers (§5.2)
resend        1 retransmitted / must not be aggregated upstream (§5.3)
collision     1 bypassed an occupied aggregator (§5.3 ①)
ecn           1 congestion experienced (§5.4); OR-ed through aggregation
overflow      1 some lane was saturated by quantization (:mod:`atp_pipeline.ina.quant`)
reserved    pad zero; pads the header to whole bytes; non-zero = malformed
========== ==== ==========================================================================

The bitmap width is a format parameter: 32 (the released code, and what two-level
aggregation of 1,024 workers needs per level) or wider, for the single-level comparison.
A packet's L2–L4 encapsulation (Ethernet/IPv4/UDP, 42 bytes) carries the source and
destination addresses; in the simulator they are the ``src``/``dst`` attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

ATP_APP_TYPE = 0xA7
L2L4_OVERHEAD_BYTES = 42  # Ethernet 14 + IPv4 20 + UDP 8
ATP_UDP_PORT = 0xA7A7  # UDP destination port that carries ATP: the switches' classifier (§5.3)
DEFAULT_K = 62
DEFAULT_BITMAP_BITS = 32


@dataclass(frozen=True)
class Field:
    """One header field: its name, width in bits and meaning."""

    name: str
    bits: int
    doc: str = ""


class DecodeError(ValueError):
    """A buffer that is not a well-formed ATP packet (truncated, oversized, bad bits)."""


class Packet:
    """An ATP packet in host form: every header field as an int, ``payload`` int32 lanes.

    ``src``/``dst``/``size`` belong to the encapsulation (addresses, wire bytes) and are
    not part of the ATP header. Switch and end-host logic mutate packets in place; code
    that duplicates a packet uses :meth:`copy` (the payload array is shared and treated as
    immutable once a packet is built).
    """

    __slots__ = (
        "app_type", "job", "seq", "worker_id", "fan_in0", "fan_in1", "bitmap0", "bitmap1",
        "agg_index", "watermark", "ps_index", "edge", "agg1", "is_param", "resend",
        "collision", "ecn", "overflow", "reserved", "payload", "src", "dst", "size",
    )

    def __init__(self, **kw: Any) -> None:
        self.app_type = ATP_APP_TYPE
        self.job = self.seq = self.worker_id = 0
        self.fan_in0 = self.fan_in1 = self.bitmap0 = self.bitmap1 = 0
        self.agg_index = self.watermark = self.ps_index = 0
        self.edge = self.agg1 = self.is_param = self.resend = 0
        self.collision = self.ecn = self.overflow = self.reserved = 0
        self.payload: np.ndarray = _EMPTY
        self.src = self.dst = -1
        self.size = 0
        for k, v in kw.items():
            setattr(self, k, v)

    def copy(self) -> "Packet":
        p = Packet.__new__(Packet)
        p.app_type, p.job, p.seq, p.worker_id = self.app_type, self.job, self.seq, self.worker_id
        p.fan_in0, p.fan_in1, p.bitmap0, p.bitmap1 = self.fan_in0, self.fan_in1, self.bitmap0, self.bitmap1
        p.agg_index, p.watermark, p.ps_index, p.edge = self.agg_index, self.watermark, self.ps_index, self.edge
        p.agg1, p.is_param, p.resend, p.collision = self.agg1, self.is_param, self.resend, self.collision
        p.ecn, p.overflow, p.reserved, p.payload = self.ecn, self.overflow, self.reserved, self.payload
        p.src, p.dst, p.size = self.src, self.dst, self.size
        return p

    def header(self) -> Dict[str, int]:
        return {s: getattr(self, s) for s in Packet.__slots__[:19]}

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        flags = "".join(
            c for c, f in (("P", self.is_param), ("R", self.resend), ("C", self.collision),
                           ("E", self.ecn), ("O", self.overflow), ("A", self.agg1)) if f
        )
        return (f"Packet(job={self.job} seq={self.seq} w={self.worker_id} edge={self.edge} "
                f"bm0={self.bitmap0:#x} bm1={self.bitmap1:#x} {flags} {self.src}->{self.dst})")


_EMPTY = np.zeros(0, dtype=np.int32)


def atp_fields(bitmap_bits: int = DEFAULT_BITMAP_BITS) -> Tuple[Field, ...]:
    """The ATP header field table for a given bitmap width (see the module docstring)."""
    fan_bits = max(8, int(bitmap_bits).bit_length())
    body = [
        Field("app_type", 8, "ATP classifier constant"),
        Field("job", 16, "job id"),
        Field("seq", 32, "element sequence number"),
        Field("worker_id", 16, "sender worker id within the job"),
        Field("fan_in0", fan_bits, "fan-in at the first edge switch"),
        Field("fan_in1", fan_bits, "fan-in at the second edge switch (0: none)"),
        Field("bitmap0", bitmap_bits, "level-0 contributor bitmap"),
        Field("bitmap1", bitmap_bits, "level-1 contributor bitmap"),
        Field("agg_index", 32, "CRC32(job, seq) written by the hashing switch"),
        Field("watermark", 32, "PS shard low watermark (parameter packets)"),
        Field("ps_index", 2, "parameter-server shard"),
        Field("edge", 1, "edge-switch identifier"),
        Field("agg1", 1, "aggregated at level 1"),
        Field("is_param", 1, "parameter / ACK packet"),
        Field("resend", 1, "retransmitted, do not aggregate upstream"),
        Field("collision", 1, "bypassed an occupied aggregator"),
        Field("ecn", 1, "congestion experienced"),
        Field("overflow", 1, "quantization saturated a lane"),
    ]
    used = sum(f.bits for f in body)
    pad = (-used) % 8
    if pad:
        body.append(Field("reserved", pad, "zero padding"))
    return tuple(body)


class PacketFormat:
    """A concrete ATP wire format: field table + ``payload_k`` int32 lanes.

    >>> fmt = PacketFormat()
    >>> fmt.header_bytes, fmt.atp_bytes, fmt.wire_bytes
    (29, 277, 319)
    """

    def __init__(self, payload_k: int = DEFAULT_K, bitmap_bits: int = DEFAULT_BITMAP_BITS, views: bool = False) -> None:
        if payload_k < 1:
            raise ValueError(f"payload_k must be >= 1, got {payload_k}")
        if bitmap_bits < 1:
            raise ValueError(f"bitmap_bits must be >= 1, got {bitmap_bits}")
        self.payload_k = int(payload_k)
        self.bitmap_bits = int(bitmap_bits)
        #: decode payloads as read-only big-endian views of the received bytes (no copy, no
        #: byte swap; the live roles and workers) instead of native int32 copies
        self.views = bool(views)
        self.fields: Tuple[Field, ...] = atp_fields(bitmap_bits)
        self.header_bits = sum(f.bits for f in self.fields)
        self.header_bytes = self.header_bits // 8
        self.payload_bytes = 4 * self.payload_k
        self.atp_bytes = self.header_bytes + self.payload_bytes
        self.wire_bytes = self.atp_bytes + L2L4_OVERHEAD_BYTES
        self._spec: List[Tuple[str, int, int]] = []  # (name, shift, mask) for decode
        shift = self.header_bits
        for f in self.fields:
            shift -= f.bits
            self._spec.append((f.name, shift, (1 << f.bits) - 1))
        self._payload_dtype = np.dtype(">i4")
        self._enc_header, self._dec_header = _compile_codec(self._spec, self.header_bytes)

    @property
    def wire_dtype(self) -> np.dtype:
        """The payload lanes as they travel: big-endian int32."""
        return self._payload_dtype

    # -- introspection -----------------------------------------------------------------
    def layout(self) -> List[Tuple[str, int, int]]:
        """``[(name, bit_offset_from_header_start, bits), ...]`` followed by the payload."""
        out, off = [], 0
        for f in self.fields:
            out.append((f.name, off, f.bits))
            off += f.bits
        return out

    def packet(self, **kw: Any) -> Packet:
        """A packet of this format (payload zeros unless given), ``size`` = wire bytes."""
        p = Packet(**kw)
        if p.payload is _EMPTY:
            p.payload = np.zeros(self.payload_k, dtype=np.int32)
        p.size = self.wire_bytes
        return p

    # -- codec -------------------------------------------------------------------------
    def split(self, buf: bytes) -> List[Any]:
        """The packets of one datagram that carries several (the live path's batching, issue
        28): slices of :attr:`atp_bytes`; a ragged tail stays one slice (malformed on decode)."""
        n, size = len(buf), self.atp_bytes
        if n <= size:
            return [buf]
        mv = memoryview(buf)
        return [mv[o:o + size] for o in range(0, n, size)]

    def encode(self, pkt: Packet) -> bytes:
        """Header fields MSB-first in table order, then ``K`` big-endian int32 lanes."""
        h = self._enc_header(pkt)
        if h is None:  # some field out of range: name it
            for f in self.fields:
                v = getattr(pkt, f.name)
                if not 0 <= v < (1 << f.bits):
                    raise ValueError(f"field {f.name}={v} does not fit {f.bits} bits")
        payload = np.asarray(pkt.payload)
        if payload.shape != (self.payload_k,):
            raise ValueError(f"payload must have {self.payload_k} lanes, got {np.shape(payload)}")
        return h + payload.astype(self._payload_dtype, copy=False).tobytes()

    def decode(self, buf: bytes) -> Packet:
        """Inverse of :meth:`encode`; raises :class:`DecodeError` on any malformed buffer."""
        if len(buf) != self.atp_bytes:
            kind = "truncated" if len(buf) < self.atp_bytes else "oversized"
            raise DecodeError(f"{kind} packet: {len(buf)} bytes, expected {self.atp_bytes}")
        p = self._dec_header(int.from_bytes(buf[: self.header_bytes], "big"))
        if p.app_type != ATP_APP_TYPE:
            raise DecodeError(f"app_type {p.app_type:#x} is not ATP")
        if p.reserved:
            raise DecodeError("reserved bits set")
        p.payload = np.frombuffer(buf, dtype=self._payload_dtype, offset=self.header_bytes)
        if not self.views:
            p.payload = p.payload.astype(np.int32)
        p.src = p.dst = -1
        p.size = self.wire_bytes
        return p


def _compile_codec(spec: List[Tuple[str, int, int]], header_bytes: int) -> Tuple[Any, Any]:
    """Header encoder and decoder generated from the field table (one Python expression each
    instead of a loop over fields: the live roles encode and decode every packet).

    The encoder returns the header bytes, or ``None`` when a field does not fit its width
    (the caller names it); the decoder returns a :class:`Packet` with every header field set."""
    names = [n for n, _, _ in spec]
    load = "; ".join(f"v{i} = p.{n}" for i, n in enumerate(names))
    bad = " | ".join(f"(v{i} >> {(m).bit_length()})" for i, (_, _, m) in enumerate(spec))
    neg = " or ".join(f"v{i} < 0" for i in range(len(spec)))
    word = " | ".join(f"(v{i} << {sh})" for i, (_, sh, _) in enumerate(spec))
    src = (f"def enc(p):\n    {load}\n    if ({bad}) or {neg}:\n        return None\n"
           f"    return ({word}).to_bytes({header_bytes}, 'big')\n"
           f"def dec(h):\n    p = new(Packet)\n    p.reserved = 0\n"
           + "".join(f"    p.{n} = (h >> {sh}) & {m}\n" for n, sh, m in spec) + "    return p\n")
    ns: Dict[str, Any] = {"Packet": Packet, "new": Packet.__new__}
    exec(compile(src, "<atp-packet-codec>", "exec"), ns)  # noqa: S102 - generated from the field table
    return ns["enc"], ns["dec"]


def validate_gradient(pkt: Packet, bitmap_bits: int) -> Optional[str]:
    """Role-independent sanity checks of a decoded gradient header; a reason or ``None``.

    Used by every role before touching state, so malformed packets are dropped and counted
    (never crash, never corrupt an aggregator).
    """
    if pkt.fan_in0 < 1 or pkt.fan_in0 > bitmap_bits or pkt.fan_in1 > bitmap_bits:
        return "fan-in out of range"
    if pkt.bitmap0 == 0 or pkt.bitmap0 >> pkt.fan_in0:
        return "bitmap0 outside fan-in"
    if pkt.fan_in1 and (pkt.bitmap1 == 0 or pkt.bitmap1 >> pkt.fan_in1):
        return "bitmap1 outside fan-in"
    return None
