"""Diagnosis e39 (issue 27, after runs 42-44): the 2-process CPU line's intercept at its bound.

Arithmetic on committed files, nothing measured. (1) In each calibration's probe steps (``local_*_probe_steps.json``
of runs 41-44), a rank's measured CPU over the model's (``measured_cpu_s / cpu_s``) per process count for the batch-48
probes and the batch-6 ones (medians). (2) Every grid whose rows the committed model reproduces (its prediction from
the calibration's probe steps, to 0.1 %), predicted again with the CPU line ``U = a·Û + b`` per process count and chunk
count fitted as the calibration fits it (``calibrate_compute.fit_cpu_step``: relative least squares, ``b >= 0``) and
with ``b`` free; the step's own line per cell unchanged (``CpuStep.step``).

    python docs/step_validation/diagnosis/e39.py
"""

import dataclasses
import glob
import json
import math
import re
import statistics as st

import numpy as np

from atp_pipeline.run.calibrate_compute import _line, fit_cpu_step

ROOT = "docs/step_validation"


def free_line(pts):
    """``y = s·x + c``, relative least squares, ``c`` unbounded (``s > 0``, else the bounded fit)."""
    s, c = np.linalg.lstsq(np.array([[x / y, 1.0 / y] for x, y in pts]), np.ones(len(pts)), rcond=None)[0]
    return (float(s), float(c)) if s > 0 else _line(pts)


def fit(rows, free=False):
    """The calibration's own fit (:func:`calibrate_compute.fit_cpu_step`) of the probes' steps; ``free``: its CPU
    lines refitted with the intercept unbounded (:func:`free_line`), the step's lines per cell as they are."""
    cs = fit_cpu_step([r["cpu_s"] for r in rows], [r["measured_cpu_s"] for r in rows], [r["measured_s"] for r in rows],
                      [r["processes"] for r in rows], [tuple(int(x) for x in r["mesh"].split("x")) for r in rows],
                      [r["chunks"] for r in rows])
    if not free:
        return cs
    pts = {}
    for r in rows:
        pts.setdefault(r["processes"], {}).setdefault(r["chunks"], []).append((r["cpu_s"], r["measured_cpu_s"]))
    return dataclasses.replace(cs, cpu={n: {c: free_line(p) for c, p in per.items()} for n, per in pts.items()})


def predict(row, cpu_step):
    """The row's step from its model CPU, at the host speed its row was priced at (``CpuStep.at_speed``)."""
    ov = (row.get("host_speed") or {}).get("overhead", 1.0)
    mesh = tuple(int(x) for x in row["mesh"].split("x"))
    return cpu_step.at_speed(ov).step(row["processes"], mesh, row["chunks"], row["predicted_rank_cpu_s"])


def main():
    calibrations = {}
    for f in sorted(glob.glob(f"{ROOT}/local_*_probe_steps.json")):
        d = json.load(open(f))
        calibrations[d["date"]] = d["rows"]
    print("(1) measured / model rank CPU of the probes' steps, median (batch 48 | batch 6):")
    for tag in ("opt1", "br1", "br3", "br5"):
        rows = json.load(open(f"{ROOT}/local_{tag}_probe_steps.json"))["rows"]
        parts = []
        for n in (2, 4):
            big = [r["measured_cpu_s"] / r["cpu_s"] for r in rows if r["processes"] == n and r["probe"].endswith("_b48")]
            small = [r["measured_cpu_s"] / r["cpu_s"] for r in rows if r["processes"] == n and not r["probe"].endswith("_b48")]
            parts.append(f"{n} proc. {st.median(big):.2f} | {st.median(small):.2f}")
        print(f"  local_{tag}: " + "; ".join(parts))
    print("(2) grids the committed model reproduces: median / worst relative error, and the 2- minus 4-process median "
          "log(measured / predicted); b >= 0 (the calibration's) against b free")
    tally = {"bounded": [], "free": []}
    for path in sorted(glob.glob(f"{ROOT}/steps*.json")):
        rows = [r for r in json.load(open(path))["rows"] if r.get("class") == "real"]
        if not rows or "predicted_rank_cpu_s" not in rows[0]:
            continue
        m = re.search(r"kernels '[^']*' \(([^)]*)\)", rows[0]["calibration"])
        if not m or m.group(1) not in calibrations or "step / rank CPU" not in rows[0]["calibration"]:
            continue
        probe_rows = calibrations[m.group(1)]
        out = []
        for name, free in (("bounded", False), ("free", True)):
            fitted = fit(probe_rows, free)
            pred = [predict(r, fitted) for r in rows]
            if name == "bounded" and max(abs(p / r["predicted_s"] - 1) for p, r in zip(pred, rows)) > 1e-3:
                break  # an older model form: not reproduced
            errs = [abs(p - r["measured_s"]) / r["measured_s"] for p, r in zip(pred, rows)]
            gap = (st.median(math.log(r["measured_s"] / p) for p, r in zip(pred, rows) if r["processes"] == 2)
                   - st.median(math.log(r["measured_s"] / p) for p, r in zip(pred, rows) if r["processes"] == 4))
            tally[name].append((st.median(errs), max(errs), gap))
            out.append(f"{name} {100 * st.median(errs):.1f} / {100 * max(errs):.1f} %, gap {gap:+.3f}")
        if len(out) == 2:
            print(f"  {path.split('/')[-1]:20s} " + "; ".join(out))
    for name, v in tally.items():
        print(f"{name}: {len(v)} grids, mean median {100 * st.fmean(x[0] for x in v):.1f} %, mean worst "
              f"{100 * st.fmean(x[1] for x in v):.1f} %, mean gap {st.fmean(x[2] for x in v):+.3f}")


if __name__ == "__main__":
    main()
