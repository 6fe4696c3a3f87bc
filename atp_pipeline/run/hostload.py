"""Measuring on a shared host: how much CPU *other* processes took while ranks were timed.

On a machine shared with other jobs (this project's 2-core dev machine, a CI runner) a
timing taken while another job ran can be 2-3x the quiet one, and no median over a few
passes removes that when the other job runs for seconds. So the calibration
(:mod:`atp_pipeline.run.calibrate_compute`) and the step validation
(``benchmarks/step_validation.py``) time in *rounds* and check each round: the host's busy
CPU time over the round (``/proc/stat``: user, nice, system, irq, softirq and steal — a
hypervisor's other guests included) minus the CPU time of the ranks themselves
(``time.process_time`` of every rank, gathered) is the foreign load, in cores. A round with
more than :data:`QUIET_CORES` of foreign load is measured again, up to ``retries`` times; what
each kept round saw is recorded. Before a launch the parent waits a while for a quiet host
(:func:`wait_quiet`). Without ``/proc/stat`` (not Linux) every round
counts as quiet.
"""

from __future__ import annotations

import os
import time
from typing import List, Optional, Tuple

QUIET_CORES = 0.25  # foreign load (cores) above which a round is measured again


def host_busy_s() -> Optional[float]:
    """Busy CPU seconds of the whole host since boot (``/proc/stat``), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Round:
    """One timed round on every rank: ``start()`` then ``foreign()`` (a collective: every rank
    calls it), the other processes' CPU over the round in cores, the same on every rank."""

    def start(self) -> None:
        self.t0, self.cpu0, self.busy0 = time.perf_counter(), time.process_time(), host_busy_s()

    def foreign(self) -> float:
        import torch
        import torch.distributed as dist

        wall = time.perf_counter() - self.t0
        mine = torch.tensor([time.process_time() - self.cpu0], dtype=torch.float64)
        dist.all_reduce(mine)  # the ranks' own CPU seconds
        busy = host_busy_s()
        verdict = torch.tensor([0.0 if busy is None or self.busy0 is None or wall <= 0
                                else max(0.0, (busy - self.busy0 - float(mine)) / wall)], dtype=torch.float64)
        dist.broadcast(verdict, 0)  # rank 0's reading decides for all
        return float(verdict)


def wait_quiet(max_s: float = 60.0, threshold: float = QUIET_CORES, window_s: float = 2.0) -> float:
    """Before a launch (from the parent, its own processes idle): wait until the host's busy
    CPU over a ``window_s`` window is at most ``threshold`` cores, at most ``max_s`` seconds;
    returns the last window's load (cores). ``max_s <= 0``: no wait at all (0 returned)."""
    if max_s <= 0:
        return 0.0
    t_end = time.perf_counter() + max_s
    while True:
        b0, t0 = host_busy_s(), time.perf_counter()
        time.sleep(window_s)
        b1 = host_busy_s()
        load = 0.0 if b0 is None or b1 is None else (b1 - b0) / (time.perf_counter() - t0)
        if load <= threshold or time.perf_counter() >= t_end:
            return load


def quiet_rounds(wanted: int, retries: int, run_round,
                 threshold: float = QUIET_CORES) -> Tuple[List[object], List[float]]:
    """Run ``run_round()`` (every rank, collectively) until ``wanted`` rounds had at most
    ``threshold`` cores of foreign load or ``wanted + retries`` rounds ran (the least loaded
    are then kept); returns the kept rounds' results and their foreign loads."""
    done: List[Tuple[float, int, object]] = []
    r = Round()
    for i in range(wanted + retries):
        r.start()
        res = run_round(i)
        done.append((r.foreign(), i, res))
        if sum(f <= threshold for f, _, _ in done) >= wanted:
            break
    kept = sorted(sorted(done, key=lambda x: x[0])[:wanted], key=lambda x: x[1])
    return [res for _, _, res in kept], [f for f, _, _ in kept]
