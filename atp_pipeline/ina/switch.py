"""ATP switch data plane (§5.3, Figure 4): one pure step function ``process(state, pkt)``.

The switch is *event-triggered* and job-agnostic (§5): every allocation, aggregation and
deallocation is caused by one arriving packet, and the only per-job control state a packet
needs (fan-in degrees, bitmaps, shard) travels in its header. :func:`process` is the whole
data plane: ``(SwitchState, Packet) -> (SwitchState, (Packet, ...))``. It has no side effect
other than updating the register arrays held by ``state`` (in place, as a P4 register
action would) and rewriting the packet; the returned packets are forwarded by normal
routing (gradients toward the PS, parameter packets along the job's multicast tree). The
simulator, the live UDP emulator and the P4 program all run or mirror this one function;
the step markers ①–⑩ in the code are Figure 4's.

Registers (Figure 3): ``n`` aggregators, each ⟨valid, job, seq, shard, bitmap, count, flags,
K int32 lanes⟩ (``count`` is the redundant popcount of footnote 1; ``flags`` ORs the ECN and
overflow bits of merged packets so a consumed packet's congestion signal survives
aggregation), plus a small register of per-⟨job, shard⟩ watermarks learnt from parameter
packets, and the job table installed at job setup (§5.1, the multicast groups).

Decisions where the paper is silent or loose, all chosen to keep aggregation exact and the
memory leak-free under loss, duplication and reordering:

* A retransmission that hits its aggregator at the first level merges if its bit is new
  (④), then carries the aggregator's value and bitmap upstream (⑨ — also for ⑧, where the
  paper forwards the bare packet: the aggregator's content is a superset of it, so no
  contribution is dropped by the deallocation), and deallocates (⑩).
* At the second level a retransmission is forwarded untouched (⑦); if it hits its
  aggregator, the partial level-1 aggregate is flushed upstream in a cloned packet
  (``agg1`` set) before the deallocation (⑩), so nothing aggregated there is lost.
* Retransmissions never allocate, so a retransmitted contribution always reaches the PS.
* Stale sequences: a parameter packet carries its PS shard's low watermark. A gradient
  below its job's watermark is already complete and is forwarded without allocating; an
  aggregator of the packet's job whose sequence is below the watermark is stale (a late
  duplicate or reordered packet allocated it after its parameter packet passed) and is
  reclaimed when any gradient or parameter packet of its job touches it (a decision on
  packet-local state only). :func:`live_aggregators` lists allocated, non-stale
  aggregators — the ones that would be real leaks; :meth:`SwitchState.remove_job` clears
  a finished job's stale ones at teardown.
* A switch with no aggregators (``n == 0``) treats every gradient as a collision.
* A packet reaching an aggregation level must name exactly one child in that level's
  bitmap, within its fan-in; anything else is malformed (dropped, counted). Flushed
  multi-contributor packets only travel to the PS, which accepts them.

Notes for the P4 mirror: the ⑦ flush is a clone (ingress-to-egress mirroring); the
⟨job, seq⟩ identifier is one 48-bit key compared in one register action; the stale test
reads the watermark register at the packet's own ⟨job, shard⟩ before the aggregator's
action, so it needs no second access to the same register. Egress ECN marking
(:func:`ecn_mark`) compares the enqueue depth with a threshold, as a P4 egress control
does with ``enq_qdepth``; the simulator's links call it.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

from atp_pipeline.ina.packet import DEFAULT_BITMAP_BITS, DecodeError, Packet, PacketFormat, validate_gradient
from atp_pipeline.ina.counters import Counters

FLAG_ECN = 1
FLAG_OVF = 2


_JOB_CRC: Dict[int, int] = {}


def agg_hash(job: int, seq: int) -> int:
    """CRC32 over ⟨job (16 bit), seq (32 bit)⟩ in network byte order (§5.3, released code).

    Computed incrementally: CRC32 of the 2 job bytes (cached), continued over the 4 seq bytes
    — identical to ``zlib.crc32(job.to_bytes(2) + seq.to_bytes(4))``."""
    c = _JOB_CRC.get(job)
    if c is None:
        c = _JOB_CRC[job] = zlib.crc32((job & 0xFFFF).to_bytes(2, "big"))
    return zlib.crc32((seq & 0xFFFFFFFF).to_bytes(4, "big"), c)


class SwitchStats(Counters):
    """Counters of one switch. Every packet handed to :func:`process` (or
    :func:`process_bytes`) lands in exactly one of :data:`OUTCOMES`; ``complete``,
    ``dealloc_param``, ``resend_merged`` and ``stale_reclaimed`` count side effects."""

    OUTCOMES = ("param", "alloc", "merged", "collision", "dup_dropped", "resend_flush",
                "resend_forward", "l1_flush", "stale_forward", "no_service", "unknown_job", "malformed")
    __slots__ = OUTCOMES + ("complete", "dealloc_param", "resend_merged", "stale_reclaimed")

    def packets(self) -> int:
        """Packets seen (sum of the exclusive outcomes)."""
        return sum(getattr(self, s) for s in self.OUTCOMES)


class SwitchState:
    """Register arrays of one programmable switch's ATP partition (Figure 3).

    ``key[i]`` is aggregator ``i``'s ⟨job, seq⟩ identifier packed as ``job << 32 | seq``, or
    ``-1`` when free; ``valid``/``job``/``seq``/``shard`` mirror it for inspection."""

    def __init__(self, n_aggregators: int, payload_k: int, bitmap_bits: int = DEFAULT_BITMAP_BITS,
                 jobs: Iterable[int] = ()) -> None:
        n = int(n_aggregators)
        if n < 0:
            raise ValueError("n_aggregators must be >= 0")
        self.n = n
        self.k = int(payload_k)
        self.bitmap_bits = int(bitmap_bits)
        self.key: List[int] = [-1] * n
        self.valid: List[bool] = [False] * n
        self.job: List[int] = [0] * n
        self.seq: List[int] = [0] * n
        self.shard: List[int] = [0] * n
        self.bitmap: List[int] = [0] * n
        self.count: List[int] = [0] * n
        self.flags: List[int] = [0] * n
        self.values = np.zeros((n, self.k), dtype=np.int32)
        self.rows: List[np.ndarray] = list(self.values)  # per-aggregator views (fast indexing)
        self.watermark: Dict[int, int] = {}  # (job << 2 | shard) -> low watermark
        self.jobs: Set[int] = set(jobs)
        self.stats = SwitchStats()
        #: aggregator allocations per job since start (a per-job counter register in P4)
        self.job_allocs: Dict[int, int] = {}

    def add_job(self, job: int) -> None:
        """Per-job setup (§5.1): the job's multicast group exists at this switch."""
        self.jobs.add(job)

    def remove_job(self, job: int) -> int:
        """Job teardown by the control plane (the inverse of §5.1's setup: the job's
        multicast group and table entry go away): clears the job's aggregators and
        watermarks; returns how many aggregators were still allocated."""
        self.jobs.discard(job)
        freed = 0
        for i in range(self.n):
            if self.key[i] >= 0 and self.key[i] >> 32 == job:
                _free(self, i)
                freed += 1
        for w in [w for w in self.watermark if w >> 2 == job]:
            del self.watermark[w]
        return freed

    def wm(self, job: int, shard: int) -> int:
        """The watermark this switch learnt for ⟨job, shard⟩ (0 if none yet)."""
        return self.watermark.get(job << 2 | shard, 0)

    def pin(self, idx: int, job: int, seq: int) -> None:
        """Occupy aggregator ``idx`` permanently for a foreign ⟨job, seq⟩ (contention emulation)."""
        _claim(self, idx, job, seq, 0, 0)


