"""Round-based job driver shared by every aggregation scheme in the simulator.

A job has ``W`` worker endpoints (ATP workers, SwitchML workers, ring members), each an
event-driven object with ``start(tensor, base_seq, now)``, ``on_packet(p, now)``,
``poll(now)``, ``next_deadline()``, ``done`` and ``result_tensor``. The driver feeds every
worker one integer tensor per round (seeded, within the quantization headroom bound),
runs ``rounds`` rounds separated by ``compute_time`` (the *off* phase), checks every
worker's result against the exact int64 sum, arms retransmission timers and records
per-round times and an optional goodput timeline.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np


class RoundJob:
    #: subclasses set these in __init__ before calling :meth:`_begin`
    workers: List[Any]
    worker_hosts: List[int]

    def __init__(self, job: int, fabric: Any, tensor_elems: int, rounds: int, compute_time: float,
                 start_time: float, seed: int, bound: int, constant: Optional[int],
                 on_finish: Optional[Callable[[Any], None]], timeline_bin: Optional[float] = None) -> None:
        self.job_id = job
        self.fab = fabric
        self.eng = fabric.eng
        self.tensor_elems = tensor_elems
        self.rounds = rounds
        self.compute_time = compute_time
        self.start_time = start_time
        self.bound = bound
        self.constant = constant
        self.on_finish = on_finish
        self.rng = np.random.default_rng(seed + 7919 * job)
        self.tensors: Dict[int, np.ndarray] = {}
        self.expected: Dict[int, np.ndarray] = {}
        self.mismatches = 0
        self.checked = 0
        self.round_start: Dict[int, float] = {}
        self.round_end: Dict[int, float] = {}
        self.worker_done_count: Dict[int, int] = {}
        self.finished = False
        self.t_finish: Optional[float] = None
        self.timeline_bin = timeline_bin
        self.timeline: Dict[int, int] = {}  # bin -> result bytes received by worker 0
        self.seq_per_round = 0

    def _begin(self, seq_per_round: int) -> None:
        W = len(self.workers)
        self.seq_per_round = seq_per_round
        self.round = [0] * W
        self.armed: List[Optional[float]] = [None] * W
        if self.rounds:  # the first round's input is drawn at set-up, not inside the event loop
            self._tensors(0)
        for w in range(W):
            self.eng.at(self.start_time, self._start_round, w)

    # ----------------------------------------------------------------------- glue
    def handler(self, w: int) -> Callable[[Any], None]:
        """The receive callback of worker ``w``'s host (fast path of :meth:`deliver`)."""
        wk = self.workers[w]
        send = self.fab.hosts[self.worker_hosts[w]].uplink.send
        eng = self.eng
        on_packet = wk.on_packet
        if self.timeline_bin is not None and w == 0:
            return lambda p: self.deliver(w, p)

        def handle(p: Any) -> None:
            was_done = wk.done
            for q in on_packet(p, eng.now):
                send(q)
            if wk.done and not was_done:
                self._worker_finished(w)
            else:
                a = self.armed[w]
                reo = wk.reo_deadline
                if a is None or (reo is not None and reo < a):
                    self._arm(w)
        return handle

    def deliver(self, w: int, p: Any) -> None:
        """A packet for worker ``w`` arrived at its host."""
        wk = self.workers[w]
        was_done = wk.done
        host = self.fab.hosts[self.worker_hosts[w]]
        before = wk.delivered_bytes
        outs = wk.on_packet(p, self.eng.now)
        for q in outs:
            host.send(q)
        if self.timeline_bin is not None and w == 0:
            b = int(self.eng.now / self.timeline_bin)
            self.timeline[b] = self.timeline.get(b, 0) + wk.delivered_bytes - before
        if wk.done and not was_done:
            self._worker_finished(w)
        else:
            self._arm(w)

    def _arm(self, w: int) -> None:
        # retransmission deadlines only move later (FIFO timer list), so an armed timer is
        # never late for them; an earlier reordering deadline re-arms (the superseded
        # event is ignored when it fires). A firing timer re-arms for the next deadline.
        d = self.workers[w].next_deadline()
        if d is None:
            return
        a = self.armed[w]
        if a is not None and a <= d:
            return
        self.armed[w] = d
        self.eng.at(d, self._timer, w, d)

    def _timer(self, w: int, d: float) -> None:
        if self.armed[w] != d:
            return
        self.armed[w] = None
        wk = self.workers[w]
        if wk.done:
            return
        host = self.fab.hosts[self.worker_hosts[w]]
        for q in wk.poll(self.eng.now):
            host.send(q)
        self._arm(w)

    # ----------------------------------------------------------------------- rounds
    def _tensors(self, r: int) -> np.ndarray:
        t = self.tensors.get(r)
        if t is None:
            W = len(self.workers)
            if self.constant is not None:
                t64 = np.full((W, self.tensor_elems), self.constant, dtype=np.int64)
            else:
                b = self.bound
                t64 = self.rng.integers(-b, b, size=(W, self.tensor_elems), endpoint=True, dtype=np.int64)
            t = self.tensors[r] = t64.astype(np.int32)
            self.expected[r] = t64.sum(axis=0)
            self.worker_done_count[r] = 0
        return t

    def _start_round(self, w: int) -> None:
        r = self.round[w]
        t = self._tensors(r)
        now = self.eng.now
        self.round_start.setdefault(r, now)
        host = self.fab.hosts[self.worker_hosts[w]]
        for q in self.workers[w].start(t[w], r * self.seq_per_round, now):
            host.send(q)
        self._arm(w)

    def _worker_finished(self, w: int) -> None:
        r = self.round[w]
        wk = self.workers[w]
        self.checked += 1
        if not np.array_equal(wk.result_tensor, self.expected[r]):  # (int32 vs int64: exact)
            self.mismatches += 1
        self.worker_done_count[r] += 1
        self.armed[w] = None
        if self.worker_done_count[r] == len(self.workers):
            self.round_end[r] = self.eng.now
            del self.tensors[r]
            del self.expected[r]
        self.round[w] = r + 1
        if r + 1 < self.rounds:
            self.eng.after(self.compute_time, self._start_round, w)
        elif all(x >= self.rounds for x in self.round):
            self.finished = True
            self.t_finish = self.eng.now
            if self.on_finish:
                self.on_finish(self)

    # ----------------------------------------------------------------------- metrics
    @property
    def tensor_bytes(self) -> int:
        return 4 * self.tensor_elems

    def throughput_gbps(self, skip: int = 0) -> float:
        """Per-worker goodput: tensor bits aggregated per second over rounds ``skip…``
        (compute phases included, i.e. application throughput)."""
        rs = [r for r in sorted(self.round_end) if r >= skip]
        if not rs:
            return 0.0
        t0 = self.round_start[rs[0]]
        t1 = self.round_end[rs[-1]]
        return len(rs) * self.tensor_bytes * 8 / (t1 - t0) / 1e9 if t1 > t0 else 0.0

    def iterations_per_s(self, skip: int = 1) -> float:
        """Rounds (training iterations) completed per second over rounds ``skip…``."""
        rs = [r for r in sorted(self.round_end) if r >= skip]
        if not rs:
            return 0.0
        t0 = self.round_start[rs[0]]
        t1 = self.round_end[rs[-1]]
        return len(rs) / (t1 - t0) if t1 > t0 else 0.0

    def worker_stats(self) -> Dict[str, int]:
        tot: Dict[str, int] = {}
        for wk in self.workers:
            for k, v in wk.stats.as_dict().items():
                tot[k] = tot.get(k, 0) + v
        return tot
