"""Calibrated alpha-beta model on this machine: fit quality and strategy ranking (AutoDDL §3.2–§3.3, Figure 4).

    python -m benchmarks.sbp_calibration [--world 4] [--out outputs/benchmarks/sbp_calibration]

1. **Calibration** (:mod:`atp_pipeline.run.calibrate`, one launch of ``--world`` gloo
   processes): the four collectives over every group layout and message size, α/β fitted
   per level by least squares (:mod:`atp_pipeline.planning.alphabeta_fit`); criterion:
   held-out median relative error ≤ 25 %. Writes the topology
   ``<out>/conf/topology/<name>.yaml`` and loads it back through
   :meth:`Topology.from_config` and :meth:`AlphaBeta.from_topology` — the path
   ``topology=<name>`` takes.
2. **Strategy ranking** (a second launch): one transformer layer (QKV, output projection,
   FC1, FC2; :func:`~atp_pipeline.planning.sbp.space.transformer`) on the same processes;
   ``--strategies`` SBP strategies — data parallel, Megatron, the 2-D hybrid and further
   ones evenly spaced over the predicted-cost ranking of all legal assignments. Each
   strategy's exact collective schedule (:func:`~atp_pipeline.planning.sbp.schedule.schedule`,
   equal to the cost model term by term) runs on the matching sub-groups of the device
   mesh; predicted vs measured communication time, criterion: Spearman ≥ 0.8.

Writes ``calibration.json``, ``<name>_points.csv``, ``<name>_fit.png`` (predicted vs
measured per collective point), ``strategies.csv``, ``strategies.png`` (the paper's
Figure 4: strategies ordered by measured time, both curves) and ``summary.json``.
Timings on a shared 2-core machine are noisy; both launches use warm-up, interleaved
passes and medians.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import platform
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from atp_pipeline.planning import alphabeta_fit as cal
from atp_pipeline.planning.lstsq import spearman
from atp_pipeline.planning.sbp import AlphaBeta, MemoryModel, compile_problem, transformer
from atp_pipeline.planning.sbp.schedule import schedule
from atp_pipeline.planning.sbp.space import Problem
from atp_pipeline.run import calibrate as run_cal
from atp_pipeline.topology.model import Topology

ACT_BYTES = 4.0  # float32 activations, as the measurement buffers


def named_assignments(problem: Problem) -> Dict[str, Tuple[int, ...]]:
    """Data parallel, Megatron (column QKV/FC1, row projection/FC2) and the 2-D hybrid
    ``(dp=2) x Megatron`` where legal (order ``(b, m, n)``)."""
    p = problem.p

    def pick(sizes: Dict[str, Tuple[int, int, int]]) -> Optional[Tuple[int, ...]]:
        out = []
        for v in problem.vars:
            want = sizes[v.name]
            idx = [i for i, s in enumerate(v.strategies) if (s.pb, s.pm, s.pn) == want]
            if not idx:
                return None
            out.append(idx[0])
        return tuple(out)

    col, row = (1, p, 1), (1, 1, p)
    cands = {"data parallel": {k: (p, 1, 1) for k in ("qkv", "proj", "fc1", "fc2")},
             "Megatron": {"qkv": col, "proj": row, "fc1": col, "fc2": row}}
    if p % 2 == 0 and p > 2:
        h = p // 2
        cands["dp2 x Megatron"] = {"qkv": (2, h, 1), "proj": (2, 1, h), "fc1": (2, h, 1),
                                   "fc2": (2, 1, h)}
    out = {}
    for name, sizes in cands.items():
        a = pick(sizes)
        if a is not None:
            out[name] = a
    return out


def choose_strategies(problem: Problem, count: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """The named strategies plus evenly spaced ones over the predicted-cost ranking of all
    assignments (chosen by prediction only, before anything is measured)."""
    every = list(itertools.product(*[range(k) for k in problem.sizes]))
    every.sort(key=lambda a: problem.raw_cost(a))
    chosen = list(named_assignments(problem).items())[:count]
    seen = {a for _, a in chosen}
    want = count - len(chosen)
    for num in range(want, len(every) + 1):  # widen the grid until enough distinct ones
        grid = [every[int(i)] for i in np.linspace(0, len(every) - 1, num=num).round().astype(int)]
        fresh = list(dict.fromkeys(a for a in grid if a not in seen))
        if len(fresh) >= want or num == len(every):
            break
    chosen += [("", a) for a in fresh[:want]]
    return chosen


def label(problem: Problem, a: Sequence[int]) -> str:
    return " ".join(f"{v.name}:{v.strategies[i].pb}/{v.strategies[i].pm}/{v.strategies[i].pn}"
                    for v, i in zip(problem.vars, a))


def plot_strategies(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: -r["measured_s"])
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    ax.plot(x, [r["measured_s"] * 1e3 for r in rows], "o-", label="measured (gloo)")
    ax.plot(x, [r["predicted_s"] * 1e3 for r in rows], "s--", label="predicted (calibrated alpha-beta)")
    ax.set_xticks(x)
    ax.set_xticklabels([r["name"] or f"S{r['id']}" for r in rows], rotation=60, fontsize=7, ha="right")
    ax.set_ylabel("communication per step (ms)")
    ax.set_xlabel("strategy, by measured time (descending, as Figure 4)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(world: int, out: Path, name: str, strategies: int, hidden: int, heads: int, seq: int,
        micro_batch: int, sizes: Tuple[int, ...], passes: int, strategy_passes: int,
        seed: int = 0) -> Dict[str, Any]:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    # 1. calibration -----------------------------------------------------------------
    spec = run_cal.SweepSpec(world=world, sizes=sizes, passes=passes)
    levels = cal.level_specs(world, [world])
    res = run_cal.calibrate(spec, name, levels, seed=seed)
    cal.print_summary(res)
    topo_path = out / "conf" / "topology" / f"{name}.yaml"
    cal.write_topology(res.topology, topo_path, "# written by benchmarks.sbp_calibration\n")
    paths = cal.write_report(res, out, name)
    import yaml

    topo = Topology.from_config(yaml.safe_load(topo_path.read_text()))  # what topology=<name> loads
    ab = AlphaBeta.from_topology(topo)
    # 2. strategies of one transformer layer ----------------------------------------------
    layers = transformer(1, hidden, heads, seq, micro_batch)
    problem = compile_problem(layers, world, ab, MemoryModel(act_bytes=ACT_BYTES))
    chosen = choose_strategies(problem, strategies)
    schedules = [schedule(problem, a, layers, ACT_BYTES) for _, a in chosen]
    print(f"measuring {len(chosen)} strategies of one transformer layer (h={hidden}, heads={heads}, "
          f"tokens={seq * micro_batch}) on {world} processes ...")
    measured = run_cal.measure_schedules(world, schedules, warmup=1, passes=strategy_passes)
    rows = []
    for i, ((nm, a), sch, (m, runs)) in enumerate(zip(chosen, schedules, measured)):
        pred = problem.raw_cost(a)
        assert abs(pred - sum(c.seconds(ab) for c in sch)) <= 1e-9 * max(pred, 1e-12)
        rows.append({"id": i, "name": nm, "strategy": label(problem, a), "predicted_s": pred,
                     "measured_s": m, "runs": list(runs), "collectives": len(sch),
                     "calls": sum(c.times for c in sch),
                     "volume_bytes_per_device": problem.volume(a)})
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"  {r['name'] or 'S' + str(r['id']):<16} {r['strategy']:<40} predicted "
              f"{r['predicted_s'] * 1e3:8.2f} ms  measured {r['measured_s'] * 1e3:8.2f} ms")
    crit = "PASS" if rho >= 0.8 else "FAIL"
    print(f"Spearman(predicted, measured) over {len(rows)} strategies on {world} processes: "
          f"{rho:.3f} [{crit}: >= 0.8]")
    with (out / "strategies.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "name", "strategy", "predicted_s", "measured_s", "calls"])
        for r in rows:
            w.writerow([r["id"], r["name"], r["strategy"], f"{r['predicted_s']:.6e}",
                        f"{r['measured_s']:.6e}", r["calls"]])
    plot_strategies(rows, out / "strategies.png",
                    f"one transformer layer on {world} gloo processes: Spearman {rho:.2f} "
                    f"({len(rows)} strategies)")
    summary = {
        "machine": platform.machine(), "python": platform.python_version(), "world": world,
        "heldout_median_rel_error": res.heldout_median_error,
        "heldout_criterion_le_25pct": res.heldout_median_error <= 0.25,
        "model": "per_collective" if res.fit.use_per_collective else "single_pair",
        "spearman": rho, "spearman_criterion_ge_0_8": rho >= 0.8, "strategies": len(rows),
        "layer": {"hidden": hidden, "heads": heads, "seq": seq, "micro_batch": micro_batch},
        "topology": str(topo_path), "seconds": time.perf_counter() - t0,
    }
    (out / "calibration_strategies.json").write_text(json.dumps({"summary": summary, "strategies": rows},
                                                                indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}/ ({', '.join(p.name for p in paths.values())}, strategies.csv, strategies.png, "
          f"summary.json) in {summary['seconds']:.0f} s")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--out", default="outputs/benchmarks/sbp_calibration")
    parser.add_argument("--name", default="calib_local")
    parser.add_argument("--strategies", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--sizes", default="4K:4M")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--strategy-passes", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.world, Path(args.out), args.name, args.strategies, args.hidden, args.heads, args.seq,
        args.micro_batch, run_cal.parse_sizes(args.sizes), args.passes, args.strategy_passes, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
