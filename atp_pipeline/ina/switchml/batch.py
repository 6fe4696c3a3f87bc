"""The array form of the SwitchML switch's decisions, for large batches.

:meth:`~.switch.SMLSwitch.batch` decides packet by packet; :func:`decide_batch` takes the same
decisions with array operations for the batches where no packet's decision depends on another's:
one job; every slot in one version; a worker at most once per slot-version; a slot-version that
gets new contributions gets no retransmissions and does not complete and restart within the
batch. Then each packet's outcome follows from the state before the batch and its rank among
the new contributions to its slot-version (the count it brings the slot-version to), which is
what the loop computes one packet after the other. Grouped by a stable sort on the slot-version,
every per-group quantity is a ``reduceat`` (no ``ufunc.at``), the job's registers are read and
written as whole arrays when its partition is small (else only the slot-versions touched), and
the results are built from arrays: a few dozen numpy calls a batch, no Python loop over its
packets. Tested equal to the per-packet form (``tests/ina/test_switchml_live_core.py``).
"""

from __future__ import annotations

from itertools import repeat
from operator import is_not
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.ina.switchml.lanes import ADD, NONE, SET

#: the array form reads a job's registers whole when its partition (2 x pool slot-versions) is at most this
#: many times the batch (else only the slot-versions the batch touches)
WHOLE_STATE = 8


class _Groups:
    """The known packets of a one-job batch grouped by slot-version (arrival order inside a group):
    ``idx`` (their indices in the batch, None when all are known), ``wk`` (worker), ``order`` (the
    stable sort), ``vs`` (sorted slot-versions), ``starts``/``gid`` (each group's first packet, each
    packet's group), ``uv``/``other`` (the slot-versions and their slots' other versions)."""

    __slots__ = ("idx", "wk", "order", "vs", "m", "first", "starts", "gid", "uv", "other")


def _group(js: Any, job: Sequence[int], slot: Sequence[int], ver: Sequence[int], is_result: Sequence[int],
           worker: Sequence[int]) -> Optional[_Groups]:
    """The batch's known packets (a contribution to a slot and a worker of job ``js``) grouped by
    slot-version; ``g.m == 0`` when none is known; None when a slot appears in both versions (the
    per-packet form decides)."""
    W, pool = js.W, js.pool
    g = _Groups()
    sl, vr, wk = np.asarray(slot, dtype=np.int64), np.asarray(ver, dtype=np.int64), np.asarray(worker, dtype=np.int64)
    known = (np.asarray(is_result) == 0) & (sl >= 0) & (sl < pool) & (wk >= 0) & (wk < W)
    g.idx = None
    if not known.all():
        g.idx = np.flatnonzero(known)
        if not len(g.idx):
            g.m = 0
            return g
        sl, vr, wk = sl[g.idx], vr[g.idx], wk[g.idx]
    vi = vr * pool + sl
    g.wk = wk
    g.order = np.argsort(vi, kind="stable")  # grouped by slot-version, arrival order inside
    g.vs = vs = vi[g.order]
    g.m = m = len(vs)
    g.first = first = np.empty(m, dtype=bool)
    first[0] = True
    np.not_equal(vs[1:], vs[:-1], out=first[1:])
    g.starts = np.flatnonzero(first)
    g.uv = uv = vs[g.starts]  # the slot-versions, ascending
    g.other = np.where(uv < pool, uv + pool, uv - pool)
    if len(uv) > 1 and np.isin(g.other, uv, assume_unique=True).any():  # a slot in both versions
        return None
    g.gid = np.cumsum(first) - 1  # group of each sorted packet
    return g


class _State:
    """A job's ``seen``/``count``/``exp`` of the slot-versions a batch touches (and ``seen`` of their
    slots' other versions, ``so``), read before the batch; ``whole``: read from (and written back
    to) the job's arrays, else from its lists."""

    __slots__ = ("whole", "seen0", "c0", "e0", "so", "arrays", "lists", "uvl", "othl")


