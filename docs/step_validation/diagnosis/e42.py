"""Diagnosis e42 (issue 27, run 50): the attention cores were priced by their FLOPs.

(1) The sweep: per committed calibration, each attention core's time with head size 32 over the one with head size 8
of the same batch, heads and sequence (their FLOPs differ 4x), and what the calibration priced cores of the validation
models' sizes at when its points were interpolated by FLOPs (the code before run 50) against by score elements
``b·a·s²`` (:attr:`~atp_pipeline.planning.kernels.Kernel.size`, since run 50; beyond the sweep, the kind's fit in the
same unit). (2) Every grid of runs 46-49 priced again with the attention cores by score elements (the calibrations'
points refitted per score element, everything else as calibrated; the host's speed moved by the change in the model's
time for the probe steps), against the figures the code of their run gave them: the error over all points and within
a group (a point against its group's level). (3) Per committed grid from run 36 on, each cell's mean over its groups
of log measured / predicted against its group's mean (as each grid was priced when it ran). (4) Run 47's grid priced
at probe steps timed inside each launch (``run47/launch_lv1.json``, its in-launch speeds over the recorded steps) moved
onto the calibrated model's time (x the recorded steps over the model's time, e41 part (2)), beside run 47's two grids
bracketed by probe launches on the same basis.

    python docs/step_validation/diagnosis/e42.py
"""

import dataclasses
import json
import math
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, ".")
from benchmarks.step_validation import load_calibrated, variant_overrides  # noqa: E402

import atp_pipeline.planning.kernels as kn  # noqa: E402
from atp_pipeline.planning.compute_profile import HostSpeed, parse_step_label, profile_of  # noqa: E402
from atp_pipeline.planning.steptime import StepSetting, estimate_step  # noqa: E402
from atp_pipeline.run.calibrate_compute import (compose_models, fit_kind, probe_entries,  # noqa: E402
                                                probe_step_predictions)

ROOT = Path("docs/step_validation")
CONF = Path("conf")
GRIDS = {"local_st1.yaml": ["steps_st1.json", "steps_st2.json", "steps_st3.json"],
         "local_la.yaml": ["launches_a.json"], "local_lb.yaml": ["launches_b.json", "launches_c.json"]}
CORES = [(6, 4, 48, 12), (8, 4, 120, 8), (16, 4, 120, 8), (6, 4, 168, 8), (10, 4, 120, 16)]
SIZE = kn.Kernel.size


class by_flops:
    """The code before run 50: a kernel's interpolation coordinate is its work (an attention core's FLOPs)."""

    def __enter__(self) -> None:
        kn.Kernel.size = property(lambda self: self.work)

    def __exit__(self, *exc: object) -> None:
        kn.Kernel.size = SIZE


def fresh(prof, **changes):
    out = dataclasses.replace(prof, **changes)
    out.__dict__.pop("_curve_cache", None)
    return out


def by_scores(prof):
    """The calibration with its attention fits refitted per score element over its own points (what its sweep
    fits since run 50)."""
    fits = dict(prof.fits)
    for kind in (kn.ATTN_FWD, kn.ATTN_BWD):
        pts = [(kn.Kernel(k, d), t) for (k, d), t in prof.points.items() if k == kind]
        fits[kind] = fit_kind([k for k, _ in pts], [t for _, t in pts])
    return fresh(prof, fits=fits)


def part1() -> None:
    print("(1) attention cores: head size 32 over head size 8 at the same (b, a, s); validation-size cores priced "
          "by FLOPs | by score elements (us)")
    for cal in GRIDS:
        topo, _ = load_calibrated(str(ROOT / cal), "unused", CONF)
        old = profile_of(topo)
        new = by_scores(old)
        for kind in (kn.ATTN_FWD, kn.ATTN_BWD):
            pts = {d: t for (k, d), t in old.points.items() if k == kind}
            ratios = [pts[(b, a, s, 32)] / t for (b, a, s, d), t in pts.items() if d == 8 and (b, a, s, 32) in pts]
            with by_flops():
                flops = [fresh(old).seconds(kn.Kernel(kind, c)) for c in CORES]
            sizes = [new.seconds(kn.Kernel(kind, c)) for c in CORES]
            print(f"    {cal:<15} {kind:<14} d32/d8 {min(ratios):.2f}-{max(ratios):.2f} | "
                  + ", ".join(f"{c}: {f * 1e6:.0f} | {s * 1e6:.0f}" for c, f, s in zip(CORES, flops, sizes)))


