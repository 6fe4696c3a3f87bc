"""Diagnosis e43 (session 54): the host's speed timed inside each validation launch, and the MLP
activation's kernels as its code runs them.

    python docs/step_validation/diagnosis/e43.py > docs/step_validation/diagnosis/e43.log

Reads the committed grids measured with ``--probes-in-launch`` (every row: the prediction at the
speed the probe steps read around its launches, ``predicted_s`` — ``--retime steps``, the default until run 55 —
and at the speed the same probe steps read inside its launches, interleaved with its points,
``predicted_at_in_launch_speed_s``, and at the calibration's own speed). Nothing is measured.

(1) Per grid and pricing: median / worst relative error, the best mesh, the groups' levels (the
    mean log of predicted / measured over a group's points: their standard deviation and range).
(2) How each pricing follows a group's two launches: per group, the log of its first launch's
    measured step over its second's (the median of its points' per-launch medians) against the log
    of the speeds each pricing read for the two launches (Pearson's r over the groups, and the
    standard deviation of the difference).
(3) ``inl_a`` (measured before the activation's kernels were counted) priced again with the
    current program (GPT-2's activation 8 / 11 kernels): its ``gpt2_tiny`` groups' levels before and
    after, at the in-launch speed (the calibration's fits unchanged).
(4) The step from a rank's CPU (``CpuStep``) with its cells refitted from each calibration's committed
    probe steps three ways — a line per cell (as calibrated: ``_line``), the median step / CPU per
    cell (no wait), a slope per cell with one wait per process and chunk count — and every row of the
    ten grids since run 50 priced again from its predicted rank CPU (the rank-CPU fit ``a·Û + b``
    per process and chunk count refitted the same way each time): median / worst, and the root mean
    square of the log error over all 600 points.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[3]
GRIDS = ("inl_a", "inl_b")
PRICINGS = (("predicted_s", "steps around"), ("predicted_at_in_launch_speed_s", "steps inside"),
            ("predicted_at_calibration_speed_s", "calibration's speed"))


def groups(rows: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r["group"]].append(r)
    return out


def figures(rows: List[Dict[str, Any]], key: str) -> str:
    err = [abs(r[key] / r["measured_s"] - 1) for r in rows]
    g = groups(rows)
    best = sum(min(rs, key=lambda r: r[key])["point"] == min(rs, key=lambda r: r["measured_s"])["point"]
               for rs in g.values())
    lv = [statistics.mean(math.log(r[key] / r["measured_s"]) for r in rs) for rs in g.values()]
    return (f"{100 * statistics.median(err):5.1f} / {100 * max(err):5.1f} %, best {best:2d} of {len(g)}, "
            f"levels sd {statistics.pstdev(lv):.3f}, {min(lv):+.3f} .. {max(lv):+.3f}")


def reprice(rows: List[Dict[str, Any]], calibration: str) -> List[float]:
    """Every row predicted again by the current program at its in-launch speed."""
    sys.path.insert(0, str(ROOT))
    from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
    from atp_pipeline.planning.steptime import StepSetting, estimate_step
    from atp_pipeline.run.calibrate_compute import compose_models
    from benchmarks.step_validation import load_calibrated, variant_overrides

    topo, _ = load_calibrated(str(ROOT / calibration), "", ROOT / "conf")
    profile = profile_of(topo)
    keys = sorted({(r["model"], r["batch"], r["seq_len"]) for r in rows})
    built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, ROOT / "conf")) for m, b, s in keys],
                           ROOT / "conf")
    shapes = {k: sh for k, (sh, _) in zip(keys, built)}
    out = []
    for r in rows:
        hs = r["host_speed_in_launch"]
        at = profile.at_speed(HostSpeed(hs["compute"], hs["overhead"], "", "steps", r["processes"]))
        d1, d2 = (int(x) for x in r["mesh"].split("x"))
        out.append(estimate_step(topo.restrict(r["processes"]), shapes[(r["model"], r["batch"], r["seq_len"])],
                                 (d1, d2), StepSetting(chunks=r["chunks"]), at).step_s)
    return out


def main() -> None:
    data = {g: json.loads((ROOT / "docs/step_validation" / f"{g}.json").read_text()) for g in GRIDS}
    print("(1) median / worst relative error, best mesh, the groups' levels (log predicted / measured)")
    for g, d in data.items():
        rows = [r for r in d["rows"] if r["class"] == "real"]
        print(f"  {g} ({d['meta']['calibration']['file']}, sha256 {d['meta']['calibration']['sha256']}, "
              f"{d['meta']['variants']})")
        for key, name in PRICINGS:
            print(f"    {name:22s} {figures(rows, key)}")
    print("\n(2) a group's first launch over its second: measured against the speeds each pricing read")
    pairs: Dict[str, List[tuple]] = {"steps around": [], "steps inside": []}
    for d in data.values():
        for rs in groups([r for r in d["rows"] if r["class"] == "real"]).values():
            first, second = (statistics.median(r["measured_per_launch_s"][i] for r in rs) for i in (0, 1))
            m = math.log(first / second)
            br = rs[0]["host_speed"]["bracket"]  # before and after each launch
            around = math.log(math.sqrt(br[0]["compute"] * br[1]["compute"] / (br[2]["compute"] * br[3]["compute"])))
            inl = rs[0]["host_speed_in_launch"]["per_launch"]
            inside = math.log(inl[0]["compute"] / inl[1]["compute"])
            pairs["steps around"].append((around, m))
            pairs["steps inside"].append((inside, m))
    for name, pts in pairs.items():
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        print(f"  {name:22s} {len(pts)} groups: sd of the measured ratio {statistics.stdev(ys):.3f}, of the "
              f"speeds' {statistics.stdev(xs):.3f}, Pearson r {statistics.correlation(xs, ys):.3f}, sd of "
              f"measured - speeds {statistics.stdev([y - x for x, y in pts]):.3f}")
    print("\n(3) inl_a priced again by the current program (the MLP activation's kernels counted), at the in-launch "
          "speed: gpt2_tiny groups' levels")
    d = data["inl_a"]
    rows = [r for r in d["rows"] if r["class"] == "real"]
    now = reprice(rows, "docs/step_validation/local_inl1.yaml")
    for g, rs in groups(rows).items():
        if rs[0]["model"] != "gpt2_tiny":
            continue
        idx = [rows.index(r) for r in rs]
        before = statistics.mean(math.log(r["predicted_at_in_launch_speed_s"] / r["measured_s"]) for r in rs)
        after = statistics.mean(math.log(now[i] / rows[i]["measured_s"]) for i in idx)
        print(f"  {g:40s} {before:+.3f} -> {after:+.3f}")
    err = [abs(p / r["measured_s"] - 1) for p, r in zip(now, rows)]
    print(f"  all 60 points at the in-launch speed: {100 * statistics.median(err):.1f} / {100 * max(err):.1f} %")
    forms()


FORM_GRIDS = (("attn_a", "local_at1"), ("attn_b", "local_at1"), ("attn_c", "local_at2"), ("attn_d", "local_at2"),
              ("attn_e", "local_at3"), ("inl_a", "local_inl1"), ("inl_b", "local_inl2"), ("launch_a", "local_ln1"),
              ("launch_b", "local_ln1"), ("launch_c", "local_ln2"))


def cell_fits(probes: List[Dict[str, Any]], form: str) -> tuple:
    """``(cpu, cells)``: per (processes, chunks) the rank-CPU line, per (processes, cell) (ratio, wait)."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from atp_pipeline.planning.lstsq import nnls
    from atp_pipeline.run.calibrate_compute import _line

    cells: Dict[tuple, List[tuple]] = defaultdict(list)
    per_chunks: Dict[tuple, List[tuple]] = defaultdict(list)
    for r in probes:
        cells[(r["processes"], f"{r['mesh']}/c{r['chunks']}")].append((r["measured_cpu_s"], r["measured_s"]))
        per_chunks[(r["processes"], r["chunks"])].append((r["cpu_s"], r["measured_cpu_s"]))
    cpu = {k: _line(v) for k, v in per_chunks.items()}
    if form == "line":
        return cpu, {k: _line(v) for k, v in cells.items()}
    if form == "median":
        return cpu, {k: (statistics.median(t / u for u, t in v), 0.0) for k, v in cells.items()}
    out = {}
    for n, c in {(k[0], int(k[1].rpartition("/c")[2])) for k in cells}:
        ks = [k for k in cells if k[0] == n and k[1].endswith(f"/c{c}")]
        a = [[*(u / t if j == i else 0.0 for j in range(len(ks))), 1.0 / t] for i, k in enumerate(ks) for u, t in cells[k]]
        x = nnls(np.array(a), np.ones(len(a)))
        out.update({k: (float(x[i]), float(x[-1])) for i, k in enumerate(ks)})
    return cpu, out


