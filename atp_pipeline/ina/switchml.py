"""SwitchML's protocol (Sapio et al., NSDI'21; the ATP paper's main comparison, §3, §6, §7).

One implementation, run by the simulator (:mod:`atp_pipeline.ina.sim.switchml`) and by the
live switch role (:mod:`atp_pipeline.ina.live.nodes`, ``--protocol switchml``):

* :class:`SMLSwitch` — the switch function: a job's static partition of ``pool`` slots × 2
  versions (the shadow copy that makes retransmission safe); a slot sums its ``W`` workers'
  contributions, then multicasts the result, which is also every worker's ACK; a
  retransmission for a completed slot gets the result by unicast. Each packet also carries
  an 8-bit exponent that the slot aggregates by *max* (the shared block exponent below).
* :class:`SMLWorker` — streams a tensor's chunks through the slots (chunk ``i`` in slot
  ``i mod pool``, a new chunk of a slot when the slot's previous result arrives, version
  ``uses mod 2``), per-slot timeout retransmission, no congestion control.
* :class:`SMLFloatWorker` — SwitchML's quantization on top (its §3.3/§5): each packet of
  slot ``s`` carries the local exponent of the *next* chunk of ``s``; the switch returns the
  max over workers with the result, and every worker quantizes that next chunk with the
  shared exponent ``e``: ``q = rint(x · 2^(B−e))`` with ``2^B ≤ ⌊(2³¹−1)/W⌋``, so every
  partial sum of ``W`` workers fits an int32 and the integer sums are exact. A tensor's first
  use of each slot is an exponent-only packet (no lanes). The result is
  ``Σq · 2^(e−B)``, the same bits on every worker whatever was lost on the way.
* :class:`SMLFormat` — the wire format: the header of :data:`SML_FIELDS` (10 bytes, the size the
  planner's estimate assumes) then
  ``K`` big-endian int32 lanes, or none for an exponent-only packet (``empty``).

Loss is recovered by the per-slot timeout only; the two-version scheme assumes no
duplication and reordering bounded by one slot version (a duplicate delayed past the slot's
next use is counted again), so the live backend injects loss only.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from typing import Any, Deque, Dict, List, Optional

import numpy as np

from atp_pipeline.ina.counters import Counters
from atp_pipeline.ina.packet import L2L4_OVERHEAD_BYTES, DecodeError, Field
from atp_pipeline.ina.quant import lane_limit

EXP_BIAS = 128  # the exponent field holds e + 128; 0 = "no next chunk" (below every real exponent)
EXP_MIN, EXP_MAX = -127, 126  # |x| < 2^e for every representable chunk; a larger one is refused
_EMPTY = np.zeros(0, dtype=np.int32)

#: SwitchML's header (as modelled): job, slot, version, result flag, exponent-only flag,
#: worker, offset (the chunk's index in the worker's stream), shared exponent (biased).
SML_FIELDS = (Field("job", 16), Field("slot", 16), Field("ver", 1), Field("is_result", 1), Field("empty", 1),
              Field("pad", 5), Field("worker", 8), Field("off", 24), Field("exp", 8))
MAX_ITEMS = 1 << 24  # stream items (chunks + one exponent-only packet per slot) of one tensor
SML_HEADER_BYTES = sum(f.bits for f in SML_FIELDS) // 8
SHM_FLAG = 0x10  # flags bit: the lanes are in the sender's shared memory (SMLFormat(shm=True))
F32_SHIFTS = (-126, 127)  # 2^s is a normal float32: a float32 chunk is scaled in float32, exactly


class SMLPacket:
    __slots__ = ("job", "slot", "ver", "is_result", "worker", "off", "exp", "payload", "src", "dst", "size", "ecn",
                 "is_param")

    def copy(self) -> "SMLPacket":
        p = SMLPacket.__new__(SMLPacket)
        p.job, p.slot, p.ver, p.is_result, p.worker, p.off, p.exp = (self.job, self.slot, self.ver, self.is_result,
                                                                   self.worker, self.off, self.exp)
        p.payload, p.src, p.dst, p.size, p.ecn, p.is_param = (self.payload, self.src, self.dst, self.size, self.ecn,
                                                              self.is_param)
        return p


class SMLSwitchJob:
    """One job's static partition on the switch: ``pool`` slots × 2 versions."""

    def __init__(self, job: int, n_workers: int, pool: int, k: int, mcast: int, worker_hosts: List[int],
                 values: Optional[np.ndarray] = None) -> None:
        self.job, self.W, self.pool, self.k = job, n_workers, pool, k
        self.mcast = mcast
        self.hosts = worker_hosts
        #: the slots' sums, version-major; ``values``: an int32 array of that shape to keep them in
        #: (the shared-memory transport's, which the workers read the results from)
        self.values = np.zeros((2, pool, k), dtype=np.int32) if values is None else values
        self.count = np.zeros((2, pool), dtype=np.int64).tolist()
        self.seen = [[0] * pool, [0] * pool]  # bitmaps per version
        self.exp = [[0] * pool, [0] * pool]  # max of the contributions' exponents per version
        self.stats = dict(merged=0, complete=0, result_unicast=0, dropped=0)


