"""e13: where a measured step's wall time goes that is neither the rank's CPU nor a collective's wait.

Runs ``benchmarks.step_validation`` unchanged, but launches its ranks through a wrapper that times
every ``dist.barrier`` of the timed loop (a step is ``barrier; step(); barrier``). Per rank, over
every step of the launch (warm-up included, all points pooled):

* ``work``: from leaving the first barrier to entering the second (the step itself);
* ``barrier``: inside the closing barrier (waiting for the slowest rank + the barrier's own cost);
* ``cpu``: the rank's process CPU (all threads) over the step, barriers included;
* ``cpu_main``: the main thread's own time on a CPU (``schedstat``'s 1st field) over the step: the rest of
  ``cpu`` is the other threads' (gloo's, the intra-op pool's);
* ``run_delay``: time the rank's threads sat runnable but not running (``/proc/<pid>/task/*/schedstat``,
  2nd field), main thread and all threads, over the same interval.

Usage (the step_validation flags; output JSON beside the benchmark's own rows)::

    python docs/step_validation/diagnosis/e13.py --models gpt2_tiny --variants 6x80 --worlds 2 \
        --out /tmp/e13 --tag e13
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def _delays() -> List[int]:
    """[main thread's run delay, all threads' run delay, main thread's time on a CPU] in ns."""
    main = all_ = on = 0
    me = os.getpid()
    for t in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{t}/schedstat") as f:
                v = f.read().split()
                d = int(v[1])
        except (OSError, ValueError, IndexError):
            continue
        all_ += d
        if int(t) == me:
            main, on = d, int(v[0])
    return [main, all_, on]


def instrumented(rank: int, world: int, spec: Dict[str, Any]) -> Any:
    import torch.distributed as dist

    from benchmarks import step_validation as sv

    real = dist.barrier
    marks: List[tuple] = []

    def barrier(*a: Any, **k: Any) -> Any:
        t_in, c_in, d_in = time.perf_counter(), time.process_time(), _delays()
        out = real(*a, **k)
        marks.append((t_in, c_in, d_in, time.perf_counter(), time.process_time(), _delays()))
        return out

    dist.barrier = barrier
    got = sv._worker(rank, world, spec)
    # a step: marks[i] (opening barrier) then marks[i+1] (closing); the timed loop alternates them, other
    # barriers (setup, hostload's rounds) are few: pair marks whose gap is a step (closing within 5 s)
    steps = []
    i = 0
    while i + 1 < len(marks):
        a, b = marks[i], marks[i + 1]
        work = b[0] - a[3]
        if 0 < work < 5.0:
            steps.append({"work": work, "barrier": b[3] - b[0], "cpu": b[4] - a[4],
                          "delay_main": (b[5][0] - a[5][0]) * 1e-9, "delay_all": (b[5][1] - a[5][1]) * 1e-9,
                          "cpu_main": (b[5][2] - a[5][2]) * 1e-9,
                          "wall": b[3] - a[3]})
            i += 2
        else:
            i += 1
    threads: Dict[str, float] = {}  # thread name -> its CPU seconds over the whole launch (setup included)
    me = os.getpid()
    for t in os.listdir(f"/proc/{me}/task"):
        try:
            name = open(f"/proc/{me}/task/{t}/comm").read().strip() + (" (main)" if int(t) == me else "")
            threads[name] = threads.get(name, 0.0) + int(open(f"/proc/{me}/task/{t}/schedstat").read().split()[0]) * 1e-9
        except (OSError, ValueError, IndexError):
            continue
    return {"got": got, "steps": steps, "threads": threads}


def main() -> int:
    import atp_pipeline.launch as launch
    from benchmarks import step_validation as sv

    real_spawn = launch.spawn
    out: List[Dict[str, Any]] = []

    def spawn(fn: Any, world: int, spec: Dict[str, Any], **kw: Any) -> Any:
        ranks = real_spawn(instrumented, world, spec, **kw)
        row: Dict[str, Any] = {"world": world, "points": len(spec["points"]), "family": spec.get("family"),
                               "batch": spec["batch"], "seq_len": spec["seq_len"], "ranks": []}
        for r, got in enumerate(ranks):
            st = got["steps"]
            tot = {k: sum(s[k] for s in st) for k in ("wall", "work", "barrier", "cpu", "cpu_main", "delay_main", "delay_all")}
            row["ranks"].append({"rank": r, "steps": len(st), **{k: round(v / tot["wall"], 4) for k, v in tot.items()},
                                 "wall_ms_per_step": round(1e3 * tot["wall"] / max(1, len(st)), 3),
                                 "thread_cpu_s": {k: round(v, 3) for k, v in sorted(got["threads"].items(), key=lambda kv: -kv[1])}})
            print(f"  rank {r}: {len(st)} steps, {row['ranks'][-1]}", flush=True)
        out.append(row)
        return [g["got"] for g in ranks]

    launch.spawn = spawn
    rc = sv.main(sys.argv[1:])
    args = sys.argv[1:]
    dest = Path(args[args.index("--out") + 1]) / f"{args[args.index('--tag') + 1]}_e13.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