def _read_state(js: Any, g: _Groups) -> _State:
    s = _State()
    uv, other = g.uv, g.other
    s.whole = 2 * js.pool <= WHOLE_STATE * g.m
    if s.whole:  # (kept as arrays between batches: SMLSwitchJob.arrays)
        s.arrays = seen_a, cnt_a, exp_a = js.arrays()
        s.seen0, s.c0, s.e0, s.so = seen_a[uv], cnt_a[uv], exp_a[uv], seen_a[other]
    else:
        s.uvl, s.othl = uvl, othl = uv.tolist(), other.tolist()
        s.lists = seen_l, cnt_l, exp_l = js.seen, js.count, js.exp
        s.seen0 = np.array([seen_l[v] for v in uvl], dtype=np.int64)
        s.c0 = np.array([cnt_l[v] for v in uvl], dtype=np.int64)
        s.e0 = np.array([exp_l[v] for v in uvl], dtype=np.int64)
        s.so = np.array([seen_l[v] for v in othl], dtype=np.int64)
    return s


def _write_state(s: _State, g: _Groups, seen1: np.ndarray, so1: np.ndarray, cnt1: np.ndarray,
                 fin: np.ndarray) -> None:
    if s.whole:
        seen_a, cnt_a, exp_a = s.arrays
        seen_a[g.uv], seen_a[g.other], cnt_a[g.uv], exp_a[g.uv] = seen1, so1, cnt1, fin
    else:
        seen_l, cnt_l, exp_l = s.lists
        for v, o, sv, ov, cv, ev in zip(s.uvl, s.othl, seen1.tolist(), so1.tolist(), cnt1.tolist(), fin.tolist()):
            seen_l[v], seen_l[o], cnt_l[v], exp_l[v] = sv, ov, cv, ev


class _Outcome:
    """Each sorted packet's outcome: ``new`` (a contribution whose bit is new), ``rank`` (1-based,
    among its group's new ones), ``c`` (the count it brings its slot-version to, mod W), ``c0g``
    (its slot-version's count before the batch); per group ``n_new`` and ``fin`` (the exponent the
    slot-version ends the batch with); ``em`` (exponent-only, sorted)."""

    __slots__ = ("new", "newi", "rank", "c", "c0g", "n_new", "fin", "bit", "em")


def _outcomes(js: Any, g: _Groups, s: _State, exp: Sequence[int], empty: Sequence[int]) -> Optional[_Outcome]:
    """The outcome of every packet from the state before the batch and its rank in its group; None
    (nothing changed) when a worker appears twice in a slot-version, a slot-version mixes new
    contributions and retransmissions, or it would complete and restart within the batch."""
    W, starts, gid, m = js.W, g.starts, g.gid, g.m
    o = _Outcome()
    o.bit = bit = np.left_shift(1, g.wk[g.order])
    if (np.bitwise_or.reduceat(bit, starts) != np.add.reduceat(bit, starts)).any():  # a worker twice
        return None
    o.new = new = (s.seen0[gid] & bit) == 0
    o.newi = newi = new.astype(np.int64)
    o.n_new = n_new = np.add.reduceat(newi, starts)
    n_all = np.diff(np.append(starts, m))
    if ((n_new > 0) & (n_new < n_all)).any() or (s.c0 + n_new > W).any():
        return None
    cum = np.cumsum(newi)
    o.rank = cum - (cum[starts] - newi[starts])[gid]  # of each new contribution in its slot-version (1-based)
    o.c0g = s.c0[gid]
    o.c = (o.c0g + o.rank) % W
    e = np.asarray(exp, dtype=np.int64)
    em = np.asarray(empty, dtype=bool)
    if g.idx is not None:
        e, em = e[g.idx], em[g.idx]
    e, o.em = e[g.order], em[g.order]
    # the exponent each slot-version ends the batch with: max over its new contributions (and its
    # earlier ones unless the batch starts it)
    gmax = np.maximum.reduceat(np.where(new, e, -1), starts)
    touched = n_new > 0
    o.fin = np.where(touched, np.where(s.c0 == 0, gmax, np.maximum(s.e0, gmax)), s.e0)
    return o


