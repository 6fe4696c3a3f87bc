"""How long ATP's mesh search takes as the world grows.

    python -m benchmarks.plan_scale [--out outputs/benchmarks/plan_scale.json]

Plans model M4 on one-level switched topologies (every device on one switch) and on
two-level clusters of 8-GPU nodes, from 1,024 to 65,536 devices, and reports the median
wall time of ``make_plan`` over repeats (all candidates costed, the selection made). The
bar it is held to: a 65,536-device one-level topology plans in under one second.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

from atp_pipeline.config.schema import DType, MeshConfig, ModelConfig, PlannerConfig
from atp_pipeline.planning.search import make_plan
from atp_pipeline.planning.shape import ModelShape
from atp_pipeline.topology.builders import nodes, switched
from atp_pipeline.topology.model import Topology


def bench(sizes: List[int], repeats: int) -> List[Dict[str, Any]]:
    model = ModelShape.of(ModelConfig(name="m4", hidden=12288, heads=96, layers=96,
                                        dtype=DType.fp16))
    planner = PlannerConfig(require_divisible=False)
    rows = []
    for n in sizes:
        for kind, cfg in (("one-level switch", switched(n, 900)),
                          ("8-GPU nodes", nodes(n // 8, 8, 50, 300, 600))):
            topo = Topology.from_config(cfg)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = make_plan(topo, model, MeshConfig(), planner)
                times.append(time.perf_counter() - t0)
            rows.append({"devices": n, "topology": kind, "candidates": len(plan.candidates),
                         "selected": list(plan.selected), "median_s": statistics.median(times),
                         "min_s": min(times), "repeats": repeats})
            print(f"{n:>6} devices, {kind:<16}: {len(plan.candidates):>2} meshes, "
                  f"median {statistics.median(times) * 1e3:8.1f} ms, selected {plan.selected}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/benchmarks/plan_scale.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = bench([1024, 4096, 16384, 65536], args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "python": platform.python_version(), "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