class SMLSwitch:
    """The SwitchML data plane of one ToR (SwitchML Algorithm with shadow copies)."""

    def __init__(self) -> None:
        self.jobs: Dict[int, SMLSwitchJob] = {}
        self.unknown = 0

    def __call__(self, p: SMLPacket, link: Any) -> List[SMLPacket]:
        js = self.jobs.get(p.job)
        if js is None or p.is_result or not 0 <= p.slot < js.pool or not 0 <= p.worker < js.W:
            self.unknown += 1
            return []
        v, i, bit = p.ver, p.slot, 1 << p.worker
        if not js.seen[v][i] & bit:
            js.seen[v][i] |= bit
            js.seen[v ^ 1][i] &= ~bit
            c = js.count[v][i] = (js.count[v][i] + 1) % js.W
            row = js.values[v, i]
            lanes = p.payload.size  # 0: an exponent-only packet
            if c == 1 or js.W == 1:
                if lanes:
                    row[:] = p.payload
                js.exp[v][i] = p.exp
            else:
                if lanes:
                    np.add(row, p.payload, out=row)
                if p.exp > js.exp[v][i]:
                    js.exp[v][i] = p.exp
            js.stats["merged"] += 1
            if c == 0:
                js.stats["complete"] += 1
                p.payload = row.copy() if lanes else p.payload
                p.exp = js.exp[v][i]
                p.is_result = 1
                p.dst = js.mcast
                return [p]
            return []
        if js.count[v][i] == 0:  # complete: a retransmission gets the result by unicast
            js.stats["result_unicast"] += 1
            p.payload = js.values[v, i].copy() if p.payload.size else p.payload
            p.exp = js.exp[v][i]
            p.is_result = 1
            p.dst = js.hosts[p.worker]
            return [p]
        js.stats["dropped"] += 1
        return []


class SMLWorkerStats(Counters):
    __slots__ = ("sent", "retransmits", "timeouts", "acks", "dup_acks")


