"""The four SBP search algorithms on the paper's Figure 8 setting (AutoDDL §4.6).

    python -m benchmarks.sbp_search [--out outputs/benchmarks/sbp_search.json]

A 4-layer MLP 32768-16384-4096-2048-512 (batch 4096, fp32, Adam: 16 bytes per parameter,
16 GiB per device) on 128 and 4,096 devices of a flat network (α = 5 µs, 10 GB/s, the
paper's Piz Daint class). Each algorithm runs over ``--seeds`` seeds; reported: the
worst and median cost relative to the exhaustive optimum, the median search time and its
ratio to the exhaustive search's time, and the evaluation counts. Also plans a 96-block
GPT (h=12288, 96 heads, tied blocks) on 4,096 devices and reports its wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

from atp_pipeline.planning.sbp import METHODS, AlphaBeta, MemoryModel, compile_problem, mlp, search, transformer

FIG8_DIMS = (32768, 16384, 4096, 2048, 512)
FIG8_BATCH = 4096
FIG8_MODEL = AlphaBeta.uniform(alpha=5e-6, beta=1.0 / 10e9)
FIG8_MEMORY = MemoryModel(param_bytes=16.0, act_bytes=4.0, limit=16 * 2**30)


def figure8(devices: int, seeds: int, budget_s: float) -> Dict[str, Any]:
    t0 = time.perf_counter()
    problem = compile_problem(mlp(FIG8_DIMS, FIG8_BATCH), devices, FIG8_MODEL, FIG8_MEMORY)
    compile_s = time.perf_counter() - t0
    runs = {m: [search(problem, m, budget_s, seed) for seed in range(seeds)] for m in METHODS}
    opt = min(r.cost for r in runs["exhaustive"])
    t_ex = statistics.median(r.seconds for r in runs["exhaustive"])
    rows: List[Dict[str, Any]] = []
    for m, rs in runs.items():
        rel = [r.cost / opt for r in rs]
        t = statistics.median(r.seconds for r in rs)
        rows.append({"method": m, "worst_rel_cost": max(rel),
                     "median_rel_cost": statistics.median(rel),
                     "median_s": t, "speedup_vs_exhaustive": t_ex / t,
                     "median_evaluations": statistics.median(r.evaluations for r in rs)})
        print(f"{devices:>5} devices {m:<11} cost/opt worst {max(rel):.4f}  median time "
              f"{t * 1e3:9.3f} ms  ({t_ex / t:8.1f}x faster than exhaustive)")
    best = min(runs["exhaustive"], key=lambda r: r.cost)
    return {"devices": devices, "strategies_per_layer": problem.sizes, "compile_s": compile_s,
            "optimum_s": opt, "optimal_plan": best.plan(problem), "results": rows}


def gpt96(budget_s: float) -> Dict[str, Any]:
    t0 = time.perf_counter()
    problem = compile_problem(transformer(96, 12288, 96, 2048, 256), 4096, FIG8_MODEL,
                              MemoryModel(param_bytes=16.0, act_bytes=2.0, limit=80 * 2**30))
    res = search(problem, "coordinate", budget_s, 0)
    total = time.perf_counter() - t0
    print(f"96-layer GPT on 4096 devices: planned in {total:.3f} s (cost {res.cost:.3f} s)")
    return {"planning_s": total, "search_s": res.seconds, "plan": res.plan(problem)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/benchmarks/sbp_search.json")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args()
    out = Path(args.out)
    data = {"machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "figure8": [figure8(p, args.seeds, args.budget_s) for p in (128, 4096)],
            "gpt96": gpt96(args.budget_s)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
