"""ATP switch data plane (§5.3, Figure 4): one pure step function ``process(state, pkt)``.

The switch is *event-triggered* and job-agnostic (§5): every allocation, aggregation and
deallocation is caused by one arriving packet, and the only per-job control state a packet
needs (fan-in degrees, bitmaps, shard) travels in its header. :func:`process` is the whole
data plane: ``(SwitchState, Packet) -> (SwitchState, (Packet, ...))``. It has no side effect
other than updating the register arrays held by ``state`` (in place, as a P4 register
action would) and rewriting the packet; the returned packets are forwarded by normal
routing (gradients toward the PS, parameter packets along the job's multicast tree). The
simulator, the live UDP emulator and the P4 program all run or mirror this one function;
the step markers ①–⑩ in the code are Figure 4's. :func:`process_batch` is the same function over a
batch of packets (the live emulator's): the decisions packet by packet, the lane work of the
whole batch collected (:class:`LanePlan`) and done in a few array operations.

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
* Stale sequences: a parameter packet carries its PS shard's low watermark (every sequence
  of the shard below it is complete), and the switch keeps the highest one it has seen per
  ⟨job, shard⟩. A gradient below its job's watermark is already complete and is forwarded
  without allocating.
* No aggregator outlives its job (the must-show "afterwards no aggregator is left allocated
  anywhere"). The one way an aggregator can be left behind is a late duplicate or reordered
  first transmission of sequence ``s`` that arrives after ``s``'s parameter packet has
  passed but while the watermark here is still ≤ ``s`` (``s`` completed out of order): it
  allocates, and nobody else of its job will ever send ``s`` again. Such an aggregator
  becomes provably useless exactly when the watermark passes ``s``, and the watermark
  only moves on a parameter packet of the same ⟨job, shard⟩. So that parameter packet
  sweeps: when it raises the watermark from ``old`` to ``w`` it frees every aggregator of
  its ⟨job, shard⟩ holding a sequence in ``[old, w)`` — each can only sit at
  ``agg_slot(agg_hash(job, s), n)``, so the sweep reads those indices (or walks the array once
  when the jump is longer than the array). Invariant after every packet: no aggregator of
  ⟨job, shard⟩ holds a sequence below the watermark learnt here. The last parameter
  packets of a job carry a watermark past its last sequence (every switch on the job's
  path sees them, or the re-answers to the retransmissions of workers that missed them),
  so once a job completes none of its aggregators is allocated — ``allocated(st) == 0``,
  asserted by the property test under loss, duplication and reordering. This is the
  paper's design (§4.2, §5: switch state changes only on arriving packets, driven by the
  end hosts, no controller): the job's own parameter packets, not a control-plane
  teardown, reclaim the memory. Cost: a parameter packet that completes in order crosses
  only its own sequence (already deallocated by ②), so the sweep reads one index per PS
  shard; over a job the sweep visits each sequence once per switch. (The reclaim-on-touch
  rule this replaces left stale entries whenever no later packet of the job hashed to
  them — about 4 % of randomized fault runs.) :meth:`SwitchState.remove_job` remains the
  control plane's teardown of the job table entry; it finds nothing left to free after a
  completed job.
* A switch with no aggregators (``n == 0``) treats every gradient as a collision.
* A packet reaching an aggregation level must name exactly one child in that level's
  bitmap, within its fan-in; anything else is malformed (dropped, counted). Flushed
  multi-contributor packets only travel to the PS, which accepts them.

Notes for the P4 mirror: the ⑦ flush is a clone (ingress-to-egress mirroring); the
⟨job, seq⟩ identifier is one 48-bit key compared in one register action; the stale test
reads the watermark register at the packet's own ⟨job, shard⟩ only. The v1model program
applies the watermark sweep lazily, with the same outputs: an aggregator whose sequence is
below its own job's watermark for its shard is exactly one this sweep has freed, so a
packet that touches such an aggregator treats it as free (the register keeps the stale key
until then; ``p4/README.md``). An eager P4 sweep would be a recirculation loop, one pass
per sequence of ``[old, w)``. Egress ECN marking
(:func:`ecn_mark`) compares the enqueue depth with a threshold, as a P4 egress control
does with ``enq_qdepth``; the simulator's links apply the same rule (inlined in ``Link.send``).
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

from atp_pipeline.ina.counters import Counters
from atp_pipeline.ina.packet import DEFAULT_BITMAP_BITS, DecodeError, Packet, PacketFormat, validate_gradient

FLAG_ECN = 1
FLAG_OVF = 2


_JOB_CRC: Dict[int, int] = {}
_HASH_CAP = 1 << 16  # entries of a switch's hash memo (SwitchState.hmemo) before it is emptied


def agg_hash(job: int, seq: int) -> int:
    """CRC32 over ⟨job (16 bit), seq (32 bit)⟩ in network byte order (§5.3, released code).

    Computed incrementally: CRC32 of the 2 job bytes (cached), continued over the 4 seq bytes
    — identical to ``zlib.crc32(job.to_bytes(2) + seq.to_bytes(4))``."""
    c = _JOB_CRC.get(job)
    if c is None:
        c = _JOB_CRC[job] = zlib.crc32((job & 0xFFFF).to_bytes(2, "big"))
    return zlib.crc32((seq & 0xFFFFFFFF).to_bytes(4, "big"), c)


def check_pool_size(n: int) -> int:
    """``n`` if it is a valid aggregator pool size (0, or a power of two), else ValueError.

    §5.3 indexes the aggregator array by a hash of ⟨job, seq⟩. P4 targets have no run-time
    ``%`` (p4c rejects it; Tofino reduces a hash by taking its low bits), so every pool, in
    the P4 programs as in this emulator and the simulator, is a power of two."""
    n = int(n)
    if n < 0 or n & (n - 1):
        raise ValueError(f"n_aggregators={n} must be 0 or a power of two (the P4 index is a bit mask)")
    return n


def agg_slot(h: int, n: int) -> int:
    """Aggregator index of hash ``h`` in a pool of ``n`` (a power of two, :func:`check_pool_size`):
    the low ``log2(n)`` bits of ``h``. The one reduction of the hash (§5.3): the switch, the
    simulator, the trace generator and the live emulator call it, and both P4 programs compute
    the same ``h & (ATP_N_AGG - 1)`` (``ATP_N_AGG`` generated by ``atp_pipeline.ina.p4.codegen``)."""
    return h & (n - 1)


def _hash_miss(st: "SwitchState", job: int, seq: int, pkey: int) -> int:
    """:func:`agg_hash` for a key not in the switch's memo ``st.hmemo``; memoizes it.

    The memo is a cache of a pure function (what a hardware CRC unit computes per packet),
    kept because every packet of a sequence hashes alike; it is emptied when full."""
    h = agg_hash(job, seq)
    m = st.hmemo
    if len(m) >= _HASH_CAP:
        m.clear()
    if 0 <= seq <= 0xFFFFFFFF and 0 <= job <= 0xFFFF:  # then pkey names ⟨job, seq⟩ uniquely
        m[pkey] = h
    return h


def _swept(st: "SwitchState", job: int, shard: int, lo: int, hi: int) -> List[int]:
    """Aggregators of ⟨job, shard⟩ holding a sequence in ``[lo, hi)``: the ones a watermark
    advance from ``lo`` to ``hi`` makes stale (every sequence of the shard below ``hi`` is
    complete). An aggregator of ⟨job, s⟩ can only sit at ``agg_slot(agg_hash(job, s), n)``, so the
    sweep reads those indices; when the jump is longer than the array it walks the array
    once instead. (In P4: the parameter packet recirculates with a cursor, one index per
    pass — see the module docstring.)"""
    n = st.n
    key, sh, sq = st.key, st.shard, st.seq
    out: List[int] = []
    if hi - lo > n:
        for i in range(n):
            k = key[i]
            if k >= 0 and k >> 32 == job and sh[i] == shard and sq[i] < hi:
                out.append(i)
        return out
    memo = st.hmemo
    base = job << 32
    for s in range(lo, hi):
        pk = base | s
        h = memo.get(pk)
        if h is None:
            h = _hash_miss(st, job, s, pk)
        i = agg_slot(h, n)
        if key[i] == pk and sh[i] == shard:
            out.append(i)
    return out


class SwitchStats(Counters):
    """Counters of one switch. Every packet handed to :func:`process` (or
    :func:`process_bytes`) lands in exactly one of :data:`OUTCOMES`; ``complete``,
    ``dealloc_param``, ``resend_merged`` and ``stale_reclaimed`` (aggregators freed by a
    parameter packet's watermark sweep) count side effects."""

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
        n = check_pool_size(n_aggregators)
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
        #: ⟨job, seq⟩ key -> agg_hash (a cache of the pure hash function, see _hash_miss)
        self.hmemo: Dict[int, int] = {}
        #: aggregator allocations per job since start (a per-job counter register in P4)
        self.job_allocs: Dict[int, int] = {}
        #: sequences completed here per job (⑥; a per-job counter register in P4)
        self.job_complete: Dict[int, int] = {}

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


def process(st: SwitchState, p: Packet, plan: Optional["LanePlan"] = None) -> Tuple[SwitchState, Tuple[Packet, ...]]:
    """One packet through the ATP data plane; returns the packets to forward (a tuple,
    empty when the packet was consumed or dropped).

    ``plan`` (:func:`process_batch`): the packet's lane work — the int32 adds, copies and reads of
    aggregator rows — is recorded there instead of done now (the returned packets' payloads are
    filled when the batch's plan runs); every decision is taken here, packet by packet, either way.

    The steps, each a function of its own: the job table (a miss is counted and dropped), the
    hash of ⟨job, seq⟩, then a parameter packet's ② and watermark (:func:`_parameter`) or a
    gradient's level, header checks, stale and collision tests (:func:`_gradient`), and at its
    aggregator a merge (①④⑤⑥, :func:`_merge`), a retransmission's flush (⑦ :func:`_flush_level1`,
    ⑧⑨⑩ :func:`_flush_resend`) or an allocation (:func:`_allocate`)."""
    S = st.stats
    job = p.job
    if job not in st.jobs:  # classifier/job table miss: not an ATP job known here
        S.unknown_job += 1
        return st, ()
    pkey = job << 32 | p.seq
    h = st.hmemo.get(pkey)
    if h is None:  # = agg_hash(job, seq)
        h = _hash_miss(st, job, p.seq, pkey)
    if p.is_param:
        return st, _parameter(st, p, h, pkey)
    return st, _gradient(st, p, h, pkey, plan)


def _parameter(st: SwitchState, p: Packet, h: int, pkey: int) -> Tuple[Packet, ...]:
    """② A parameter packet: deallocate the matching aggregator, learn the shard's watermark
    (freeing the aggregators of the sequences it crosses, :func:`_swept`), then multicast."""
    S = st.stats
    S.param += 1
    n, job, seq, ps = st.n, p.job, p.seq, p.ps_index
    wkey = job << 2 | ps
    old = st.watermark.get(wkey, 0)
    if n:
        i = agg_slot(h, n)
        if st.key[i] == pkey:
            _free(st, i)
            S.dealloc_param += 1
    w = p.watermark
    if w > old:
        st.watermark[wkey] = w
        if n and (old < seq or w > seq + 1):  # (crossing only its own seq: done by ②)
            # the watermark crossed [old, w): aggregators of this ⟨job, shard⟩ left there
            # (late duplicates allocated after their sequence's parameter packet) are stale
            for i in _swept(st, job, ps, old, w):
                _free(st, i)
                S.stale_reclaimed += 1
    return (p,)


def _bad_header(st: SwitchState, p: Packet, e: int, fan_in: int, bm: int) -> bool:
    """Header sanity (as :func:`validate_gradient`) for the level about to be touched: a packet
    arriving at an aggregation level carries exactly one child, within that level's fan-in."""
    bits = st.bitmap_bits
    return bool(fan_in > bits or bm == 0 or bm >> fan_in or bm & (bm - 1) or p.fan_in1 > bits or (
        e and (p.fan_in0 == 0 or p.fan_in0 > bits or p.bitmap0 == 0 or p.bitmap0 >> p.fan_in0)))


def _gradient(st: SwitchState, p: Packet, h: int, pkey: int, plan: Optional["LanePlan"]) -> Tuple[Packet, ...]:
    """A gradient packet: ③ its level's fan-in and bitmap, the header checks, the stale and
    no-aggregator tests, then what its aggregator (``agg_slot(h, n)``) holds decides."""
    S = st.stats
    e = p.edge  # ③ the edge-switch identifier selects this level's fan-in and bitmap
    if e == 0:
        fan_in, bm = p.fan_in0, p.bitmap0
    else:
        fan_in, bm = p.fan_in1, p.bitmap1
    if fan_in == 0:  # this packet has no aggregation service at this level: plain forward
        if validate_gradient(p, st.bitmap_bits) is not None:
            S.malformed += 1
            return ()
        S.no_service += 1
        return (p,)
    if _bad_header(st, p, e, fan_in, bm):
        S.malformed += 1
        return ()
    if p.seq < st.watermark.get(p.job << 2 | p.ps_index, 0):  # already complete: never allocate
        S.stale_forward += 1
        p.resend = 1
        p.edge = e ^ 1
        return (p,)
    n = st.n
    if n == 0:
        S.collision += 1
        p.resend = p.collision = 1
        p.edge = e ^ 1
        return (p,)
    i = agg_slot(h, n)
    p.agg_index = h
    k = st.key[i]
    if k == pkey:
        if not p.resend:
            return _merge(st, i, p, e, fan_in, bm, plan)
        if e == 1:
            return _flush_level1(st, i, p, plan)
        return _flush_resend(st, i, p, bm, plan)
    if p.resend:  # no aggregator of ours: straight upstream, never allocate
        if k >= 0:
            p.collision = 1
        p.edge = e ^ 1
        S.resend_forward += 1
        return (p,)
    if k < 0:
        return _allocate(st, i, p, e, fan_in, bm, plan)
    # ① occupied by another ⟨job, seq⟩: upstream untouched, resend set, level flipped
    p.resend = p.collision = 1
    p.edge = e ^ 1
    S.collision += 1
    return (p,)


def _merge(st: SwitchState, i: int, p: Packet, e: int, fan_in: int, bm: int,
           plan: Optional["LanePlan"]) -> Tuple[Packet, ...]:
    """① matched, a first transmission: aggregate into aggregator ``i`` (fan-in and bitmap chosen
    at ③) unless its bit is already there (④ duplicate: dropped); ⑥ complete: send upstream."""
    S = st.stats
    bmap = st.bitmap
    have = bmap[i]
    if have & bm:  # ④ already aggregated and not a retransmission: drop
        S.dup_dropped += 1
        return ()
    if plan is None:
        row = st.rows[i]
        np.add(row, p.payload, row)
    else:
        plan.add(i, p.payload)
    bmap[i] = have | bm
    counts = st.count
    cnt = counts[i] = counts[i] + 1  # ⑤ redundant popcount
    if p.ecn or p.overflow:
        st.flags[i] |= p.ecn | (p.overflow << 1)
    S.merged += 1
    if cnt < fan_in:  # ⑥ not complete: the packet is consumed
        return ()
    return (_complete(st, i, p, e, plan),)


def _flush_level1(st: SwitchState, i: int, p: Packet, plan: Optional["LanePlan"]) -> Tuple[Packet, ...]:
    """⑦ A retransmission at the second level: forward it directly; flush what aggregator ``i``
    holds in a clone, then ⑩ deallocate."""
    S = st.stats
    c = p.copy()
    if plan is None:
        c.payload = st.rows[i].copy()
    else:
        plan.read(i, c)
    c.bitmap1 = st.bitmap[i]
    c.agg1 = 1
    c.ecn |= st.flags[i] & FLAG_ECN
    c.overflow |= (st.flags[i] & FLAG_OVF) >> 1
    c.edge = 0
    p.edge = 0
    _free(st, i)
    S.l1_flush += 1
    return (c, p)


def _flush_resend(st: SwitchState, i: int, p: Packet, bm: int, plan: Optional["LanePlan"]) -> Tuple[Packet, ...]:
    """A retransmission at the first level: ④ merge if this worker is new (⑧: already merged),
    ⑨ copy aggregator ``i``'s value and bitmap into the packet, send upstream, ⑩ deallocate."""
    S = st.stats
    if not st.bitmap[i] & bm:
        if plan is None:
            row = st.rows[i]
            np.add(row, p.payload, row)
        else:
            plan.add(i, p.payload)
        st.bitmap[i] |= bm
        st.count[i] += 1
        st.flags[i] |= p.ecn | (p.overflow << 1)
        S.resend_merged += 1
    if plan is None:
        p.payload = st.rows[i].copy()
    else:
        plan.read(i, p)
    p.bitmap0 = st.bitmap[i]
    p.ecn |= st.flags[i] & FLAG_ECN
    p.overflow |= (st.flags[i] & FLAG_OVF) >> 1
    p.edge = 1
    _free(st, i)
    S.resend_flush += 1
    return (p,)


def _allocate(st: SwitchState, i: int, p: Packet, e: int, fan_in: int, bm: int,
              plan: Optional["LanePlan"]) -> Tuple[Packet, ...]:
    """Allocation: claim the free aggregator ``i`` with ⟨job, seq⟩, value and bitmap (⑥ at once
    for a fan-in of 1)."""
    S = st.stats
    _claim(st, i, p.job, p.seq, p.ps_index, bm)
    st.flags[i] = p.ecn | (p.overflow << 1)
    if plan is None:
        st.rows[i][:] = p.payload
    else:
        plan.set(i, p.payload)
    S.alloc += 1
    if fan_in > 1:
        return ()
    return (_complete(st, i, p, e, plan),)


def process_batch(st: SwitchState, pkts: Sequence[Packet]) -> List[Tuple[Packet, ...]]:
    """Packets ``pkts``, in order, through the data plane: for each, the packets to forward —
    what :func:`process` returns for them one at a time (tested equal: outputs, registers and
    counters; ``tests/ina/test_switch.py``). Every decision is :func:`process`'s, packet by packet;
    the lane work is collected in a :class:`LanePlan` and done at the end in a few array
    operations (the live emulator's batch)."""
    plan = LanePlan()
    outs = [process(st, p, plan)[1] for p in pkts]
    plan.run(st)
    return outs


_SET, _ADD, _READ = 0, 1, 2


class LanePlan:
    """The lane work of a batch of packets (:func:`process_batch`), recorded in order by
    :func:`process`: ``set`` (an allocation writes the packet's lanes into aggregator ``i``),
    ``add`` (a merge adds them), ``read`` (a packet leaving with the aggregator's value: ⑥, ⑦, ⑨).

    :meth:`run` replays it level by level: an aggregator's ``d``-th operation is at level ``d``,
    so a level names each aggregator at most once and its operations are array operations over
    all its rows at once (one copy of their lanes, one add, one gather), and every aggregator
    sees its operations in the order the packets recorded them — the rows and the packets'
    payloads end as :func:`process` one packet at a time leaves them."""

    __slots__ = ("ops", "depth")

    def __init__(self) -> None:
        self.ops: List[Tuple[int, int, int, Any]] = []  # (level, kind, aggregator, lanes or packet)
        self.depth: Dict[int, int] = {}  # aggregator -> operations recorded on it

    def _level(self, i: int) -> int:
        d = self.depth.get(i, 0)
        self.depth[i] = d + 1
        return d

    def set(self, i: int, lanes: np.ndarray) -> None:
        self.ops.append((self._level(i), _SET, i, lanes))

    def add(self, i: int, lanes: np.ndarray) -> None:
        self.ops.append((self._level(i), _ADD, i, lanes))

    def read(self, i: int, p: Packet) -> None:
        self.ops.append((self._level(i), _READ, i, p))

    def run(self, st: SwitchState) -> None:
        if not self.ops:
            return
        vals, rows = st.values, st.rows
        levels: Dict[int, Tuple[List[Tuple[int, Any]], ...]] = {}
        for lvl, kind, i, x in self.ops:
            got = levels.get(lvl)
            if got is None:
                got = levels[lvl] = ([], [], [])
            got[kind].append((i, x))
        for lvl in sorted(levels):
            sets, adds, reads = levels[lvl]
            for todo, kind in ((sets, _SET), (adds, _ADD)):
                if len(todo) < LANE_ARRAY_MIN:  # a few rows: one call each
                    for i, x in todo:
                        if kind == _SET:
                            rows[i][:] = x
                        else:
                            np.add(rows[i], x, rows[i])
                    continue
                idx = np.fromiter((i for i, _ in todo), dtype=np.intp, count=len(todo))
                src = np.stack([x for _, x in todo])
                if kind == _SET:
                    vals[idx] = src
                else:
                    vals[idx] += src  # (distinct rows within a level)
            if reads:
                if len(reads) < LANE_ARRAY_MIN:
                    for i, p in reads:
                        p.payload = rows[i].copy()
                    continue
                got = vals[np.fromiter((i for i, _ in reads), dtype=np.intp, count=len(reads))]
                for n, (_, p) in enumerate(reads):
                    p.payload = got[n]
        self.ops.clear()
        self.depth.clear()


#: a level's operations of one kind on at least this many aggregators go as one array operation
#: (:meth:`LanePlan.run`); fewer, one numpy call per aggregator
LANE_ARRAY_MIN = 4


def _complete(st: SwitchState, i: int, p: Packet, e: int, plan: Optional["LanePlan"]) -> Packet:
    """⑥ complete: the packet carries the aggregate upstream; the aggregator stays until ②."""
    if plan is None:
        p.payload = st.rows[i].copy()
    else:
        plan.read(i, p)
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
    st.job_complete[p.job] = st.job_complete.get(p.job, 0) + 1
    return p


#: :func:`process` and the steps it calls: one switch function, whose every line the P4 trace
#: corpus covers (``tests/p4/test_traces.py``)
PROCESS_STEPS = (process, _parameter, _gradient, _bad_header, _merge, _flush_level1, _flush_resend, _allocate,
                 _complete)


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