def _lane_work(j0: int, js: Any, g: _Groups, o: _Outcome, jj: np.ndarray, payload: Sequence[Optional[np.ndarray]],
               udp: bool, ops: Dict[Tuple[int, int, int], List[Tuple[int, Any]]]) -> None:
    """The new contributions' lane work into ``ops``, per (kind, job ``j0``, worker), in slot-version order."""
    lane = o.new & ~o.em
    if not lane.any():
        return
    W = js.W
    kind = np.where(lane, np.where((o.rank == 1) & ((o.c0g == 0) | (W == 1)), SET, ADD), NONE)
    ws = g.wk[g.order]
    for kd in (SET, ADD):
        for w in range(W):
            sel = np.flatnonzero((kind == kd) & (ws == w))
            if len(sel):
                ops.setdefault((kd, j0, w), []).extend(zip(g.vs[sel].tolist(), [payload[j] for j in jj[sel].tolist()]
                                                               if udp else [None] * len(sel)))


def _emit(j0: int, g: _Groups, o: _Outcome, done: np.ndarray, uni: np.ndarray, jj: np.ndarray,
          empty: Sequence[int], payload: Sequence[Optional[np.ndarray]], udp: bool, out: List[Any],
          reads: List[Tuple[int, int, int]]) -> None:
    """The results (completions multicast, retransmissions to a completed slot-version unicast) into
    ``out`` in arrival order, and the rows they carry into ``reads``."""
    res = np.flatnonzero(done | uni)
    if not len(res):
        return
    res = res[np.argsort(jj[res], kind="stable")]
    rj = jj[res]
    base = len(out)
    out.extend(zip(rj.tolist(), np.where(done[res], -1, g.wk[g.order][res]).tolist(), o.fin[g.gid[res]].tolist(),
                   [None] * len(res)))
    if udp:
        for n_, (j, v_) in enumerate(zip(rj.tolist(), g.vs[res].tolist())):
            if not empty[j] and payload[j] is not None:
                reads.append((base + n_, j0, v_))


def decide_batch(sw: Any, job: Sequence[int], slot: Sequence[int], ver: Sequence[int], is_result: Sequence[int],
                 worker: Sequence[int], exp: Sequence[int], empty: Sequence[int],
                 payload: Sequence[Optional[np.ndarray]], out: List[Any],
                 ops: Dict[Tuple[int, int, int], List[Tuple[int, Any]]], reads: List[Tuple[int, int, int]]) -> bool:
    """The decisions of switch ``sw``'s per-packet loop (:meth:`~.switch.SMLSwitch.batch`) as array
    operations, where no packet's decision depends on another's (module docstring). False (nothing
    changed) otherwise: the loop decides. Fills ``out``/``ops``/``reads`` as the loop does."""
    j0 = int(job[0])
    js = sw.jobs.get(j0)
    if js is None or (np.asarray(job) != j0).any():
        return False
    g = _group(js, job, slot, ver, is_result, worker)
    if g is None:
        return False
    if not g.m:
        sw.unknown += len(job)
        return True
    s = _read_state(js, g)
    o = _outcomes(js, g, s, exp, empty)
    if o is None:
        return False
    bits_new = np.bitwise_or.reduceat(np.where(o.new, o.bit, 0), g.starts)
    _write_state(s, g, s.seen0 | bits_new, s.so & ~bits_new, (s.c0 + o.n_new) % js.W, o.fin)
    st = js.stats
    done = o.new & (o.c == 0)
    uni = ~o.new & (o.c0g == 0)
    n_m, n_d, n_u = int(o.newi.sum()), int(done.sum()), int(uni.sum())
    st["merged"] += n_m
    st["complete"] += n_d
    st["result_unicast"] += n_u
    st["dropped"] += g.m - n_m - n_u
    sw.unknown += len(job) - g.m
    jj = g.order if g.idx is None else g.idx[g.order]  # each sorted packet's index in the batch
    udp = any(map(is_not, payload, repeat(None)))  # (else every packet's lanes are in shared memory)
    _lane_work(j0, js, g, o, jj, payload, udp, ops)
    _emit(j0, g, o, done, uni, jj, empty, payload, udp, out, reads)
    return True
