"""The SwitchML switch function (SwitchML's algorithm with shadow copies; Sapio et al., NSDI'21).

:class:`SMLSwitch` is the data plane of one ToR, run by the simulator (a packet at a time) and by
the live switch role (a batch of everything it drained): each job owns a static partition of
``pool`` slots × 2 versions (:class:`SMLSwitchJob`); a slot-version sums its ``W`` workers'
contributions, keeps the max of their exponents, then multicasts the result, which is also every
worker's ACK; a retransmission for a completed slot-version gets the result by unicast. The
decisions are taken packet by packet (:meth:`SMLSwitch.batch`; for large batches with array
operations, :mod:`.batch`), the lane sums collected and done in blocks (:mod:`.lanes`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.ina.switchml.batch import decide_batch
from atp_pipeline.ina.switchml.lanes import ADD, NONE, SET, sum_lanes
from atp_pipeline.ina.switchml.wire import SMLPacket

#: batches of at least this many packets try the array form (:func:`~.batch.decide_batch`): a numpy
#: call costs microseconds, the per-packet loop about one per packet; one worker's packets at 2,048
#: values a packet (428, the live role's usual batch) cost less in array form, smaller batches less
#: in the loop
ARRAY_MIN = 400


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
        #: the same three as int64 arrays while the array form (:func:`~.batch.decide_batch`) keeps them
        #: (then the lists are stale until :attr:`seen`, :attr:`count` or :attr:`exp` is read: a run of
        #: large batches converts nothing)
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




#: one result of :meth:`SMLSwitch.batch`: (index of the packet in the batch, destination worker or
#: -1 for the job's multicast group, shared exponent, the slot's sum — a copy, or None for an
#: exponent-only or shared-memory packet)
Result = Tuple[int, int, int, Optional[np.ndarray]]


class SMLSwitch:
    """The SwitchML data plane of one ToR (SwitchML Algorithm with shadow copies).

    :meth:`batch` is the switch function, over a batch of packets in arrival order (the live
    role hands it everything it drained): the per-packet decisions are the
    algorithm's, one packet after the other, and the lanes are summed per worker in one numpy
    call each (gather, add, scatter) before any result is read. Calling the switch with one
    packet (the simulator, :meth:`__call__`) is a batch of one."""

    #: threads that sum the lanes (:func:`~.lanes.sum_lanes`): 1 (the simulator); the live role uses 2 where
    #: there are cores
    threads = 1

    def __init__(self) -> None:
        self.jobs: Dict[int, SMLSwitchJob] = {}
        self.unknown = 0
        self.sum_pool: Any = None  # the summing threads beyond the caller's (sum_lanes), started when needed
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
        kind) and done when a batch sends a result (:func:`~.lanes.sum_lanes`), before any register is
        read; a batch that sends none carries it to the next (the live role drains one worker's
        packets at a time, and the work of all of a slot-version's contributions then goes through
        the registers in one blocked pass instead of one pass per worker's batch). A
        worker's lanes of a slot-version stay as sent until its result has left (a worker rewrites
        them only after that result: the shadow copy), a datagram's payload is kept with the work,
        and registers are only read by results. A slot-version that restarts while an earlier
        use of it is still pending has the pending work done first, so the result is that of
        handling the packets one at a time (:meth:`settle` does the carried work: the registers
        then equal the per-packet form's)."""
        out: List[Result] = []
        ops = self._ops  # (kind, job, worker) -> [(slot-version, lanes or None)]: carried until a result leaves
        reads: List[Tuple[int, int, int]] = []  # (index in out, job, slot-version): rows read at the end
        if len(job) >= ARRAY_MIN and decide_batch(self, job, slot, ver, is_result, worker, exp, empty, payload,
                                                  out, ops, reads):
            if out:
                sum_lanes(self, ops, reads, out)
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
                        sum_lanes(self, ops, reads, out)
                        pending.clear()
                    kind = NONE if empty[j] else SET
                    exps[vi] = exp[j]
                else:
                    kind = NONE if empty[j] else ADD
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
            sum_lanes(self, ops, reads, out)
        return out

    def settle(self) -> None:
        """Do the lane work still carried (contributions to slot-versions no result has left yet):
        the registers then hold what the packets one at a time would have left there."""
        if self._ops:
            sum_lanes(self, self._ops, [], [])

    def drop(self, job: int) -> None:
        """Forget job ``job``'s carried lane work (its partition is being torn down)."""
        for key in [k for k in self._ops if k[1] == job]:
            del self._ops[key]
