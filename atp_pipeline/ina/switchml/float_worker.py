"""SwitchML's quantization on the worker (Sapio et al., NSDI'21, §3.3/§5): :class:`SMLFloatWorker`.

Each packet of slot ``s`` carries the local exponent of the *next* chunk of ``s``; the switch
returns the max over workers with the result, and every worker quantizes that next chunk with the
shared exponent ``e``: ``q = rint(x · 2^(B−e))`` with ``2^B ≤ ⌊(2³¹−1)/W⌋``, so every partial sum
of ``W`` workers fits an int32 and the integer sums are exact. A tensor's first use of each slot
is an exponent-only packet (no lanes). The result is ``Σq · 2^(e−B)``, the same bits on every
worker whatever was lost on the way. The numpy work (quantization, dequantization) is done per
batch of packets (:meth:`SMLFloatWorker.flush`); with the shared-memory transport a batch of
results is handled on arrays (:meth:`SMLFloatWorker.on_headers`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.ina.packet import DecodeError
from atp_pipeline.ina.quant import lane_limit
from atp_pipeline.ina.switchml.ranges import run_of, runs
from atp_pipeline.ina.switchml.wire import (
    EXP_BIAS,
    EXP_MAX,
    EXP_MIN,
    IN_SHM,
    MAX_ITEMS,
    NO_LANES,
    SHM_FLAG,
    WIRE_HEADER,
    SMLFormat,
    SMLPacket,
)
from atp_pipeline.ina.switchml.worker import SMLWorker

#: values a worker scales and rounds per step (256 KiB of float32: in L2; smaller blocks cost more numpy
#: calls than they save)
QUANT_BLOCK = 65536
PEAK_BLOCK = 131072  # values whose max and min a worker takes per step (the second pass then reads from cache)
F32_SHIFTS = (-126, 127)  # 2^s is a normal float32: a float32 chunk is scaled in float32, exactly
#: a worker handles a batch of at least this many results in array form (SMLFloatWorker.on_headers)
WORKER_ARRAY_MIN = 32


class SMLFloatWorker(SMLWorker):
    """A SwitchML worker for float tensors: per-packet shared exponents (:mod:`atp_pipeline.ina.switchml`).

    Stream item ``t`` of a tensor of ``n`` chunks, with ``P = min(pool, n)`` slots in use, goes
    through slot ``t mod P``: items ``0 … P−1`` are exponent-only, item ``t ≥ P`` carries chunk
    ``t − P``; every item ``t`` carries the local exponent of chunk ``t`` (the next item of
    its slot quantizes it), so chunk ``c`` is quantized with the exponent returned with
    item ``c``'s result."""

    def __init__(self, job: int, wid: int, n_workers: int, pool: int, k: int, rto: float,
                 lanes: Optional[np.ndarray] = None, results: Optional[np.ndarray] = None,
                 window: Optional[int] = None) -> None:
        """``window``: at most this many slots of the pool in use (chunks in flight; all workers of a
        job must use the same). ``lanes``/``results`` (both or neither): the shared-memory transport's int32 arrays of
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
                raise ValueError(f"shared-memory lanes must be int32 of shape (2, {pool}, {k}), "
                                 f"got {a.dtype} {a.shape}")
        self.lanes, self.results = lanes, results
        self.window = pool if window is None else max(1, min(pool, int(window)))
        self._pad: Optional[np.ndarray] = None  # the padded tail chunk of the tensor (start_float)
        self._wire: Optional[np.ndarray] = None  # the quantized chunks on the wire (UDP transport)
        self._tmp: Optional[np.ndarray] = None  # quantization scratch, a row per chunk of a run
        self.fmt = SMLFormat(k, shm=lanes is not None)
        self.malformed = 0

    def on_bytes(self, buf: bytes, now: float) -> List[SMLPacket]:
        """A received packet (or datagram): :meth:`on_datagrams` of one."""
        return self.on_datagrams([buf], now)

    def on_datagrams(self, bufs: Sequence[bytes], now: float) -> List[SMLPacket]:
        """Received datagrams (decoded; malformed packets counted and dropped; a result whose lanes
        are in shared memory is read from the switch's registers): the packets to send, their
        lanes written (:meth:`flush`). With the shared-memory transport the datagrams are read as
        one array of headers."""
        out: List[SMLPacket] = []
        h = self.fmt.headers(bufs) if self.results is not None else None
        if h is not None:
            f = self.fmt.fields(h)
            result = self._result
            for job, res, slot, off, ver, exp in zip(f["job"], f["is_result"], f["slot"], f["off"], f["ver"],
                                                     f["exp"]):
                if job == self.job and res:
                    out += result(slot, off, ver, exp, None, now)
        else:
            for buf in bufs:
                for raw in self.fmt.split(buf):
                    try:
                        p = self.fmt.decode(raw)
                    except DecodeError:
                        self.malformed += 1
                        continue
                    if p.payload is None and self.results is None:
                        self.malformed += 1
                        continue
                    out += SMLWorker.on_packet(self, p, now)
        self.flush()
        return out

    def on_packet(self, p: SMLPacket, now: float) -> List[SMLPacket]:
        out = super().on_packet(p, now)
        self.flush()
        return out

    # ------------------------------------------------------------------ array form
    def on_headers(self, bufs: Sequence[bytes], now: float) -> np.ndarray:
        """:meth:`on_datagrams` with the shared-memory transport, in array form: the received
        headers read as one array and handled by :meth:`_results` (the per-packet rules of
        :meth:`SMLWorker._result` over all of them at once, no packet objects), the packets to send
        returned as one :data:`WIRE_HEADER` array (what :meth:`SMLFormat.header_array` writes
        for them). A batch the array form does not cover (a slot twice, malformed datagrams) goes
        packet by packet: the same outcome either way (tests/ina/test_switchml_live_core.py)."""
        h = self.fmt.headers(bufs) if self.results is not None else None
        if h is not None:
            fl = h["flags"]
            mine = (h["job"] == self.job) & ((fl & 0x40) != 0)
            if not mine.all():
                h, fl = h[mine], fl[mine]
            out = None if len(h) < WORKER_ARRAY_MIN else self._results(
                h["slot"].astype(np.int64), (h["word"] >> 8).astype(np.int64), (fl >> 7).astype(np.int64),
                (h["word"] & 0xFF).astype(np.int64), now)
            if out is not None:
                self.flush()
                return out
            pkts = []
            for slot, c, ver, exp in zip(h["slot"].tolist(), (h["word"] >> 8).tolist(), (fl >> 7).tolist(),
                                         (h["word"] & 0xFF).tolist()):
                pkts += self._result(slot, c, ver, exp, None, now)
            self.flush()
            return self.fmt.header_array(pkts)
        return self.fmt.header_array(self.on_datagrams(bufs, now))

    def _results(self, slot: np.ndarray, c: np.ndarray, ver: np.ndarray, exp: np.ndarray,
                 now: float) -> Optional[np.ndarray]:
        """:meth:`SMLWorker._result` of results ``(slot[j], c[j], ver[j], exp[j])`` in order, lanes
        in shared memory, as array operations; the headers of the packets they let go. None (and
        nothing changed) when two of them name one slot: then one result's effect can change
        another's validity, which the per-packet form decides. Otherwise every result's validity
        depends on the state before the batch alone (a slot holds one item; items of a slot are
        distinct), so the rules apply to all at once: a valid result marks its item, keeps its
        exponent and lanes for :meth:`flush`, and sends its slot's next item (or frees the slot);
        the one that completes the tensor sends nothing and clears the timers."""
        total = len(c)
        if self.done:
            self.stats.dup_acks += total
            return np.zeros(0, dtype=WIRE_HEADER)
        n = self.n
        inr = (c >= 0) & (c < n) & (slot >= 0) & (slot < self.pool)
        s_in = slot[inr]
        if len(s_in) > 1 and np.bincount(s_in, minlength=self.pool).max() > 1:
            return None
        got = np.frombuffer(self.got, dtype=np.uint8)
        cur_l = self.cur
        idx = np.flatnonzero(inr)
        s_idx = slot[idx]
        run = run_of(s_idx)  # (slots a, a+1, …: the usual batch — list slices instead of loops)
        cur = np.array(cur_l[run[0]:run[1]] if run else [cur_l[s] for s in s_idx.tolist()], dtype=np.int64)
        idx = idx[(got[c[idx]] == 0) & (cur == c[idx])]
        m = len(idx)
        self.stats.dup_acks += total - m
        if not m:
            return np.zeros(0, dtype=WIRE_HEADER)
        cs, ss = c[idx], slot[idx]
        self.stats.acks += m
        got[cs] = 1
        self.n_got += m
        es, vs = exp[idx], ver[idx]
        low = cs < self.n_chunks
        self.shared[cs[low]] = es[low]
        hi = cs >= self.P
        if hi.any():
            self._stores_a.append((cs[hi] - self.P, vs[hi], ss[hi]))
        done = self.n_got == n
        if done:  # the last result completes the tensor: it sends nothing and keeps its slot
            cs, ss = cs[:-1], ss[:-1]
        nxt = cs + self.stride
        go = nxt < n
        run = run_of(ss) if len(ss) else None
        if run:
            cur_l[run[0]:run[1]] = np.where(go, nxt, -1).tolist()
        else:
            for s, x in zip(ss.tolist(), np.where(go, nxt, -1).tolist()):
                cur_l[s] = x
        dl = self.deadline
        for s in ss[~go].tolist():
            dl[s] = None
        out = self._send_many(ss[go], nxt[go], now)
        if done:
            self.done = True
            self.timers.clear()
        return out

    def _send_many(self, slots: np.ndarray, items: np.ndarray, now: float) -> np.ndarray:
        """:meth:`_send` (not a resend) of ``items[j]`` through ``slots[j]`` (distinct slots), lanes in
        shared memory: the versions flip, the deadlines and timers are set, the chunks are queued for
        quantization at :meth:`flush`; the packets' headers as one array."""
        m = len(slots)
        h = np.zeros(m, dtype=WIRE_HEADER)
        if not m:
            return h
        sl, it = slots.tolist(), items.tolist()
        uses, ver, dl = self.uses, self.ver, self.deadline
        d = now + self.rto
        run = run_of(slots)
        if run:  # slots a, a+1, …: list slices (the same updates)
            a, b = run
            u = np.array(uses[a:b], dtype=np.int64)
            vv = u & 1
            uses[a:b] = (u + 1).tolist()
            ver[a:b] = vv.tolist()
            dl[a:b] = [d] * m
        else:
            vl = []
            for s in sl:  # a new chunk in a slot flips its version (SMLWorker._send)
                u_ = uses[s]
                v = ver[s] = u_ & 1
                uses[s] = u_ + 1
                dl[s] = d
                vl.append(v)
            vv = np.array(vl, dtype=np.int64)
        self.timers.extend(zip([d] * m, sl, it))
        self.stats.sent += m
        P = self.P
        data = items >= P
        if data.any():
            q_c = items[data]
            chunks = self.chunks
            qr = run_of(q_c)
            if qr:
                chunks[qr[0]:qr[1]] = [IN_SHM] * (qr[1] - qr[0])
            else:
                for it in q_c.tolist():
                    chunks[it] = IN_SHM
            self._quant_a.append((q_c - P, vv[data], slots[data]))
        h["job"] = self.job
        h["slot"] = slots
        h["flags"] = (vv << 7) | np.where(data, SHM_FLAG, 0x20)
        h["worker"] = self.wid
        e = np.zeros(m, dtype=np.int64)
        real = items < self.n_chunks
        e[real] = self._local_exp[items[real]]
        h["word"] = (items << 8) | e
        return h

    def start_float(self, x: np.ndarray, now: float, out: Optional[np.ndarray] = None, headers: bool = False) -> Any:
        """Begin streaming ``x`` (finite floats, ``|x| < 2^127``); the packets to send.

        A float32 ``x`` stays float32 (half the bytes per pass): scaling by a power of
        two is exact in either type and the rounded integers are the same (a value whose
        scaled magnitude would be subnormal in float32 rounds to 0 either way).

        ``out`` (float32 or float64, ``x``'s length; may be ``x`` itself): where each chunk's
        result is written as it arrives (dequantized from the received lanes in one pass: no
        integer copy of the whole result, no conversion pass at the end). A chunk is
        quantized before it is sent and its result arrives after, so ``out`` may alias ``x``.
        Default: a float64 array (:attr:`result_float`). ``headers`` (shared-memory transport): the
        packets as one :data:`WIRE_HEADER` array (:meth:`_send_many`) instead of packet objects."""
        x = np.asarray(x).ravel()
        if x.dtype != np.float32:
            x = x.astype(np.float64, copy=False)
        k = self.k
        n = max(1, -(-len(x) // k))
        full = len(x) // k  # whole chunks are views of x; the short tail is copied into a padded row
        tail = self._pad if self._pad is not None and self._pad.dtype == x.dtype else None
        if tail is None:
            tail = self._pad = np.zeros(k, dtype=x.dtype)
        if full < n:
            tail[:len(x) - full * k] = x[full * k:]
            tail[len(x) - full * k:] = 0
        self.length, self._x, self._full = len(x), x, full
        body = x[:full * k].reshape(full, k)
        peak = _peaks(body)
        if full < n:
            peak = np.append(peak, max(float(tail.max()), -float(tail.min())))
        if not np.isfinite(peak).all():
            raise ValueError("NaN/inf gradients")
        e = np.frexp(peak)[1].astype(np.int64)  # |x| < 2^e per chunk (frexp: peak = m·2^e, 0.5 ≤ m < 1)
        e[peak == 0] = EXP_MIN
        if int(e.max()) > EXP_MAX:
            raise ValueError(f"a gradient of magnitude {float(peak.max()):.3g} exceeds SwitchML's exponent range")
        self._local_exp = np.maximum(e, EXP_MIN) + EXP_BIAS
        self.local_exp = self._local_exp.tolist()
        P = min(self.pool, n, self.window)
        if P + n > MAX_ITEMS:
            raise ValueError(f"{n} packets of {k} values exceed SwitchML's 24-bit packet offset: raise payload_k")
        self.P, self.n_chunks, self.stride = P, n, P
        self.n = P + n  # stream items
        self.chunks = [NO_LANES] * P + [None] * n  # type: ignore[list-item] - quantized when sent
        self.shared = np.zeros(n, dtype=np.int64)  # the exponent (biased) chunk c was quantized with
        self._quant: List[Tuple[int, int, int]] = []  # chunks to quantize at flush: (chunk, version, slot)
        self._stores: List[Tuple[int, int, int, Optional[np.ndarray]]] = []  # results to write at flush
        self._quant_a: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # the same from the array form:
        self._stores_a: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (chunks, versions, slots) arrays
        if self.lanes is None:  # the chunks as they travel (big-endian int32), kept while the size stays
            if self._wire is None or self._wire.shape != (n, k):
                self._wire = np.zeros((n, k), dtype=self.fmt.wire_dtype)
        self.out = np.empty(len(x), dtype=np.float64) if out is None else out
        if self.out.shape != (len(x),) or self.out.dtype not in (np.float32, np.float64):
            raise ValueError(f"out must be float32/float64 of shape ({len(x)},)")
        #: the aggregated integers of each chunk (kept only with ``keep_ints``: the tests' check)
        self.result_q = np.zeros((n, k), dtype=np.int32) if self.keep_ints else None
        self.got = bytearray(self.n)
        self.n_got = 0
        self.deadline = [None] * self.pool
        self.cur = list(range(P)) + [-1] * (self.pool - P)
        self.ver = [0] * self.pool
        self.timers = deque()
        self.done = False
        if headers and self.lanes is not None:  # the array form (:meth:`on_headers`)
            return self._send_many(np.arange(P, dtype=np.int64), np.arange(P, dtype=np.int64), now)
        return [self._send(t, t, now, 0) for t in range(P)]

    keep_ints = True  # keep every chunk's aggregated integers in result_q (the live engine turns it off)

    def _chunk(self, c: int) -> np.ndarray:
        """Chunk ``c`` of the tensor being streamed (a view; the tail padded with zeros)."""
        k = self.k
        return self._x[c * k:(c + 1) * k] if c < self._full else self._pad  # type: ignore[return-value]

    def _send(self, slot: int, item: int, now: float, resend: int) -> SMLPacket:
        if item >= self.P and self.chunks[item] is None:  # quantized at flush(), before it is sent
            c = item - self.P
            if self.lanes is None:
                self.chunks[item] = self._wire[c]
            else:  # into this worker's shared lanes of the slot's next version (SMLWorker._send flips it)
                self.chunks[item] = IN_SHM
            self._quant.append((c, self.uses[slot] & 1, slot))
        p = super()._send(slot, item, now, resend)
        p.exp = self.local_exp[item] if item < self.n_chunks else 0
        return p

    def _store(self, c: int, ver: int, slot: int, exp: int, payload: Optional[np.ndarray]) -> None:
        """Item ``c``'s result: the shared exponent of chunk ``c``; for ``c ≥ P`` the integer sum of
        chunk ``c − P`` (``payload``, or the switch's registers ``[ver, slot]``), written to
        :attr:`out` at :meth:`flush`."""
        if c < self.n_chunks:
            self.shared[c] = exp
        if c >= self.P:
            self._stores.append((c - self.P, ver, slot, payload))

    def flush(self) -> None:
        """The numpy work of the packets handled since the last flush, a few calls for all of them:
        quantize the chunks about to be sent, ``q = rint(x · 2^(B−e))`` into their lanes
        (this worker's shared lanes, or the wire's big-endian rows), then write the results received
        to :attr:`out` as ``Σq · 2^(e−B)`` rounded once to its type (float32: formed in float32 where
        ``2^(e−B)`` is a normal float32 — the product of the int32 sum rounded to 24 bits and a power
        of two rounds like the exact product —, else in float64). Quantizing first: a chunk's result
        may overwrite it in ``out`` (``out`` may be the input)."""
        if self._quant:
            q, self._quant = self._quant, []
            self._quantize([c for c, _, _ in q], [v for _, v, _ in q], [s for _, _, s in q])
        if self._quant_a:
            qa, self._quant_a = self._quant_a, []
            self._quantize(*(np.concatenate([t[i] for t in qa]) if len(qa) > 1 else qa[0][i] for i in range(3)))
        if self._stores:
            st, self._stores = self._stores, []
            self._dequantize([c for c, _, _, _ in st], [v for _, v, _, _ in st], [s for _, _, s, _ in st],
                             [p for _, _, _, p in st])
        if self._stores_a:
            sa, self._stores_a = self._stores_a, []
            self._dequantize(*(np.concatenate([t[i] for t in sa]) if len(sa) > 1 else sa[0][i] for i in range(3)),
                             None)

    def _parts(self, c0: int, shifts: np.ndarray, dtype: Any) -> List[Tuple[int, int, bool]]:
        """Chunks ``c0, c0+1, …`` (one per shift) cut into ``(lo, hi, fast)`` ranges: fast ones are
        whole chunks whose ``2^shift`` is a normal ``dtype`` (array passes in ``dtype``); the others
        (the tail, extreme exponents) go row by row in float64."""
        ok = np.arange(c0, c0 + len(shifts)) < self._full
        if dtype == np.float32:
            ok &= (shifts >= F32_SHIFTS[0]) & (shifts <= F32_SHIFTS[1])
        if ok.all() or not ok.any():
            return [(0, len(shifts), bool(ok[0]))]
        cut = (np.flatnonzero(ok[1:] != ok[:-1]) + 1).tolist()
        return [(lo, hi, bool(ok[lo])) for lo, hi in zip([0, *cut], [*cut, len(shifts)])]

    def _quantize(self, cs: List[int], vers: List[int], slots: List[int]) -> None:
        """``q = rint(x · 2^(B−e))`` of chunks ``cs`` into their lanes: a run is, block by block, a
        multiply into a scratch that stays in cache and a rounding into the lanes (int32, or the
        wire's big-endian rows): the tensor read once, the lanes written once."""
        sh = self.bits - (self.shared[cs] - EXP_BIAS)
        x, k = self._x, self.k
        body = x[:self._full * k].reshape(self._full, k)
        for a, b in runs(cs, slots, same=vers):  # consecutive chunks through consecutive slots
            c0, m, v, s0 = cs[a], b - a, vers[a], slots[a]
            dst = self._wire[c0:c0 + m] if self.lanes is None else self.lanes[v, s0:s0 + m]
            for lo, hi, fast in self._parts(c0, sh[a:b], x.dtype):
                if not fast:  # the tail, or 2^shift no normal float32: row by row in float64
                    for n in range(lo, hi):
                        dst[n] = np.rint(self._chunk(c0 + n).astype(np.float64) * 2.0 ** int(sh[a + n]))
                    continue
                sc = np.exp2(sh[a + lo:a + hi]).astype(x.dtype)[:, None]
                step = max(1, QUANT_BLOCK // k)  # rows a block: the scratch stays in cache
                tmp = self._scratch(min(step, hi - lo), x.dtype)
                for r in range(lo, hi, step):
                    t = tmp[:min(step, hi - r)]
                    np.multiply(body[c0 + r:c0 + r + len(t)], sc[r - lo:r - lo + len(t)], out=t)
                    np.rint(t, out=t)  # then one cast of integral floats, |q| < 2^B: exact in int32 (a rint
                    np.copyto(dst[r:r + len(t)], t, casting="unsafe")  # straight into int32 costs more here)

    def _scratch(self, m: int, dtype: Any) -> np.ndarray:
        t = self._tmp
        if t is None or t.shape[0] < m or t.dtype != dtype:
            t = self._tmp = np.empty((m, self.k), dtype=dtype)
        return t[:m]

    def _dequantize(self, ds: Any, vers: Any, slots: Any, pay: Optional[List[Optional[np.ndarray]]]) -> None:
        """``Σq · 2^(e−B)`` of chunks ``ds`` into :attr:`out`: a run is one multiply from the
        received lanes (the switch's registers, or the datagrams': ``pay``, None where all are in the
        registers) into ``out``."""
        shm = pay is None or all(p is None for p in pay)
        rows = None if shm else np.stack([p if p is not None else self.results[v, s]  # type: ignore[index]
                                          for p, v, s in zip(pay, vers, slots)])
        k, out = self.k, self.out
        body = out[:self._full * k].reshape(self._full, k)
        sh = self.shared[ds] - EXP_BIAS - self.bits
        for a, b in runs(ds, slots, same=vers):
            d0, m, v, s0 = ds[a], b - a, vers[a], slots[a]
            src = self.results[v, s0:s0 + m] if shm else rows[a:b]  # type: ignore[index]
            if self.result_q is not None:
                self.result_q[d0:d0 + m] = src
            for lo, hi, fast in self._parts(d0, sh[a:b], out.dtype):
                if fast:
                    np.multiply(src[lo:hi], np.exp2(sh[a + lo:a + hi]).astype(out.dtype)[:, None],
                                out=body[d0 + lo:d0 + hi], dtype=out.dtype, casting="unsafe")
                    continue
                for n in range(lo, hi):
                    dst = out[(d0 + n) * k:(d0 + n + 1) * k]
                    np.multiply(src[n][:dst.size], 2.0 ** int(sh[a + n]), out=dst, casting="same_kind")

    @property
    def result_float(self) -> np.ndarray:
        """``Σq · 2^(e−B)`` per chunk: the sum over the job's workers (float64 unless ``out`` was float32)."""
        return self.out

    def result_as(self, dtype: Any) -> np.ndarray:
        """:attr:`result_float` rounded once to ``dtype`` (formed exactly in float64, or in float32
        as :meth:`_store` says)."""
        return self.out.astype(dtype, copy=False)


def _peaks(body: np.ndarray) -> np.ndarray:
    """``max |x|`` per row of ``body`` (0 for no rows), as its max and min block by block: the min reads
    the block the max just read, from cache."""
    m, k = body.shape
    if not m:
        return np.zeros(0)
    hi, lo = np.empty(m, dtype=body.dtype), np.empty(m, dtype=body.dtype)
    step = max(1, PEAK_BLOCK // k)
    for r in range(0, m, step):
        b = body[r:r + step]
        b.max(axis=1, out=hi[r:r + step])
        b.min(axis=1, out=lo[r:r + step])
    np.negative(lo, out=lo)
    return np.maximum(hi, lo, out=hi)
