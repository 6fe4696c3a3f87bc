"""Diagnosis e41 (issue 27, runs 47-49): what a launch's own state and the recorded probe steps do to a grid.

(1) The launch: run 47's grid measured twice in a row with the same variants (``run47/rp_a.json``, then
``run47/rp_b.json``, code a3e60fc, calibration ``local_rp.yaml``): per point the log of B's step over A's, per group its
mean (the launch's level) and the spread around it. (2) The recorded steps: per calibration, the geometric mean over
the probe steps it recorded on 2 and on 4 processes (``reference.steps``, one launch of their own at its end) of
their wall time over the calibrated step model's time for them (``probe_step_predictions``, at the calibration's
speed): how far the one launch that recorded them sat from the model fitted over the calibration's main launch.
(3) Every grid priced again: as run (over the recorded steps, the default of runs 45-46), over the model's time for
the probe steps (x that ratio: the default since run 47), at the calibration's own speed; and A and B pooled (the
geometric mean of a point's two steps against that of its two predictions, as ``--launches 2`` pools a point's steps).

    python docs/step_validation/diagnosis/e41.py
"""

import json
import math
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, ".")
from benchmarks.step_validation import load_calibrated  # noqa: E402

from atp_pipeline.planning.compute_profile import parse_step_label, profile_of  # noqa: E402
from atp_pipeline.run.calibrate_compute import compose_models, probe_entries, probe_step_predictions  # noqa: E402

ROOT = Path("docs/step_validation")
CONF = Path("conf")
# calibration (the committed byte copy) -> its grids priced over the recorded steps (the code of runs 45-46)
RECORDED = {"local_st1.yaml": ["steps_st1.json", "steps_st2.json", "steps_st3.json"],
            "local_rp.yaml": ["diagnosis/run47/rp_a.json", "diagnosis/run47/rp_b.json"]}
OTHERS = ["local_la.yaml", "local_lb.yaml"]  # runs 48-49: calibrated for the grids priced over the model's time


def recorded_over_model(name: str) -> dict:
    """Per process count: the recorded probe steps' wall time over the calibrated model's time for them."""
    topo, _ = load_calibrated(str(ROOT / name), "unused", CONF)
    prof = profile_of(topo)
    rec = prof.reference["steps"]
    probes = sorted({parse_step_label(k)[0] for k in rec})
    shapes = [sh for sh, _ in compose_models(probe_entries(probes), CONF)]
    labels = sorted(rec)
    plans = [(probes.index(p), mesh[0], mesh[1], c) for p, mesh, c, _ in map(parse_step_label, labels)]
    logs: dict = {}
    for label, est in zip(labels, probe_step_predictions(prof, topo, shapes, plans)):
        logs.setdefault(parse_step_label(label)[3], []).append(math.log(rec[label] / est.step_s))
    return {n: math.exp(st.mean(v)) for n, v in sorted(logs.items())}


def figures(errs: list) -> str:
    return f"{100 * st.median(errs):.1f} / {100 * max(errs):.1f} %"


def err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def main() -> None:
    a = json.loads((ROOT / "diagnosis/run47/rp_a.json").read_text())["rows"]
    b = {(r["group"], r["point"]): r for r in json.loads((ROOT / "diagnosis/run47/rp_b.json").read_text())["rows"]}
    d = [math.log(b[(r["group"], r["point"])]["measured_s"] / r["measured_s"]) for r in a]
    print(f"(1) run 47, the same grid twice (rp_a 00:34-00:44, rp_b 00:44-00:53 UTC): per point log(B / A) "
          f"sd {st.pstdev(d):.3f}, mean {st.mean(d):+.3f}, |.| max {max(map(abs, d)):.3f} over {len(d)} points")
    groups: dict = {}
    for r, x in zip(a, d):
        groups.setdefault(r["group"], []).append(x)
    for g, v in groups.items():
        print(f"    {g:<38} level {st.mean(v):+.3f}, around it sd {st.pstdev(v):.3f}")
    print("(2) the recorded probe steps over the calibrated model's time for them, per process count")
    ks = {}
    for name in [*RECORDED, *OTHERS]:
        if not (ROOT / name).is_file():
            continue
        ks[name] = recorded_over_model(name)
        print(f"    {name:<16} " + ", ".join(f"{n} processes x{k:.3f}" for n, k in ks[name].items()))
    print("(3) median / worst relative error: as run (over the recorded steps) | over the model's time | "
          "at the calibration's speed")
    for name, grids in RECORDED.items():
        k = ks[name]
        for grid in grids:
            rows = [r for r in json.loads((ROOT / grid).read_text())["rows"] if r["class"] == "real"]
            print(f"    {grid:<28} {figures([err(r['predicted_s'], r['measured_s']) for r in rows])} | "
                  f"{figures([err(r['predicted_s'] * k[r['processes']], r['measured_s']) for r in rows])} | "
                  f"{figures([err(r['predicted_at_calibration_speed_s'], r['measured_s']) for r in rows])}")
    k = ks["local_rp.yaml"]
    for label, scale in (("as run", lambda r: 1.0), ("over the model's time", lambda r: k[r["processes"]]),
                         ("at the calibration's speed", None)):
        errs = []
        for r in a:
            rb = b[(r["group"], r["point"])]
            if scale is None:
                pred = math.sqrt(r["predicted_at_calibration_speed_s"] * rb["predicted_at_calibration_speed_s"])
            else:
                pred = math.sqrt(r["predicted_s"] * scale(r) * rb["predicted_s"] * scale(rb))
            errs.append(err(pred, math.sqrt(r["measured_s"] * rb["measured_s"])))
        print(f"    rp_a and rp_b pooled, {label}: {figures(errs)}")


if __name__ == "__main__":
    main()
