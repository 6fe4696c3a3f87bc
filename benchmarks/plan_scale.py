"""How long planning takes as the world grows.

    python -m benchmarks.plan_scale [--out outputs/benchmarks/plan_scale.json]

Two tables. **The whole layout** (:func:`atp_pipeline.planning.layout.search`, what ``mesh=auto``
runs): Llama-3-8B (``conf/model/llama3_8b.yaml``, read by its family adapter) on IC5-like
topologies (every H100-80GB on one 900 GB/s switch, the device's datasheet compute) of 8 to
65,536 devices, a global batch of one sequence per 8 devices; every layout dp x d1 x d2 x FSDP x
chunks enumerated, the runnable ones priced by the step-time model and checked against memory,
one chosen. The bars: 256 devices in under 1 s, 65,536 in under 10 s. **The 2D mesh alone**
(``make_plan``, one replica over every device): model M4 on one-level switches and on clusters of
8-GPU nodes, 1,024 to 65,536 devices. Each row: the median wall time over repeats (and the CPU
time, which a loaded host does not inflate).
"""

from __future__ import annotations

import argparse
import json
import os
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


def llama_shape() -> ModelShape:
    """Llama-3-8B's shape from its config, as ``train.py model=llama3_8b`` reads it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from atp_pipeline.config import register_mesh_source, register_schemas
    from atp_pipeline.config.schema import typed
    from atp_pipeline.run.resolve import model_shape

    register_schemas()
    register_mesh_source()
    GlobalHydra.instance().clear()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        cfg = compose(config_name="config", overrides=["model=llama3_8b"])
    GlobalHydra.instance().clear()
    return model_shape(typed(cfg))


def bench_layouts(sizes: List[int], repeats: int) -> List[Dict[str, Any]]:
    from atp_pipeline.planning.layout import Space, search

    base = llama_shape()
    planner = PlannerConfig()
    rows = []
    print(f"whole layout, {base.name} (seq {base.seq_len}), one switch of H100-80GB, global batch devices/8:")
    print(f"{'devices':>7} {'layouts':>8} {'priced':>7} {'chosen':<34} {'median s':>9} {'CPU s':>7}")
    for n in sizes:
        cfg = switched(n, 900, name="ic5")
        cfg["device"] = {"name": "H100-80GB", "memory_GB": 80, "peak_TFLOPs": 989}
        topo = Topology.from_config(cfg)
        shape = base.with_step(batch_size=max(1, n // 8))
        walls, cpus = [], []
        plan = None
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                plan = search(topo, shape, planner, Space())
            except Exception as exc:  # noqa: BLE001 - a size no layout fits is reported, not fatal
                plan = exc
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        ok = not isinstance(plan, Exception)
        chosen = plan.whole_layout.label if ok else f"none: {str(plan)[:60]}"  # type: ignore[union-attr]
        layouts = len(plan.layouts) if ok else 0  # type: ignore[union-attr]
        priced = sum(c.step is not None for c in plan.layouts) if ok else 0  # type: ignore[union-attr]
        rows.append({"devices": n, "model": base.name, "global_batch": shape.batch_size, "layouts": layouts,
                     "priced": priced, "chosen": chosen if ok else None,
                     "median_s": statistics.median(walls), "cpu_median_s": statistics.median(cpus),
                     "repeats": repeats})
        print(f"{n:>7} {layouts:>8} {priced:>7} {chosen:<34} {statistics.median(walls):>9.3f} "
              f"{statistics.median(cpus):>7.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/benchmarks/plan_scale.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layouts = bench_layouts([2**k for k in range(3, 17)], args.repeats)
    rows = bench([1024, 4096, 16384, 65536], args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "python": platform.python_version(), "cpus": os.cpu_count(),
                               "load_average": os.getloadavg()[0], "whole_layout": layouts, "results": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
