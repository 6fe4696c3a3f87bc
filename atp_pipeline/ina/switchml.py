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
from itertools import repeat
from operator import is_, is_not
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.ina.counters import Counters
from atp_pipeline.ina.packet import L2L4_OVERHEAD_BYTES, DecodeError, Field
from atp_pipeline.ina.quant import lane_limit

EXP_BIAS = 128  # the exponent field holds e + 128; 0 = "no next chunk" (below every real exponent)
EXP_MIN, EXP_MAX = -127, 126  # |x| < 2^e for every representable chunk; a larger one is refused
_EMPTY = np.zeros(0, dtype=np.int32)
_IN_SHM = np.zeros(1, dtype=np.int32)  # a sent chunk whose lanes are in the worker's shared memory (not on the wire)

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
#: values a worker scales and rounds per step (256 KiB of float32: in L2; issue 28, pass 6: 64 KiB blocks cost
#: more calls than they saved — at 2,048 values a packet 8 rows a block; one process, small's gradient: 0.90 ms
#: against 0.97 at 2,048 values a packet, 0.63 against 0.81 at 16,000)
QUANT_BLOCK = 65536
PEAK_BLOCK = 131072  # values whose max and min a worker takes per step (the second pass then reads from cache)
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
    """One job's static partition on the switch: ``pool`` slots × 2 versions (slot-version
    ``v·pool + i`` below)."""

    def __init__(self, job: int, n_workers: int, pool: int, k: int, mcast: int, worker_hosts: List[int],
                 values: Optional[np.ndarray] = None, lanes: Optional[Sequence[np.ndarray]] = None) -> None:
        self.job, self.W, self.pool, self.k = job, n_workers, pool, k
        self.mcast = mcast
        self.hosts = worker_hosts
        #: the slots' sums, version-major; ``values``: an int32 array of that shape to keep them in
        #: (the shared-memory transport's, which the workers read the results from)
        self.values = np.zeros((2, pool, k), dtype=np.int32) if values is None else values
        #: the shared-memory transport: each worker's ``(2, pool, k)`` lanes, worker-id order (a
        #: packet with :data:`SHM_FLAG` contributes ``lanes[worker][ver, slot]``)
        self.lanes = lanes
        self._count = [0] * (2 * pool)
        self._seen = [0] * (2 * pool)  # bitmaps per slot-version
        self._exp = [0] * (2 * pool)  # max of the contributions' exponents per slot-version
        #: the same three as int64 arrays while the array form (:meth:`SMLSwitch._batch_arrays`) keeps them
        #: (then the lists are stale until :attr:`seen`, :attr:`count` or :attr:`exp` is read; issue 28, pass 8:
        #: converting them to arrays and back cost ~75 us a batch, ~0.5 ms a sync at 2,048 values a packet)
        self._arr: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self.stats = dict(merged=0, complete=0, result_unicast=0, dropped=0)

    @property
    def count(self) -> List[int]:
        """Contributions so far (mod ``W``) per slot-version."""
        if self._arr is not None:
            self._to_lists()
        return self._count

    @property
    def seen(self) -> List[int]:
        """The bitmap of workers that contributed, per slot-version."""
        if self._arr is not None:
            self._to_lists()
        return self._seen

    @property
    def exp(self) -> List[int]:
        """The max of the contributions' exponents, per slot-version."""
        if self._arr is not None:
            self._to_lists()
        return self._exp

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(seen, count, exp)`` as int64 arrays to read and update in place (the lists follow when next read)."""
        if self._arr is None:
            self._arr = (np.array(self._seen, dtype=np.int64), np.array(self._count, dtype=np.int64),
                         np.array(self._exp, dtype=np.int64))
        return self._arr

    def _to_lists(self) -> None:
        s, c, e = self._arr  # type: ignore[misc]
        self._arr = None
        self._seen, self._count, self._exp = s.tolist(), c.tolist(), e.tolist()

    @property
    def values(self) -> np.ndarray:
        return self._values

    @values.setter
    def values(self, v: np.ndarray) -> None:
        self._values = v
        self.flat = v.reshape(2 * self.pool, self.k)  # row ``v·pool + i``: slot-version (v, i)

    @property
    def lanes(self) -> Optional[List[np.ndarray]]:
        return self._lanes

    @lanes.setter
    def lanes(self, lanes: Optional[Sequence[np.ndarray]]) -> None:
        self._lanes = list(lanes) if lanes is not None else None
        self.lanes_flat = [a.reshape(2 * self.pool, self.k) for a in self._lanes] if self._lanes else []


def _runs(*stepping: Sequence[int], same: Sequence[int] = ()) -> List[Tuple[int, int]]:
    """``[a, b)`` ranges over which every sequence of ``stepping`` steps by 1 and ``same`` stays
    constant: slices of the arrays they index (one numpy call a run instead of a gather)."""
    n = len(stepping[0])
    if n == 1:
        return [(0, 1)]
    brk = np.zeros(n - 1, dtype=bool)
    for seq in stepping:
        brk |= np.diff(np.asarray(seq)) != 1
    if len(same):
        brk |= np.diff(np.asarray(same)) != 0
    cut = (np.flatnonzero(brk) + 1).tolist()
    return list(zip([0, *cut], [*cut, n]))


#: one result of :meth:`SMLSwitch.batch`: (index of the packet in the batch, destination worker or
#: -1 for the job's multicast group, shared exponent, the slot's sum — a copy, or None for an
#: exponent-only or shared-memory packet)
Result = Tuple[int, int, int, Optional[np.ndarray]]


class SMLSwitch:
    """The SwitchML data plane of one ToR (SwitchML Algorithm with shadow copies).

    :meth:`batch` is the switch function, over a batch of packets in arrival order (the live
    role hands it everything it drained; issue 28): the per-packet decisions are the
    algorithm's, one packet after the other, and the lanes are summed per worker in one numpy
    call each (gather, add, scatter) before any result is read. Calling the switch with one
    packet (the simulator, :meth:`__call__`) is a batch of one."""

    #: threads that sum the lanes (:meth:`_sum`): 1 (the simulator); the live role uses 2 where there are cores
    threads = 1

    def __init__(self) -> None:
        self.jobs: Dict[int, SMLSwitchJob] = {}
        self.unknown = 0
        self._pool: Any = None
        self._ops: Dict[Tuple[int, int, int], List[Tuple[int, Optional[np.ndarray]]]] = {}  # carried lane work

    def __call__(self, p: SMLPacket, link: Any) -> List[SMLPacket]:
        pay = p.payload
        out = self.batch((p.job,), (p.slot,), (p.ver,), (p.is_result,), (p.worker,), (p.exp,),
                         (pay is not None and not pay.size,), (pay,))
        if not out:
            return []
        _, dst, p.exp, row = out[0]
        if row is not None:
            p.payload = row
        p.is_result = 1
        js = self.jobs[p.job]
        p.dst = js.mcast if dst < 0 else js.hosts[dst]
        return [p]

    def batch(self, job: Sequence[int], slot: Sequence[int], ver: Sequence[int], is_result: Sequence[int],
              worker: Sequence[int], exp: Sequence[int], empty: Sequence[int],
              payload: Sequence[Optional[np.ndarray]]) -> List[Result]:
        """Packets ``j`` (header fields as sequences; ``payload[j]``: its lanes, or None where they
        are in the job's shared-memory :attr:`~SMLSwitchJob.lanes`) through the data plane, in
        order; the results to send (:data:`Result`).

        A slot-version's sum starts with its first contribution's lanes and adds the others' (an
        exponent-only packet has none: the slot-version's contributions all are, and its lanes are
        never read). The lane work is collected per (job, worker,
        kind) and done when a batch sends a result (:meth:`_sum`), before any register is read;
        a batch that sends none carries it to the next (issue 28, pass 5: the live role drains one
        worker's packets at a time, and the work of all of a slot-version's contributions then goes
        through the registers in one blocked pass instead of one pass per worker's batch). A
        worker's lanes of a slot-version stay as sent until its result has left (a worker rewrites
        them only after that result: the shadow copy), a datagram's payload is kept with the work,
        and registers are only read by results. A slot-version that restarts while an earlier
        use of it is still pending has the pending work done first, so the result is that of
        handling the packets one at a time (:meth:`settle` does the carried work: the registers
        then equal the per-packet form's)."""
        out: List[Result] = []
        ops = self._ops  # (kind, job, worker) -> [(slot-version, lanes or None)]: carried until a result leaves
        reads: List[Tuple[int, int, int]] = []  # (index in out, job, slot-version): rows read at the end
        if len(job) >= ARRAY_MIN and self._batch_arrays(job, slot, ver, is_result, worker, exp, empty, payload,
                                                        out, ops, reads):
            if out:
                self._sum(ops, reads, out)
            return out
        if isinstance(job, np.ndarray):  # (fields given as arrays: the loop reads lists)
            job, slot, ver, is_result, worker, exp, empty = (np.asarray(a).tolist() for a in (
                job, slot, ver, is_result, worker, exp, empty))
        pending: set = set()  # job << 32 | slot-version, with pending lane work or a pending read
        jobs = self.jobs
        track = len(job) > 1  # (a batch of one has nothing pending before its packet)
        cur = None  # the job whose state lists are at hand (seen, count, exps)
        for j in range(len(job)):
            js = jobs.get(job[j])
            i, w = slot[j], worker[j]
            if js is None or is_result[j] or not 0 <= i < js.pool or not 0 <= w < js.W:
                self.unknown += 1
                continue
            if js is not cur:
                cur, seen, count, exps = js, js.seen, js.count, js.exp
            v = ver[j]
            vi, bit, st = v * js.pool + i, 1 << w, js.stats
            if not seen[vi] & bit:
                seen[vi] |= bit
                seen[vi + js.pool if v == 0 else vi - js.pool] &= ~bit  # the slot's other version
                c = count[vi] = (count[vi] + 1) % js.W
                if c == 1 or js.W == 1:  # the slot-version's first contribution: its sum starts here
                    if track and js.job << 32 | vi in pending:  # its last use is still pending here: do it first
                        self._sum(ops, reads, out)
                        pending.clear()
                    kind = _NONE if empty[j] else _SET
                    exps[vi] = exp[j]
                else:
                    kind = _NONE if empty[j] else _ADD
                    if exp[j] > exps[vi]:
                        exps[vi] = exp[j]
                if kind:
                    key = (kind, js.job, w)
                    got = ops.get(key)
                    if got is None:
                        ops[key] = [(vi, payload[j])]
                    else:
                        got.append((vi, payload[j]))
                    if track:
                        pending.add(js.job << 32 | vi)
                st["merged"] += 1
                if c:
                    continue
                st["complete"] += 1
                out.append((j, -1, exps[vi], None))
            elif count[vi] == 0:  # complete: a retransmission gets the result by unicast
                st["result_unicast"] += 1
                out.append((j, w, exps[vi], None))
            else:
                st["dropped"] += 1
                continue
            if not empty[j] and payload[j] is not None:
                reads.append((len(out) - 1, js.job, vi))
                if track:
                    pending.add(js.job << 32 | vi)
        if out:
            self._sum(ops, reads, out)
        return out

    def settle(self) -> None:
        """Do the lane work still carried (contributions to slot-versions no result has left yet):
        the registers then hold what the packets one at a time would have left there."""
        if self._ops:
            self._sum(self._ops, [], [])

    def drop(self, job: int) -> None:
        """Forget job ``job``'s carried lane work (its partition is being torn down)."""
        for key in [k for k in self._ops if k[1] == job]:
            del self._ops[key]

    def _batch_arrays(self, job: Sequence[int], slot: Sequence[int], ver: Sequence[int], is_result: Sequence[int],
                      worker: Sequence[int], exp: Sequence[int], empty: Sequence[int],
                      payload: Sequence[Optional[np.ndarray]], out: List[Result],
                      ops: Dict[Tuple[int, int, int], List[Tuple[int, int]]], reads: List[Tuple[int, int, int]]) -> bool:
        """The decisions of :meth:`batch`'s per-packet loop as array operations, for the batches
        where no packet's decision depends on another's (issue 28, pass 4): one job; every slot
        in one version; a worker at most once per slot-version; a slot-version that gets new
        contributions gets no retransmissions and does not complete and restart within the batch.
        Then each packet's outcome follows from the state before the batch and its rank among the
        new contributions to its slot-version (the count it brings the slot-version to), which is
        what the loop computes one packet after the other. False (nothing changed) otherwise: the
        loop decides. Fills ``out``/``ops``/``reads`` as the loop does (tested equal).

        Pass 5: grouped by a stable sort on the slot-version, every per-group quantity is a
        ``reduceat`` (no ``ufunc.at``), the job's registers are read and written as whole arrays
        when its partition is small (else only the slot-versions touched), and the results are
        built from arrays — a few dozen numpy calls a batch, no Python loop over its packets."""
        j0 = int(job[0])
        js = self.jobs.get(j0)
        jb = np.asarray(job)
        if js is None or (jb != j0).any():
            return False
        W, pool = js.W, js.pool
        sl, vr, wk = np.asarray(slot, dtype=np.int64), np.asarray(ver, dtype=np.int64), np.asarray(worker, dtype=np.int64)
        known = (np.asarray(is_result) == 0) & (sl >= 0) & (sl < pool) & (wk >= 0) & (wk < W)
        if known.all():
            idx = None
        else:
            idx = np.flatnonzero(known)
            if not len(idx):
                self.unknown += len(job)
                return True
            sl, vr, wk = sl[idx], vr[idx], wk[idx]
        vi = vr * pool + sl
        order = np.argsort(vi, kind="stable")  # grouped by slot-version, arrival order inside
        vs = vi[order]
        m = len(vs)
        first = np.empty(m, dtype=bool)
        first[0] = True
        np.not_equal(vs[1:], vs[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        uv = vs[starts]  # the slot-versions, ascending
        other = np.where(uv < pool, uv + pool, uv - pool)
        if len(uv) > 1 and np.isin(other, uv, assume_unique=True).any():  # a slot in both versions
            return False
        whole = 2 * pool <= WHOLE_STATE * m
        if whole:  # (kept as arrays between batches: SMLSwitchJob.arrays)
            seen_a, cnt_a, exp_a = js.arrays()
            seen0, c0, e0, so = seen_a[uv], cnt_a[uv], exp_a[uv], seen_a[other]
        else:
            uvl, othl = uv.tolist(), other.tolist()
            seen_l, cnt_l, exp_l = js.seen, js.count, js.exp
            seen0 = np.array([seen_l[v] for v in uvl], dtype=np.int64)
            c0 = np.array([cnt_l[v] for v in uvl], dtype=np.int64)
            e0 = np.array([exp_l[v] for v in uvl], dtype=np.int64)
            so = np.array([seen_l[v] for v in othl], dtype=np.int64)
        gid = np.cumsum(first) - 1  # group of each sorted packet
        bit = np.left_shift(1, wk[order])
        if (np.bitwise_or.reduceat(bit, starts) != np.add.reduceat(bit, starts)).any():  # a worker twice
            return False
        new = (seen0[gid] & bit) == 0
        newi = new.astype(np.int64)
        n_new = np.add.reduceat(newi, starts)
        n_all = np.diff(np.append(starts, m))
        if ((n_new > 0) & (n_new < n_all)).any() or (c0 + n_new > W).any():
            return False
        cum = np.cumsum(newi)
        rank = cum - (cum[starts] - newi[starts])[gid]  # of each new contribution in its slot-version (1-based)
        c0g = c0[gid]
        c = (c0g + rank) % W
        e = np.asarray(exp, dtype=np.int64)
        em = np.asarray(empty, dtype=bool)
        if idx is not None:
            e, em = e[idx], em[idx]
        e, em = e[order], em[order]
        # the exponent each slot-version ends the batch with: max over its new contributions (and its
        # earlier ones unless the batch starts it)
        gmax = np.maximum.reduceat(np.where(new, e, -1), starts)
        touched = n_new > 0
        fin = np.where(touched, np.where(c0 == 0, gmax, np.maximum(e0, gmax)), e0)
        # state
        bits_new = np.bitwise_or.reduceat(np.where(new, bit, 0), starts)
        seen1, cnt1 = seen0 | bits_new, (c0 + n_new) % W
        so1 = so & ~bits_new
        if whole:
            seen_a[uv], seen_a[other], cnt_a[uv], exp_a[uv] = seen1, so1, cnt1, fin
        else:
            for v, o, sv, ov, cv, ev in zip(uvl, othl, seen1.tolist(), so1.tolist(), cnt1.tolist(), fin.tolist()):
                seen_l[v], seen_l[o], cnt_l[v], exp_l[v] = sv, ov, cv, ev
        st = js.stats
        done = new & (c == 0)
        uni = ~new & (c0g == 0)
        n_m, n_d, n_u = int(newi.sum()), int(done.sum()), int(uni.sum())
        st["merged"] += n_m
        st["complete"] += n_d
        st["result_unicast"] += n_u
        st["dropped"] += m - n_m - n_u
        self.unknown += len(job) - m
        jj = order if idx is None else idx[order]  # each sorted packet's index in the batch
        udp = any(map(is_not, payload, repeat(None)))  # (else every packet's lanes are in shared memory)
        # lane work, per (kind, job, worker), in slot-version order
        lane = new & ~em
        if lane.any():
            kind = np.where(lane, np.where((rank == 1) & ((c0g == 0) | (W == 1)), _SET, _ADD), _NONE)
            ws = wk[order]
            for kd in (_SET, _ADD):
                for w in range(W):
                    sel = np.flatnonzero((kind == kd) & (ws == w))
                    if len(sel):
                        ops.setdefault((kd, j0, w), []).extend(zip(vs[sel].tolist(), [payload[j] for j in jj[sel].tolist()]
                                                                   if udp else [None] * len(sel)))
        # results, arrival order
        res = np.flatnonzero(done | uni)
        if len(res):
            res = res[np.argsort(jj[res], kind="stable")]
            rj = jj[res]
            base = len(out)
            out.extend(zip(rj.tolist(), np.where(done[res], -1, wk[order][res]).tolist(), fin[gid[res]].tolist(),
                           [None] * len(res)))
            if udp:
                for n_, (j, v_) in enumerate(zip(rj.tolist(), vs[res].tolist())):
                    if not empty[j] and payload[j] is not None:
                        reads.append((base + n_, j0, v_))
        return True

    def _sum(self, ops: Dict[Tuple[int, int, int], List[Tuple[int, Optional[np.ndarray]]]],
             reads: List[Tuple[int, int, int]], out: List[Result]) -> None:
        """The pending lane work: first contributions (the contributor's lanes), then the
        other contributions added — per (job, worker) one numpy call per run of consecutive
        slot-versions (a worker contributes once to a slot-version between two restarts) —, then
        the rows of the results that carry lanes (copies). The calls go block by block over the
        registers (:data:`SUM_BLOCK` values a block, in cache), each block taking every call's
        rows in it in the same order: the contributions meet a register row while it is in
        cache instead of one pass over the registers per worker (issue 28, pass 4)."""
        prims: Dict[int, List[Tuple[int, int, int, np.ndarray]]] = {}  # job -> [(kind, first row, rows, source)]
        for key in (sorted(ops) if len(ops) > 1 else ops):  # _SET before _ADD
            kind, job, w = key
            items = ops[key]
            js = self.jobs.get(job)
            if js is None:  # (torn down: :meth:`drop`)
                continue
            todo = prims.setdefault(job, [])
            vis, xs = zip(*items)
            n_shm = sum(map(is_, xs, repeat(None)))
            lanes = js.lanes_flat[w] if n_shm else None
            # one at a time: a single item, a slot-version twice (never: kept exact), lanes of both kinds
            # (never live: a job has one transport)
            if len(items) == 1 or len(set(vis)) < len(vis) or 0 < n_shm < len(xs):
                for vi, x in items:
                    src = x if x is not None else js.lanes_flat[w][vi]
                    todo.append((kind, vi, 1, src.reshape(1, -1)))
                continue
            for a, b in _runs(vis):  # a run of consecutive slot-versions: one call over slices
                v0, m = vis[a], b - a
                src = lanes[v0:v0 + m] if lanes is not None else np.stack([x for _, x in items[a:b]])
                todo.append((kind, v0, m, src))
        for job, todo in prims.items():
            vals = self.jobs[job].flat
            step = max(1, SUM_BLOCK // vals.shape[1])
            lo, hi = min(t[1] for t in todo), max(t[1] + t[2] for t in todo)
            if len(todo) == 1 or len(todo) > 4 * SUM_CALLS or hi - lo <= step:
                step = hi - lo  # one block
            if self.threads > 1 and (hi - lo) * vals.shape[1] >= SUM_SPLIT_MIN and hi - lo > 1:
                # two halves of the rows at once (numpy lets the GIL go): the live role sums when every
                # worker waits for the results, so a second core is free (issue 28, pass 6)
                mid = lo + max(1, (hi - lo) // 2 // step) * step if hi - lo > step else lo + (hi - lo) // 2
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="sml-sum")
                half = self._pool.submit(_apply, todo, vals, mid, hi, step)
                _apply(todo, vals, lo, mid, step)
                half.result()
            else:
                _apply(todo, vals, lo, hi, step)
        for o, job, vi in reads:
            j, dst_, e, _ = out[o]
            out[o] = (j, dst_, e, self.jobs[job].flat[vi].copy())
        ops.clear()
        reads.clear()


def _apply(todo: List[Tuple[int, int, int, np.ndarray]], vals: np.ndarray, lo: int, hi: int, step: int) -> None:
    """The lane work ``todo`` (:meth:`SMLSwitch._sum`) on register rows ``[lo, hi)``, ``step`` rows a
    block, every call's rows of a block in ``todo``'s order — except that a first contribution and
    the first other contribution over the same rows of a block are one call, ``rows = a + b``
    (issue 28, pass 8: the copy of the first lanes cost a pass over the block; integer sums are
    exact and every ``_SET`` of a row precedes its ``_ADD`` calls in ``todo`` — sorted by kind, and a
    row restarts only after its result has left, when the work is done —, so the sums are the
    same bits)."""
    for r0 in range(lo, hi, step):
        r1 = min(r0 + step, hi)
        ops = []
        for kind, v0, m, src in todo:
            a, b = max(r0, v0), min(r1, v0 + m)
            if a < b:
                ops.append((kind, a, b, src[a - v0:b - v0]))
        fused = set()
        for i, (kind, a, b, src) in enumerate(ops):
            if i in fused:
                continue
            dst = vals[a:b]
            if kind != _SET:
                np.add(dst, src, out=dst)
                continue
            for j in range(i + 1, len(ops)):
                if j not in fused and ops[j][0] == _ADD and ops[j][1] == a and ops[j][2] == b:
                    np.add(src, ops[j][3], out=dst)
                    fused.add(j)
                    break
            else:
                dst[...] = src


_NONE, _SET, _ADD = 0, 1, 2  # lane work of a contribution (SMLSwitch.batch)
SUM_BLOCK = 1 << 17  # register values the switch sums per block (512 KiB of int32: in L2; SMLSwitch._sum)
SUM_CALLS = 16  # (above 4x this many calls per job: one pass per call, no blocks)
SUM_SPLIT_MIN = 1 << 18  # register values from which a switch with threads > 1 sums two halves at once
#: batches of at least this many packets try the array form (SMLSwitch._batch_arrays; a numpy call costs
#: microseconds here). Pass 4 measured 1,024 (-30% of the switch's CPU with 1,712-packet batches, +10% with
#: 428); pass 6, after the array form's per-packet Python for shared lanes went (one process, small's
#: gradient, one worker's packets a batch as the live role drains them, 2 x 40 syncs): 428-packet batches
#: (2,048 values a packet) 4.3-4.5 ms a sync in array form against 5.9-7.6 in the loop, 292-packet ones
#: (3,000) 7.0 against 5.8, 214 (4,096) 6.9-7.0 against 3.9-5.0, 107 (8,192) 3.0-3.1 against 1.9-2.2
ARRAY_MIN = 400
#: the array form reads a job's registers whole when its partition (2 x pool slot-versions) is at most this
#: many times the batch (else only the slot-versions the batch touches)
WHOLE_STATE = 8
#: a worker handles a batch of at least this many results in array form (SMLFloatWorker.on_headers)
WORKER_ARRAY_MIN = 32


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
        if p.job != self.job or not p.is_result:
            return []
        return self._result(p.slot, p.off, p.ver, p.exp, p.payload, now)

    def _result(self, slot: int, c: int, ver: int, exp: int, payload: Optional[np.ndarray],
                now: float) -> List[SMLPacket]:
        """The result of item ``c`` through ``slot`` (version ``ver``): the packets it lets go."""
        if self.done or not 0 <= c < self.n or self.got[c] or not 0 <= slot < self.pool or self.cur[slot] != c:
            self.stats.dup_acks += 1
            return []
        self.stats.acks += 1
        self.got[c] = 1
        self.n_got += 1
        self._store(c, ver, slot, exp, payload)
        nxt = c + self.stride  # the slot's next item
        if self.n_got == self.n:
            self.done = True
            self.timers.clear()
            return []
        if nxt < self.n:
            self.cur[slot] = nxt
            return [self._send(slot, nxt, now, 0)]
        self.cur[slot] = -1
        self.deadline[slot] = None
        return []

    def _store(self, c: int, ver: int, slot: int, exp: int, payload: Optional[np.ndarray]) -> None:
        """Keep the result of chunk ``c``."""
        self.result[c] = payload

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
                raise ValueError(f"shared-memory lanes must be int32 of shape (2, {pool}, {k}), got {a.dtype} {a.shape}")
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
        one array of headers (issue 28)."""
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

    # ------------------------------------------------------------------ array form (issue 28, pass 4)
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
        run = _run_of(s_idx)  # (slots a, a+1, …: the usual batch — list slices instead of loops; issue 28, pass 6)
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
        run = _run_of(ss) if len(ss) else None
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
        run = _run_of(slots)
        if run:  # slots a, a+1, …: list slices (the same updates; issue 28, pass 6)
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
            qr = _run_of(q_c)
            if qr:
                chunks[qr[0]:qr[1]] = [_IN_SHM] * (qr[1] - qr[0])
            else:
                for it in q_c.tolist():
                    chunks[it] = _IN_SHM
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

        A float32 ``x`` stays float32 (issue 28: half the bytes per pass): scaling by a power of
        two is exact in either type and the rounded integers are the same (a value whose
        scaled magnitude would be subnormal in float32 rounds to 0 either way).

        ``out`` (float32 or float64, ``x``'s length; may be ``x`` itself): where each chunk's
        result is written as it arrives (dequantized from the received lanes in one pass, issue
        28: no integer copy of the whole result, no conversion pass at the end). A chunk is
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
        self.chunks = [_EMPTY] * P + [None] * n  # type: ignore[list-item] - quantized when sent
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
                self.chunks[item] = _IN_SHM
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
        """The numpy work of the packets handled since the last flush, a few calls for all of them
        (issue 28): quantize the chunks about to be sent, ``q = rint(x · 2^(B−e))`` into their lanes
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
        for a, b in _runs(cs, slots, same=vers):  # consecutive chunks through consecutive slots
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
        for a, b in _runs(ds, slots, same=vers):
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


def _run_of(a: np.ndarray) -> Optional[Tuple[int, int]]:
    """``(a[0], a[-1] + 1)`` when ``a`` (int array, non-empty) is ``a[0], a[0] + 1, …``; else None."""
    if not len(a):
        return None
    lo, hi = int(a[0]), int(a[-1]) + 1
    if hi - lo != len(a) or (len(a) > 2 and not (np.diff(a) == 1).all()):
        return None
    return lo, hi


def _peaks(body: np.ndarray) -> np.ndarray:
    """``max |x|`` per row of ``body`` (0 for no rows), as its max and min block by block: the min reads
    the block the max just read, from cache (issue 28, pass 6)."""
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

    # ------------------------------------------------------------------ headers as arrays (issue 28)
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
