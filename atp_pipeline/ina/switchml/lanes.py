"""The SwitchML switch's lane work: the int32 sums of the contributions into a job's registers.

The switch function (:meth:`~.switch.SMLSwitch.batch`) decides packet by packet and collects the
lane work per (kind, job, worker): a slot-version's first contribution sets its row (``SET``), the
others add (``ADD``), an exponent-only packet has none (``NONE``). :func:`sum_lanes` does the
collected work block by block through the cache, before any result's row is read: integer sums
are exact, so the registers hold the same bits as summing one packet at a time."""

from __future__ import annotations

from itertools import repeat
from operator import is_
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from atp_pipeline.ina.switchml.ranges import runs

NONE, SET, ADD = 0, 1, 2  # lane work of a contribution (SMLSwitch.batch)
SUM_BLOCK = 1 << 17  # register values the switch sums per block (512 KiB of int32: in L2)
SUM_CALLS = 16  # (above 4x this many calls per job: one pass per call, no blocks)
SUM_SPLIT_MIN = 1 << 18  # register values from which a switch with threads > 1 sums two halves at once


def sum_lanes(sw: Any, ops: Dict[Tuple[int, int, int], List[Tuple[int, Optional[np.ndarray]]]],
              reads: List[Tuple[int, int, int]], out: List[Any]) -> None:
    """Switch ``sw``'s (:class:`~.switch.SMLSwitch`) pending lane work ``ops`` (per (kind, job,
    worker): ``[(slot-version, lanes or None)]``), then the rows of the results ``reads`` names
    (``(index in out, job, slot-version)``, copied into ``out``); both emptied.

    First contributions (the contributor's lanes), then the other contributions added — per (job,
    worker) one numpy call per run of consecutive slot-versions (a worker contributes once to a
    slot-version between two restarts) —, then the rows of the results that carry lanes (copies).
    The calls go block by block over the registers (:data:`SUM_BLOCK` values a block, in cache),
    each block taking every call's rows in it in the same order: the contributions meet a register
    row while it is in cache instead of one pass over the registers per worker."""
    prims: Dict[int, List[Tuple[int, int, int, np.ndarray]]] = {}  # job -> [(kind, first row, rows, source)]
    for key in (sorted(ops) if len(ops) > 1 else ops):  # SET before ADD
        kind, job, w = key
        items = ops[key]
        js = sw.jobs.get(job)
        if js is None:  # (torn down: :meth:`SMLSwitch.drop`)
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
        for a, b in runs(vis):  # a run of consecutive slot-versions: one call over slices
            v0, m = vis[a], b - a
            src = lanes[v0:v0 + m] if lanes is not None else np.stack([x for _, x in items[a:b]])
            todo.append((kind, v0, m, src))
    for job, todo in prims.items():
        vals = sw.jobs[job].flat
        step = max(1, SUM_BLOCK // vals.shape[1])
        lo, hi = min(t[1] for t in todo), max(t[1] + t[2] for t in todo)
        if len(todo) == 1 or len(todo) > 4 * SUM_CALLS or hi - lo <= step:
            step = hi - lo  # one block
        if sw.threads > 1 and (hi - lo) * vals.shape[1] >= SUM_SPLIT_MIN and hi - lo > 1:
            # two halves of the rows at once (numpy lets the GIL go): the live role sums when every
            # worker waits for the results, so a second core is free
            mid = lo + max(1, (hi - lo) // 2 // step) * step if hi - lo > step else lo + (hi - lo) // 2
            if sw.sum_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                sw.sum_pool = ThreadPoolExecutor(max_workers=sw.threads - 1, thread_name_prefix="sml-sum")
            half = sw.sum_pool.submit(apply_lanes, todo, vals, mid, hi, step)
            apply_lanes(todo, vals, lo, mid, step)
            half.result()
        else:
            apply_lanes(todo, vals, lo, hi, step)
    for o, job, vi in reads:
        j, dst_, e, _ = out[o]
        out[o] = (j, dst_, e, sw.jobs[job].flat[vi].copy())
    ops.clear()
    reads.clear()


def apply_lanes(todo: List[Tuple[int, int, int, np.ndarray]], vals: np.ndarray, lo: int, hi: int, step: int) -> None:
    """The lane work ``todo`` (:func:`sum_lanes`) on register rows ``[lo, hi)``, ``step`` rows a
    block, every call's rows of a block in ``todo``'s order — except that a first contribution and
    the first other contribution over the same rows of a block are one call, ``rows = a + b``
    (a copy of the first lanes would cost a pass over the block; integer sums are
    exact and every ``SET`` of a row precedes its ``ADD`` calls in ``todo`` — sorted by kind, and a
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
            if kind != SET:
                np.add(dst, src, out=dst)
                continue
            for j in range(i + 1, len(ops)):
                if j not in fused and ops[j][0] == ADD and ops[j][1] == a and ops[j][2] == b:
                    np.add(src, ops[j][3], out=dst)
                    fused.add(j)
                    break
            else:
                dst[...] = src