class SMLWorker:
    """SwitchML worker: one outstanding chunk per slot, per-slot timeout retransmission."""

    reo_deadline = None  # no reordering timer (only ATP workers have one)

    def __init__(self, job: int, wid: int, host: int, tor: Any, pool: int, k: int, rto: float) -> None:
        self.job, self.wid, self.host, self.pool, self.k, self.rto = job, wid, host, pool, k, rto
        self.tor_addr = tor
        self.size = SML_HEADER_BYTES + 4 * k + L2L4_OVERHEAD_BYTES
        self.stats = SMLWorkerStats()
        self.uses = [0] * pool  # chunks sent through each slot so far (all rounds): version
        self.stride = pool  # items between two uses of one slot
        self.done = True

    def start(self, tensor: np.ndarray, base_seq: int, now: float) -> List[SMLPacket]:
        t = np.asarray(tensor, dtype=np.int32)
        n = max(1, -(-len(t) // self.k))
        buf = np.zeros(n * self.k, dtype=np.int32)
        buf[: len(t)] = t
        self.length, self.n = len(t), n
        self.chunks = buf.reshape(n, self.k)
        self.result = np.zeros((n, self.k), dtype=np.int32)
        self.got = bytearray(n)
        self.n_got = 0
        self.deadline: List[Optional[float]] = [None] * self.pool
        self.cur: List[int] = list(range(min(self.pool, n))) + [-1] * max(0, self.pool - n)
        self.ver: List[int] = [0] * self.pool
        self.timers: Deque[tuple] = deque()
        self.done = False
        return [self._send(i, self.cur[i], now, 0) for i in range(min(self.pool, n))]

    def _send(self, slot: int, chunk: int, now: float, resend: int) -> SMLPacket:
        if not resend:  # a new chunk in this slot flips the slot's version
            self.ver[slot] = self.uses[slot] & 1
            self.uses[slot] += 1
        p = SMLPacket.__new__(SMLPacket)
        p.job, p.slot, p.ver, p.is_result, p.worker, p.off = self.job, slot, self.ver[slot], 0, self.wid, chunk
        p.exp = 0
        p.payload = self.chunks[chunk]
        p.src, p.dst, p.size, p.ecn, p.is_param = self.host, self.tor_addr, self.size, 0, 0
        self.deadline[slot] = now + self.rto
        self.timers.append((now + self.rto, slot, chunk))
        self.stats.sent += 1
        if resend:
            self.stats.retransmits += 1
        return p

    def on_packet(self, p: SMLPacket, now: float) -> List[SMLPacket]:
        if self.done or p.job != self.job or not p.is_result:
            return []
        c = p.off
        if not 0 <= c < self.n or self.got[c] or self.cur[p.slot] != c:
            self.stats.dup_acks += 1
            return []
        self.stats.acks += 1
        self.got[c] = 1
        self.n_got += 1
        self._store(c, p)
        nxt = c + self.stride  # the slot's next item
        if self.n_got == self.n:
            self.done = True
            self.timers.clear()
            return []
        if nxt < self.n:
            self.cur[p.slot] = nxt
            return [self._send(p.slot, nxt, now, 0)]
        self.cur[p.slot] = -1
        self.deadline[p.slot] = None
        return []

    def _store(self, c: int, p: SMLPacket) -> None:
        """Keep the result of chunk ``c``."""
        self.result[c] = p.payload

    def _valid(self, e: tuple) -> bool:
        d, slot, chunk = e
        return self.cur[slot] == chunk and self.deadline[slot] == d and not self.got[chunk]

    def next_deadline(self) -> Optional[float]:
        t = self.timers
        while t and not self._valid(t[0]):
            t.popleft()
        return t[0][0] if t else None

    def poll(self, now: float) -> List[SMLPacket]:
        """Per-slot timeout: resend the slot's outstanding chunk."""
        out = []
        t = self.timers
        while t and t[0][0] <= now:
            e = t.popleft()
            if self._valid(e):
                self.stats.timeouts += 1
                out.append(self._send(e[1], e[2], now, 1))
        return out

    @property
    def delivered_bytes(self) -> int:
        return self.stats.acks * 4 * self.k

    @property
    def result_tensor(self) -> np.ndarray:
        return self.result.ravel()[: self.length]




class SMLFloatWorker(SMLWorker):
    """A SwitchML worker for float tensors: per-packet shared exponents (module docstring).

    Stream item ``t`` of a tensor of ``n`` chunks, with ``P = min(pool, n)`` slots in use, goes
    through slot ``t mod P``: items ``0 … P−1`` are exponent-only, item ``t ≥ P`` carries chunk
    ``t − P``; every item ``t`` carries the local exponent of chunk ``t`` (the next item of
    its slot quantizes it), so chunk ``c`` is quantized with the exponent returned with
    item ``c``'s result."""

    def __init__(self, job: int, wid: int, n_workers: int, pool: int, k: int, rto: float,
                 lanes: Optional[np.ndarray] = None, results: Optional[np.ndarray] = None) -> None:
        """``lanes``/``results`` (both or neither): the shared-memory transport's int32 arrays of
        shape ``(2, pool, k)`` — this worker's, where it quantizes the chunk it sends through
        slot ``s`` in version ``v`` (``lanes[v, s]``), and the switch's job registers, where it
        reads a result. A slot-version is rewritten only after every worker has read the result
        it held: a worker sends the slot's next chunk (the other version) only once it has that
        result, and the version after that needs every worker's contribution to the other one —
        SwitchML's shadow copy is what makes the sharing safe."""
        super().__init__(job, wid, wid, None, pool, k, rto)
        self.bits = int(math.floor(math.log2(lane_limit(n_workers))))  # B: 2^B ≤ Q(W)
        if (lanes is None) != (results is None):
            raise ValueError("the shared-memory transport needs both the worker's lanes and the switch's results")
        for a in (lanes, results):
            if a is not None and (a.shape != (2, pool, k) or a.dtype != np.int32):
                raise ValueError(f"shared-memory lanes must be int32 of shape (2, {pool}, {k}), got {a.dtype} {a.shape}")
        self.lanes, self.results = lanes, results
        self._pad: Optional[np.ndarray] = None  # the padded copy of the last tensor (start_float)
        self.fmt = SMLFormat(k, shm=lanes is not None)
        self.malformed = 0

    def on_bytes(self, buf: bytes, now: float) -> List[SMLPacket]:
        """A received datagram's packet (decoded; malformed ones counted and dropped; a result
        whose lanes are in shared memory gets them from the switch's registers)."""
        try:
            p = self.fmt.decode(buf)
        except DecodeError:
            self.malformed += 1
            return []
        if p.payload is None:
            if self.results is None or not 0 <= p.slot < self.pool:
                self.malformed += 1
                return []
            p.payload = self.results[p.ver, p.slot]
        return self.on_packet(p, now)

    def start_float(self, x: np.ndarray, now: float) -> List[SMLPacket]:
        """Begin streaming ``x`` (finite floats, ``|x| < 2^127``); the packets to send.

        A float32 ``x`` stays float32 (issue 28: half the bytes per pass): scaling by a power of
        two is exact in either type and the rounded integers are the same (a value whose
        scaled magnitude would be subnormal in float32 rounds to 0 either way)."""
        x = np.asarray(x).ravel()
        if x.dtype != np.float32:
            x = x.astype(np.float64, copy=False)
        k = self.k
        n = max(1, -(-len(x) // k))
        buf = self._pad if self._pad is not None and self._pad.size == n * k and self._pad.dtype == x.dtype else None
        if buf is None:  # kept while the size stays (the padding is never written: it stays 0)
            buf = self._pad = np.zeros(n * k, dtype=x.dtype)
        buf[: len(x)] = x
        self.length, self.chunks_f = len(x), buf.reshape(n, k)
        peak = np.maximum(self.chunks_f.max(axis=1), -self.chunks_f.min(axis=1))
        if not np.isfinite(peak).all():
            raise ValueError("NaN/inf gradients")
        e = np.frexp(peak)[1].astype(np.int64)  # |x| < 2^e per chunk (frexp: peak = m·2^e, 0.5 ≤ m < 1)
        e[peak == 0] = EXP_MIN
        if int(e.max()) > EXP_MAX:
            raise ValueError(f"a gradient of magnitude {float(peak.max()):.3g} exceeds SwitchML's exponent range")
        self.local_exp = (np.maximum(e, EXP_MIN) + EXP_BIAS).tolist()
        P = min(self.pool, n)
        if P + n > MAX_ITEMS:
            raise ValueError(f"{n} packets of {k} values exceed SwitchML's 24-bit packet offset: raise payload_k")
        self.P, self.n_chunks, self.stride = P, n, P
        self.n = P + n  # stream items
        self.chunks = [_EMPTY] * P + [None] * n  # type: ignore[list-item] - quantized when sent
        self.shared = [0] * n  # the exponent (biased) chunk c was quantized with
        self.result_q = np.zeros((n, k), dtype=np.int32)
        self.got = bytearray(self.n)
        self.n_got = 0
        self.deadline = [None] * self.pool
        self.cur = list(range(P)) + [-1] * (self.pool - P)
        self.ver = [0] * self.pool
        self.timers = deque()
        self.done = False
        return [self._send(t, t, now, 0) for t in range(P)]

    def _send(self, slot: int, item: int, now: float, resend: int) -> SMLPacket:
        if item >= self.P and self.chunks[item] is None:
            c = item - self.P  # q = rint(x · 2^(B−e)), straight to the wire's byte order
            sh = self.bits - (self.shared[c] - EXP_BIAS)
            xc = self.chunks_f[c]
            if not F32_SHIFTS[0] <= sh <= F32_SHIFTS[1]:  # 2^sh is no float32 (normal): in float64
                xc = xc.astype(np.float64)
            q = xc * xc.dtype.type(2.0 ** sh)
            np.rint(q, out=q)
            if self.lanes is None:
                self.chunks[item] = q.astype(self.fmt.wire_dtype)
            else:  # into this worker's shared lanes of the slot's next version (SMLWorker._send flips it)
                dst = self.lanes[self.uses[slot] & 1, slot]
                dst[...] = q  # |q| < 2^B: exact in int32
                self.chunks[item] = dst
        p = super()._send(slot, item, now, resend)
        p.exp = self.local_exp[item] if item < self.n_chunks else 0
        return p

    def _store(self, c: int, p: SMLPacket) -> None:
        if c < self.n_chunks:
            self.shared[c] = p.exp
        if c >= self.P:
            self.result_q[c - self.P] = p.payload

    @property
    def result_float(self) -> np.ndarray:
        """``Σq · 2^(e−B)`` per chunk: the sum over the job's workers (float64)."""
        return self.result_as(np.float64)

    def result_as(self, dtype: Any) -> np.ndarray:
        """:attr:`result_float` rounded once to ``dtype`` (each product is formed in float64, where
        it is exact, and rounded on the way out: no float64 copy of the whole result)."""
        e = np.asarray(self.shared, dtype=np.float64) - EXP_BIAS
        out = np.empty(self.result_q.shape, dtype=dtype)
        np.multiply(self.result_q, np.exp2(e - self.bits)[:, None], out=out, casting="same_kind")
        return out.ravel()[: self.length]


class SMLFormat:
    """SwitchML's wire format (module docstring): 10-byte header, then ``K`` lanes or none."""

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
        empty = p.payload.size == 0
        shm = SHM_FLAG if self.shm and not empty else 0
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
        p.job, p.slot, p.ver, p.is_result, p.worker, p.off, p.exp = job, slot, flags >> 7, flags >> 6 & 1, worker, off, exp
        p.payload = _EMPTY if empty else None if shm else np.frombuffer(buf, dtype=self._dtype, offset=hb).astype(np.int32)
        p.src = p.dst = -1
        p.size, p.ecn, p.is_param = len(buf) + L2L4_OVERHEAD_BYTES, 0, 0
        return p

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
