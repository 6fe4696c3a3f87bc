"""SwitchML's wire format (:class:`SMLFormat`): the header of :data:`SML_FIELDS` (10 bytes, the
size the planner's estimate assumes) then ``K`` big-endian int32 lanes, or none for an
exponent-only packet (``empty``) or a packet whose lanes are in the sender's shared memory
(:data:`SHM_FLAG`); the packet object both roles pass around (:class:`SMLPacket`); and the
header as a numpy record (:data:`WIRE_HEADER`) for the roles that read and write headers as
arrays."""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from atp_pipeline.ina.packet import L2L4_OVERHEAD_BYTES, DecodeError, Field

EXP_BIAS = 128  # the exponent field holds e + 128; 0 = "no next chunk" (below every real exponent)
EXP_MIN, EXP_MAX = -127, 126  # |x| < 2^e for every representable chunk; a larger one is refused
NO_LANES = np.zeros(0, dtype=np.int32)  # an exponent-only packet's payload
IN_SHM = np.zeros(1, dtype=np.int32)  # a sent chunk whose lanes are in the worker's shared memory (not on the wire)

#: SwitchML's header (as modelled): job, slot, version, result flag, exponent-only flag,
#: worker, offset (the chunk's index in the worker's stream), shared exponent (biased).
SML_FIELDS = (Field("job", 16), Field("slot", 16), Field("ver", 1), Field("is_result", 1), Field("empty", 1),
              Field("pad", 5), Field("worker", 8), Field("off", 24), Field("exp", 8))
MAX_ITEMS = 1 << 24  # stream items (chunks + one exponent-only packet per slot) of one tensor
SML_HEADER_BYTES = sum(f.bits for f in SML_FIELDS) // 8
SHM_FLAG = 0x10  # flags bit: the lanes are in the sender's shared memory (SMLFormat(shm=True))
#: the header as numpy reads it off the wire (:class:`SMLFormat`'s ``>HHBBI``): flags = ver, is_result,
#: empty, shm, 4 reserved bits; word = off (24 bits), exp (8)
WIRE_HEADER = np.dtype([("job", ">u2"), ("slot", ">u2"), ("flags", "u1"), ("worker", "u1"), ("word", ">u4")])


class SMLPacket:
    """One SwitchML packet as the roles handle it (:class:`SMLFormat` encodes and decodes it); ``payload``:
    its lanes (int32), :data:`NO_LANES` for an exponent-only packet, None where they are in shared memory."""

    __slots__ = ("job", "slot", "ver", "is_result", "worker", "off", "exp", "payload", "src", "dst", "size", "ecn",
                 "is_param")

    def copy(self) -> "SMLPacket":
        p = SMLPacket.__new__(SMLPacket)
        p.job, p.slot, p.ver, p.is_result, p.worker, p.off, p.exp = (self.job, self.slot, self.ver, self.is_result,
                                                                   self.worker, self.off, self.exp)
        p.payload, p.src, p.dst, p.size, p.ecn, p.is_param = (self.payload, self.src, self.dst, self.size, self.ecn,
                                                              self.is_param)
        return p


