"""Validate the step-time model: predicted vs measured step time over a grid (issue 15).

    python -m benchmarks.step_validation --topology cpu4c --models tiny,small
    python -m benchmarks.step_validation --topology cpu4c --models llama_tiny --chunks 1 --tag llama

Run from the repository root. ``--topology`` is a topology with a compute profile
(``device.compute``, :mod:`atp_pipeline.run.calibrate_compute`) and, for gloo's collectives,
a fitted ``alpha_beta`` (:mod:`atp_pipeline.run.calibrate`): a config name under
``conf/topology`` or ``outputs/conf/topology``, or a YAML path. Calibration and validation
are separate runs: this command measures steps only.

**Grid.** Every model of ``--models`` × mesh of ``--meshes`` × chunk count of ``--chunks``
(those the model runs: a model laid out module by module has no chunked execution) × two
interconnects: no emulation (gloo as it is) and the emulated ``--emulate`` topology
(default ``ic1``, restricted to ``--world`` devices, collectives stretched ``--slowdown``
times, :mod:`atp_pipeline.parallel.emulation`).

**Measure.** One launch of ``--world`` gloo processes per model builds every point's
parallel model from the same dense one (the family's own plan,
:func:`atp_pipeline.parallel.apply.apply_plan`) with AdamW, as training does; a step is
forward + backward + optimizer step between two barriers. Every point first runs
``--warmup`` untimed steps; then ``--repeats`` rounds interleave the points (a rotated
order each round), each round timing ``--steps`` steps per point; a point's time is the
median of all its timed steps (rank 0's clock between barriers).

**Predict.** :func:`atp_pipeline.planning.steptime.estimate_step` for the same shape, mesh,
chunks and interconnect, from the topology's calibration.

**Report** (``--out``): ``<tag>.json`` and ``<tag>.csv`` (every point predicted vs measured,
with the prediction's compute / exposed-communication split), ``<tag>.png`` (scatter,
log-log, with the y = x line), and the figures: median and worst relative error,
Spearman's ρ over all points, and per group (one model × one interconnect) whether the
predicted best point (mesh and chunks) is the measured best.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

CONF = Path("conf")


def _worker(rank: int, world: int, spec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from atp_pipeline.lightning.module import adamw
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import comm_for, init_mesh
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.emulation import TopologyEmulator
    from atp_pipeline.topology.model import Topology

    adapter = get_adapter(spec["family"])
    torch.manual_seed(0)
    dense = adapter.build(spec["model_config"])
    g = torch.Generator().manual_seed(0)
    b, s, V = spec["batch"], spec["seq_len"], spec["vocab"]
    idx = torch.randint(0, V, (b, s), generator=g)
    tgt = torch.randint(0, V, (b, s), generator=g)
    emu_topo = Topology.from_config(spec["emulate"]) if spec["emulate"] else None
    runners: List[Tuple[str, Any, Any]] = []
    for key in spec["points"]:
        d1, d2, chunks, emulated = key
        mesh = init_mesh((d1, d2))
        model = copy.deepcopy(dense)
        apply_plan(model, adapter.parallel_plan(model), mesh, chunks)
        comm_for(mesh, TopologyEmulator(emu_topo, (d1, d2), spec["slowdown"]) if emulated else None)
        opt = adamw(model.parameters(), lr=1e-4)  # training's optimizer (foreach AdamW)
        runners.append((json.dumps(key), model, opt, comm_for(mesh)))

    def step(model: Any, opt: Any) -> None:
        loss = adapter.lm_loss(model, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(model: Any, opt: Any, n: int) -> List[float]:
        out = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            step(model, opt)
            dist.barrier()
            out.append(time.perf_counter() - t0)
        return out

    for _, model, opt, _ in runners:
        timed(model, opt, spec["warmup"])
    times: Dict[str, List[float]] = {k: [] for k, _, _, _ in runners}
    waits: Dict[str, List[float]] = {k: [] for k, _, _, _ in runners}
    for r in range(spec["repeats"]):
        order = runners[r % len(runners):] + runners[:r % len(runners)]
        for k, model, opt, comm in order:
            comm.stats.reset()
            times[k] += timed(model, opt, spec["steps"])
            waits[k].append(sum(c.wait_s for c in comm.stats.totals.values()) / spec["steps"])
    return {"times": times, "waits": waits} if rank == 0 else None


def _loadavg() -> Optional[List[float]]:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _load_topology(ref: str, conf: Path) -> Any:
    from atp_pipeline.run.calibrate_compute import load_topology_yaml
    from atp_pipeline.topology.model import Topology

    data, _ = load_topology_yaml(ref, conf)
    return Topology.from_config(data)


def rel_error(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Median / worst relative error, Spearman's ρ, and predicted-best = measured-best per group."""
    from atp_pipeline.planning.calibrate import spearman

    errs = [r["rel_error"] for r in rows]
    groups: Dict[str, Dict[str, Any]] = {}
    for key in sorted({(r["model"], r["interconnect"]) for r in rows}):
        pts = [r for r in rows if (r["model"], r["interconnect"]) == key]
        pb = min(pts, key=lambda r: r["predicted_s"])
        mb = min(pts, key=lambda r: r["measured_s"])
        second = sorted(p["measured_s"] for p in pts)[1] if len(pts) > 1 else mb["measured_s"]
        groups[f"{key[0]} / {key[1]}"] = {
            "predicted_best": pb["point"], "measured_best": mb["point"], "agree": pb["point"] == mb["point"],
            "measured_margin": second / mb["measured_s"] - 1,
            "spearman": spearman([p["predicted_s"] for p in pts], [p["measured_s"] for p in pts])
            if len(pts) > 1 else None}
    return {"points": len(rows), "median_rel_error": statistics.median(errs), "worst_rel_error": max(errs),
            "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "groups": groups, "best_agrees_in_every_group": all(g["agree"] for g in groups.values())}


def plot(rows: List[Dict[str, Any]], summary: Dict[str, Any], path: Path, title: str) -> None:
    from atp_pipeline.figures import axes

    with axes(path, (6.0, 5.0)) as ax:
        marks = {1: "o", 2: "s", 4: "^"}
        for key in sorted({(r["model"], r["interconnect"]) for r in rows}):
            for chunks in sorted({r["chunks"] for r in rows}):
                pts = [r for r in rows if (r["model"], r["interconnect"]) == key and r["chunks"] == chunks]
                if pts:
                    ax.scatter([p["measured_s"] * 1e3 for p in pts], [p["predicted_s"] * 1e3 for p in pts],
                               marker=marks.get(chunks, "D"), s=30, label=f"{key[0]}, {key[1]}, chunks {chunks}")
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.3
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.3
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="y = x")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.15,
                        label="±10 %")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured step (ms, median)")
        ax.set_ylabel("predicted step (ms)")
        ax.set_title(f"{title}\nmedian error {summary['median_rel_error']:.1%}, worst "
                     f"{summary['worst_rel_error']:.1%}, Spearman {summary['spearman']:.3f}", fontsize=9)
        ax.legend(fontsize=6)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_validation", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="calibrated topology (name or YAML path) of --world devices")
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--meshes", default="4x1,2x2,1x4")
    p.add_argument("--chunks", default="1,2")
    p.add_argument("--emulate", default="ic1", help="topology of the emulated interconnect ('' for none)")
    p.add_argument("--slowdown", type=float, default=3000.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--tag", default="gpt")
    p.add_argument("--out", default="outputs/benchmarks/step_validation")
    p.add_argument("--conf", type=Path, default=CONF)
    args = p.parse_args(argv)
    from atp_pipeline.cli import EXIT_BAD_INPUT
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.launch import spawn
    from atp_pipeline.planning.search import mesh_infeasibility
    from atp_pipeline.planning.steptime import RUNTIME, StepSetting, estimate_step, profile_of
    from atp_pipeline.run.calibrate_compute import model_shapes, model_spec

    try:
        topo = _load_topology(args.topology, args.conf)
        if topo.world_size != args.world:
            raise ConfigError(f"step_validation: topology '{topo.name}' has {topo.world_size} devices, "
                              f"--world is {args.world}")
        profile = profile_of(topo)
        if profile is None:
            raise ConfigError(f"step_validation: topology '{topo.name}' has no compute profile (device.compute; "
                              f"python -m atp_pipeline.run.calibrate_compute) and no peak_TFLOPs")
        emu = _load_topology(args.emulate, args.conf).restrict(args.world) if args.emulate else None
        meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
        chunk_list = [int(c) for c in args.chunks.split(",")]
        names = [m for m in args.models.split(",") if m]
        shapes = model_shapes(names, args.conf)
        if any(d1 * d2 != args.world for d1, d2 in meshes):
            raise ConfigError(f"step_validation: --meshes {args.meshes} must each have {args.world} devices")
        if args.steps < 1 or args.repeats < 1 or args.warmup < 0 or not args.slowdown > 0:
            raise ConfigError("step_validation: --steps, --repeats >= 1, --warmup >= 0, --slowdown > 0")
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_BAD_INPUT
    rows: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    load_start = _loadavg()
    for name, shape in zip(names, shapes):
        points = [(d1, d2, c, e) for e in ([False, True] if emu is not None else [False])
                  for (d1, d2) in meshes for c in chunk_list
                  if mesh_infeasibility(shape, (d1, d2)) is None
                  and shape.batch_size % c == 0]
        spec = {**model_spec(name, shape, args.conf), "points": points,
                "emulate": emu.to_dict() if emu is not None else None, "slowdown": args.slowdown,
                "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}
        print(f"{name}: measuring {len(points)} points on {args.world} processes ...", flush=True)
        got = spawn(_worker, args.world, spec, timeout=3600)[0]
        times, waits = got["times"], got["waits"]
        for d1, d2, c, e in points:
            est = estimate_step(topo, shape, (d1, d2), StepSetting(chunks=c), profile,
                                emulated=(emu, args.slowdown) if e else None)
            meas = statistics.median(times[json.dumps([d1, d2, c, e])])
            rows.append({"model": name, "interconnect": f"emulated {emu.name} x{args.slowdown:g}" if e else "gloo",
                         "mesh": f"{d1}x{d2}", "chunks": c, "point": f"{d1}x{d2}/c{c}",
                         "measured_s": meas, "predicted_s": est.step_s, "rel_error": rel_error(est.step_s, meas),
                         "predicted_compute_s": est.compute_s, "predicted_exposed_comm_s": est.exposed_comm_s,
                         "predicted_total_comm_s": est.total_comm_s, "predicted_dispatch_s": est.dispatch_s,
                         "predicted_optimizer_s": est.optimizer_s, "predicted_sync_s": est.sync_s,
                         "samples": len(times[json.dumps([d1, d2, c, e])]),
                         "measured_comm_wait_s": statistics.median(waits[json.dumps([d1, d2, c, e])])})
    summary = summarize(rows)
    meta = {"topology": topo.name, "profile": profile.name, "profile_source": profile.source,
            "calibration": {n: profile.describe(RUNTIME) for n, sh in zip(names, shapes)},
            "load_average": {"start": load_start, "end": _loadavg()},
            "world": args.world, "emulate": args.emulate, "slowdown": args.slowdown, "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=2) + "\n")
    with (out / f"{args.tag}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, summary, out / f"{args.tag}.png", f"step-time model vs measured: {', '.join(names)}, "
                                                 f"{args.world} processes")
    print(f"{'model':<11} {'interconnect':<22} {'point':<9} {'measured ms':>11} {'predicted ms':>12} "
          f"{'compute':>8} {'exposed':>8} {'waited':>8} {'error':>7}")
    for r in rows:
        print(f"{r['model']:<11} {r['interconnect']:<22} {r['point']:<9} {r['measured_s'] * 1e3:11.1f} "
              f"{r['predicted_s'] * 1e3:12.1f} {r['predicted_compute_s'] * 1e3:8.1f} "
              f"{r['predicted_exposed_comm_s'] * 1e3:8.1f} {r['measured_comm_wait_s'] * 1e3:8.1f} {r['rel_error']:7.1%}")
    print(f"{summary['points']} points: median relative error {summary['median_rel_error']:.1%}, worst "
          f"{summary['worst_rel_error']:.1%}, Spearman rho {summary['spearman']:.3f}")
    for g, v in summary["groups"].items():
        print(f"  {g}: predicted best {v['predicted_best']}, measured best {v['measured_best']} "
              f"({'agree' if v['agree'] else 'DISAGREE'}; runner-up {v['measured_margin']:.1%} slower; "
              f"rho {v['spearman']:.2f})")
    for n, c in meta["calibration"].items():
        print(f"  {n}: {c}")
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {meta['load_average']['end']}")
    print(f"wrote {out / args.tag}.{{json,csv,png}} ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