def _claim(st: SwitchState, i: int, job: int, seq: int, shard: int, bm: int) -> None:
    st.key[i] = job << 32 | seq
    st.valid[i] = True
    st.job[i], st.seq[i], st.shard[i] = job, seq, shard
    st.bitmap[i] = bm
    st.count[i] = 1 if bm else 0
    st.job_allocs[job] = st.job_allocs.get(job, 0) + 1


def _free(st: SwitchState, i: int) -> None:
    st.key[i] = -1
    st.valid[i] = False
    st.job[i] = st.seq[i] = st.shard[i] = st.bitmap[i] = st.count[i] = st.flags[i] = 0


def process(st: SwitchState, p: Packet) -> Tuple[SwitchState, Tuple[Packet, ...]]:
    """One packet through the ATP data plane; returns the packets to forward (a tuple,
    empty when the packet was consumed or dropped)."""
    S = st.stats
    job = p.job
    if job not in st.jobs:  # classifier/job table miss: not an ATP job known here
        S.unknown_job += 1
        return st, ()
    n = st.n
    seq = p.seq
    c = _JOB_CRC.get(job)
    if c is None:
        c = _JOB_CRC[job] = zlib.crc32((job & 0xFFFF).to_bytes(2, "big"))
    h = zlib.crc32((seq & 0xFFFFFFFF).to_bytes(4, "big"), c)  # = agg_hash(job, seq)
    pkey = job << 32 | seq
    if p.is_param:
        S.param += 1
        wkey = job << 2 | p.ps_index
        if p.watermark > st.watermark.get(wkey, 0):
            st.watermark[wkey] = p.watermark
        if n:
            i = h % n
            k = st.key[i]
            # ② parameter packet: deallocate the matching aggregator, then multicast
            if k == pkey:
                _free(st, i)
                S.dealloc_param += 1
            elif k >= 0 and k >> 32 == job and st.seq[i] < st.watermark.get(job << 2 | st.shard[i], 0):
                _free(st, i)  # a stale aggregator of this job: reclaim on touch
                S.stale_reclaimed += 1
        return st, (p,)

    e = p.edge  # ③ the edge-switch identifier selects this level's fan-in and bitmap
    if e == 0:
        fan_in, bm = p.fan_in0, p.bitmap0
    else:
        fan_in, bm = p.fan_in1, p.bitmap1
    if fan_in == 0:  # this packet has no aggregation service at this level: plain forward
        if validate_gradient(p, st.bitmap_bits) is not None:
            S.malformed += 1
            return st, ()
        S.no_service += 1
        return st, (p,)
    # header sanity (as validate_gradient) for the level about to be touched; a packet
    # arriving at an aggregation level carries exactly one child
    bits = st.bitmap_bits
    if fan_in > bits or bm == 0 or bm >> fan_in or bm & (bm - 1) or p.fan_in1 > bits or (
            e and (p.fan_in0 == 0 or p.fan_in0 > bits or p.bitmap0 == 0 or p.bitmap0 >> p.fan_in0)):
        S.malformed += 1
        return st, ()
    wm = st.watermark
    if seq < wm.get(job << 2 | p.ps_index, 0):  # already complete: never allocate
        S.stale_forward += 1
        p.resend = 1
        p.edge = e ^ 1
        return st, (p,)
    if n == 0:
        S.collision += 1
        p.resend = p.collision = 1
        p.edge = e ^ 1
        return st, (p,)
    i = h % n
    p.agg_index = h
    k = st.key[i]
    if k == pkey:
        match = valid = True
    elif k < 0:
        match = valid = False
    else:
        match = False
        valid = True
        if k >> 32 == job and st.seq[i] < wm.get(job << 2 | st.shard[i], 0):
            _free(st, i)  # stale aggregator of this job: reclaim on touch
            S.stale_reclaimed += 1
            valid = False

    if p.resend:
        if not match:  # no aggregator of ours: straight upstream, never allocate
            if valid:
                p.collision = 1
            p.edge = e ^ 1
            S.resend_forward += 1
            return st, (p,)
        if e == 1:
            # ⑦ second level: forward the retransmission directly; flush what this
            # aggregator holds in a clone, then ⑩ deallocate
            c = p.copy()
            c.payload = st.rows[i].copy()
            c.bitmap1 = st.bitmap[i]
            c.agg1 = 1
            c.ecn |= st.flags[i] & FLAG_ECN
            c.overflow |= (st.flags[i] & FLAG_OVF) >> 1
            c.edge = 0
            p.edge = 0
            _free(st, i)
            S.l1_flush += 1
            return st, (c, p)
        # first level: ④ merge if this worker is new (⑧: already merged), ⑨ copy the
        # aggregator's value and bitmap into the packet, send upstream, ⑩ deallocate
        if not st.bitmap[i] & bm:
            row = st.rows[i]
            np.add(row, p.payload, out=row)
            st.bitmap[i] |= bm
            st.count[i] += 1
            st.flags[i] |= p.ecn | (p.overflow << 1)
            S.resend_merged += 1
        p.payload = st.rows[i].copy()
        p.bitmap0 = st.bitmap[i]
        p.ecn |= st.flags[i] & FLAG_ECN
        p.overflow |= (st.flags[i] & FLAG_OVF) >> 1
        p.edge = 1
        _free(st, i)
        S.resend_flush += 1
        return st, (p,)

    if not valid:
        # allocation: claim the free aggregator with ⟨job, seq⟩, value and bitmap
        _claim(st, i, job, seq, p.ps_index, bm)
        st.flags[i] = p.ecn | (p.overflow << 1)
        st.rows[i][:] = p.payload
        S.alloc += 1
        if fan_in > 1:
            return st, ()
        return st, (_complete(st, i, p, e),)
    if not match:
        # ① occupied by another ⟨job, seq⟩: upstream untouched, resend set, level flipped
        p.resend = p.collision = 1
        p.edge = e ^ 1
        S.collision += 1
        return st, (p,)
    # ① matched: aggregate into this aggregator (fan-in and bitmap chosen at ③ above)
    if st.bitmap[i] & bm:  # ④ already aggregated and not a retransmission: drop
        S.dup_dropped += 1
        return st, ()
    row = st.rows[i]
    np.add(row, p.payload, out=row)
    st.bitmap[i] |= bm
    cnt = st.count[i] = st.count[i] + 1  # ⑤ redundant popcount
    if p.ecn or p.overflow:
        st.flags[i] |= p.ecn | (p.overflow << 1)
    S.merged += 1
    if cnt < fan_in:  # ⑥ not complete: the packet is consumed
        return st, ()
    return st, (_complete(st, i, p, e),)