def forms() -> None:
    print("\n(4) the step from a rank's CPU, its cells refitted three ways, the ten grids since run 50")
    every: Dict[str, List[float]] = defaultdict(list)
    for grid, cal in FORM_GRIDS:
        rows = json.loads((ROOT / "docs/step_validation" / f"{grid}.json").read_text())["rows"]
        probes = json.loads((ROOT / "docs/step_validation" / f"{cal}_probe_steps.json").read_text())["rows"]
        line = []
        for form in ("line", "median", "shared wait"):
            cpu, cells = cell_fits(probes, form)
            err = []
            for r in rows:
                o = r["host_speed"]["overhead"] if r["host_speed"] else 1.0
                a, b = cpu[(r["processes"], r["chunks"])]
                g, w = cells[(r["processes"], r["point"])]
                err.append(math.log((g * (a * r["predicted_rank_cpu_s"] + b * o) + w * o) / r["measured_s"]))
            every[form] += err
            rel = [abs(math.exp(e) - 1) for e in err]
            line.append(f"{form} {100 * statistics.median(rel):4.1f} / {100 * max(rel):5.1f} %")
        print(f"  {grid:9s} ({cal}) " + "; ".join(line))
    print("  rms of the log error over all points: " + ", ".join(
        f"{form} {math.sqrt(statistics.mean(e * e for e in err)):.3f}" for form, err in every.items()))


if __name__ == "__main__":
    main()