class SMLFormat:
    """SwitchML's wire format (:mod:`atp_pipeline.ina.switchml`): 10-byte header, then ``K`` lanes or none."""

    _HDR = struct.Struct(">HHBBI")  # ... worker, then off (24 bits) and exp (8) in one word

    def __init__(self, payload_k: int, shm: bool = False) -> None:
        self.payload_k = int(payload_k)
        #: the shared-memory transport (``aggregation.transport=shm``): a packet with lanes travels
        #: as its header with :data:`SHM_FLAG` set, its lanes stay in the sender's shared memory
        #: (decoded with ``payload=None``: the receiver attaches them, :class:`SMLFloatWorker`)
        self.shm = bool(shm)
        self.header_bytes = self._HDR.size
        assert self.header_bytes == SML_HEADER_BYTES
        self.atp_bytes = self.header_bytes + 4 * self.payload_k  # the largest packet (a full one)
        self.wire_bytes = self.atp_bytes + L2L4_OVERHEAD_BYTES
        self._dtype = np.dtype(">i4")

    @property
    def wire_dtype(self) -> np.dtype:
        """The lanes as they travel: big-endian int32."""
        return self._dtype

    def encode(self, p: SMLPacket) -> bytes:
        """The packet's bytes: its header, and its lanes unless it is exponent-only or (the shared-memory
        transport) its lanes are in shared memory — also where ``payload`` is None (a packet decoded
        from a header alone)."""
        empty = p.payload is not None and p.payload.size == 0
        shm = SHM_FLAG if self.shm and not empty else 0
        if p.payload is None and not shm:
            raise ValueError("a SwitchML packet without lanes travels over the shared-memory transport only")
        h = self._HDR.pack(p.job, p.slot, p.ver << 7 | p.is_result << 6 | empty << 5 | shm, p.worker,
                           p.off << 8 | p.exp)
        return h if empty or shm else h + p.payload.astype(self._dtype, copy=False).tobytes()

    def decode(self, buf: bytes) -> SMLPacket:
        hb = self.header_bytes
        if len(buf) < hb:
            raise DecodeError(f"truncated SwitchML packet: {len(buf)} bytes")
        job, slot, flags, worker, word = self._HDR.unpack_from(buf)
        off, exp = word >> 8, word & 0xFF
        empty, shm = flags >> 5 & 1, flags & SHM_FLAG
        if flags & 0x0F or (shm and (empty or not self.shm)) or len(buf) != (hb if empty or shm else self.atp_bytes):
            raise DecodeError(f"malformed SwitchML packet ({len(buf)} bytes, flags {flags:#x})")
        p = SMLPacket.__new__(SMLPacket)
        p.job, p.slot, p.ver, p.is_result, p.worker, p.off, p.exp = (job, slot, flags >> 7, flags >> 6 & 1, worker,
                                                                     off, exp)
        p.payload = (NO_LANES if empty else None if shm
                     else np.frombuffer(buf, dtype=self._dtype, offset=hb).astype(np.int32))
        p.src = p.dst = -1
        p.size, p.ecn, p.is_param = len(buf) + L2L4_OVERHEAD_BYTES, 0, 0
        return p

    # ------------------------------------------------------------------ headers as arrays
    def headers(self, bufs: Sequence[bytes]) -> Optional[np.ndarray]:
        """The datagrams ``bufs`` as one array of :data:`WIRE_HEADER` headers, when every packet in
        them is a header alone (exponent-only, or lanes in shared memory) and well formed; else
        None (decode them packet by packet)."""
        data = b"".join(bufs)
        if len(data) % self.header_bytes:
            return None
        h = np.frombuffer(data, dtype=WIRE_HEADER)
        fl = h["flags"]
        empty, shm = (fl & 0x20) != 0, (fl & SHM_FLAG) != 0
        ok = ((fl & 0x0F) == 0) & (empty ^ shm) & (self.shm | ~shm)
        return h if ok.all() else None

    def header_array(self, pkts: Sequence[SMLPacket]) -> np.ndarray:
        """The headers of packets as one :data:`WIRE_HEADER` array (what :meth:`encode` writes for
        packets without lanes on the wire: exponent-only, or lanes in shared memory)."""
        h = np.zeros(len(pkts), dtype=WIRE_HEADER)
        if pkts:
            h["job"] = [p.job for p in pkts]
            h["slot"] = [p.slot for p in pkts]
            shm = SHM_FLAG if self.shm else 0
            h["flags"] = [p.ver << 7 | p.is_result << 6 | (0x20 if p.payload is not None and p.payload.size == 0
                                                           else shm) for p in pkts]
            h["worker"] = [p.worker for p in pkts]
            h["word"] = [p.off << 8 | p.exp for p in pkts]
        return h

    @staticmethod
    def fields(h: np.ndarray, arrays: bool = False) -> Dict[str, Any]:
        """The header fields of ``h`` as lists (job, slot, ver, is_result, empty, worker, off, exp), or
        as int64 arrays (``arrays``)."""
        fl, word = h["flags"], h["word"]
        if arrays:
            i8 = np.int64
            return {"job": h["job"].astype(i8), "slot": h["slot"].astype(i8), "ver": (fl >> 7).astype(i8),
                    "is_result": (fl >> 6 & 1).astype(i8), "empty": (fl >> 5 & 1).astype(i8),
                    "worker": h["worker"].astype(i8), "off": (word >> 8).astype(i8), "exp": (word & 0xFF).astype(i8)}
        return {"job": h["job"].tolist(), "slot": h["slot"].tolist(), "ver": (fl >> 7).tolist(),
                "is_result": (fl >> 6 & 1).tolist(), "empty": (fl >> 5 & 1).tolist(), "worker": h["worker"].tolist(),
                "off": (word >> 8).tolist(), "exp": (word & 0xFF).tolist()}

    @staticmethod
    def results(h: np.ndarray, idx: Sequence[int], exp: Sequence[int]) -> np.ndarray:
        """The result headers of packets ``idx`` of ``h``: the result flag set, ``exp`` the shared
        exponent (the rest as received: its lanes stay where they are)."""
        r = h[np.asarray(idx, dtype=np.intp)]  # a copy
        r["flags"] |= 0x40
        r["word"] = (r["word"] & 0xFFFFFF00) | np.asarray(exp, dtype=np.uint32)
        return r

    def split(self, buf: bytes) -> List[bytes]:
        """The packets of one datagram (each packet's ``empty`` flag gives its length)."""
        n, hb, full = len(buf), self.header_bytes, self.atp_bytes
        out: List[bytes] = []
        mv = memoryview(buf)
        o = 0
        while o < n:
            size = hb if o + 4 < n and buf[o + 4] & (0x20 | SHM_FLAG) else full  # exponent-only or lanes in shm
            out.append(mv[o:o + size])  # type: ignore[arg-type]
            o += size
        return out