def part2() -> None:
    print("(2) grids priced again with the attention cores by score elements: median / worst over all points, "
          "within a group (as run -> by score elements)")
    for cal, grids in GRIDS.items():
        topo, _ = load_calibrated(str(ROOT / cal), "unused", CONF)
        old = profile_of(topo)
        new = by_scores(old)
        labels = sorted(old.reference["steps"])
        probes = sorted({parse_step_label(k)[0] for k in labels})
        shapes = [s for s, _ in compose_models(probe_entries(probes), CONF)]
        plans = [(probes.index(p), m[0], m[1], c) for p, m, c, _ in map(parse_step_label, labels)]
        with by_flops():
            before = probe_step_predictions(fresh(old), topo, shapes, plans)
        after = probe_step_predictions(new, topo, shapes, plans)
        logs: dict = {}
        for label, o, n in zip(labels, before, after):
            logs.setdefault(parse_step_label(label)[3], []).append(math.log(o.step_s / n.step_s))
        moved = {p: math.exp(st.mean(v)) for p, v in logs.items()}  # the host's speed over the new model's time
        for grid in grids:
            rows = [r for r in json.loads((ROOT / grid).read_text())["rows"] if r["class"] == "real"]
            keys = sorted({(r["model"], r["batch"], r["seq_len"]) for r in rows})
            built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, CONF)) for m, b, s in keys], CONF)
            shape = {k: s for k, (s, _) in zip(keys, built)}
            figs = []
            for pred in (lambda r: r["predicted_s"], None):
                errs, groups = [], {}
                for r in rows:
                    if pred is None:
                        hs = r["host_speed"]["compute"] * moved[r["processes"]]
                        d1, d2 = (int(x) for x in r["mesh"].split("x"))
                        p = estimate_step(topo.restrict(r["processes"]), shape[(r["model"], r["batch"], r["seq_len"])],
                                          (d1, d2), StepSetting(chunks=r["chunks"]),
                                          new.at_speed(HostSpeed(hs, hs))).step_s
                    else:
                        p = pred(r)
                    errs.append(abs(p - r["measured_s"]) / r["measured_s"])
                    groups.setdefault(r["group"], []).append(math.log(r["measured_s"] / p))
                within = [abs(math.exp(x - st.mean(v)) - 1) for v in groups.values() for x in v]
                figs.append(f"{100 * st.median(errs):.1f} / {100 * max(errs):.1f} %, within "
                            f"{100 * st.median(within):.1f} / {100 * max(within):.1f} %")
            print(f"    {cal:<15} {grid:<17} {figs[0]} -> {figs[1]}")


CELLS = ["2:2x1/c1", "2:2x1/c2", "2:1x2/c1", "2:1x2/c2", "4:4x1/c1", "4:4x1/c2", "4:2x2/c1", "4:2x2/c2", "4:1x4/c1",
         "4:1x4/c2"]
CELL_GRIDS = ["steps_wait3", "steps_wait4", "steps_calls3", "steps_calls4", "steps_br3", "steps_br5", "steps_st1",
              "steps_st3", "launches_a", "launches_b", "launches_c", "attn_a", "attn_b", "attn_c", "attn_d", "attn_e"]


def part3() -> None:
    print("(3) each cell against its group (mean of log measured / predicted minus the group's mean), per grid")
    print(f"    {'grid (variants)':<30}" + " ".join(f"{c:>9}" for c in CELLS))
    for name in CELL_GRIDS:
        path = ROOT / f"{name}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        rows = [r for r in data["rows"] if r["class"] == "real"]
        level: dict = {}
        for r in rows:
            level.setdefault(r["group"], []).append(math.log(r["measured_s"] / r["predicted_s"]))
        cells: dict = {}
        for r in rows:
            cells.setdefault(f"{r['processes']}:{r['point']}", []).append(
                math.log(r["measured_s"] / r["predicted_s"]) - st.mean(level[r["group"]]))
        print(f"    {name + ' (' + data['meta']['variants'] + ')':<30}"
              + " ".join(f"{st.mean(cells[c]):+9.3f}" if c in cells else " " * 9 for c in CELLS))


def part4() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("e41", Path(__file__).with_name("e41.py"))
    e41 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e41)
    k = e41.recorded_over_model("local_rp.yaml")
    print("(4) run 47 (local_rp.yaml), every point priced over the model's time for the probe steps: median / worst")
    for grid in ("diagnosis/run47/launch_lv1.json", "diagnosis/run47/rp_a.json", "diagnosis/run47/rp_b.json"):
        rows = [r for r in json.loads((ROOT / grid).read_text())["rows"] if r["class"] == "real"]
        errs = [abs(r["predicted_at_calibration_speed_s"] * r["host_speed"]["compute"] * k[r["processes"]]
                    - r["measured_s"]) / r["measured_s"] for r in rows]
        print(f"    {grid:<34} {100 * st.median(errs):.1f} / {100 * max(errs):.1f} %")


if __name__ == "__main__":
    part1()
    part2()
    part3()
    part4()