def _complete(st: SwitchState, i: int, p: Packet, e: int) -> Packet:
    """⑥ complete: the packet carries the aggregate upstream; the aggregator stays until ②."""
    p.payload = st.rows[i].copy()
    if e == 0:
        p.bitmap0 = st.bitmap[i]
    else:
        p.bitmap1 = st.bitmap[i]
        p.agg1 = 1
    f = st.flags[i]
    p.ecn = f & FLAG_ECN
    p.overflow = (f & FLAG_OVF) >> 1
    p.edge = e ^ 1
    st.stats.complete += 1
    return p


def process_bytes(st: SwitchState, fmt: PacketFormat, buf: bytes) -> Tuple[SwitchState, Tuple[Packet, ...]]:
    """Decode then :func:`process`; a malformed buffer is dropped and counted."""
    try:
        p = fmt.decode(buf)
    except DecodeError:
        st.stats.malformed += 1
        return st, ()
    return process(st, p)


def ecn_mark(p: Any, backlog_bytes: float, threshold_bytes: float) -> Any:
    """Egress ECN marking (§5.4): the packet to transmit — a marked copy when the egress
    queue holds more than ``threshold_bytes`` (copy-on-write, because multicast replicas
    share one packet object), else the packet itself."""
    if backlog_bytes > threshold_bytes and not p.ecn:
        p = p.copy()
        p.ecn = 1
    return p


def allocated(st: SwitchState) -> int:
    """Aggregators whose valid bit is set (including stale ones awaiting reclaim)."""
    return sum(st.valid)


def live_aggregators(st: SwitchState, ignore_jobs: Optional[Set[int]] = None) -> List[Tuple[int, int, int]]:
    """⟨index, job, seq⟩ of allocated aggregators that are not stale (true leaks if the
    network is quiescent); pinned foreign jobs in ``ignore_jobs`` are left out."""
    out = []
    for i in range(st.n):
        if not st.valid[i]:
            continue
        j, s = st.job[i], st.seq[i]
        if ignore_jobs and j in ignore_jobs:
            continue
        if s < st.wm(j, st.shard[i]):
            continue
        out.append((i, j, s))
    return out
