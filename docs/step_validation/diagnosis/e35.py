"""Diagnosis e35 (issue 27, run 42): which host speed should a launch be priced at?

Arithmetic on the committed grids, nothing measured. Every grid whose rows carry the re-timed host speed
(``--retime group``: the reference probe timed before each launch) and the prediction at the calibration's
own speed, re-scored four ways: *none* (the calibration's speed), *before* (the probe before the launch: what
the rows say), *after* (the probe after it: the next launch's; the last launch keeps its own) and *bracket*
(the geometric mean of the two, ``HostSpeed.until``). A launch's re-timed step is taken as its rows' predicted
/ predicted-at-calibration-speed (median over the group; within a group that ratio spreads 1 % at the median
over 672 groups), so *after* and *bracket* are that arithmetic, not a re-prediction.

    python docs/step_validation/diagnosis/e35.py docs/step_validation/steps*.json
"""

import json
import math
import statistics as st
import sys

MODES = ("none", "before", "after", "bracket")


def score(path):
    rows = [r for r in json.load(open(path))["rows"] if r.get("class") == "real"]
    order, groups = [], {}
    for r in rows:
        if r["group"] not in groups:
            order.append(r["group"])
        groups.setdefault(r["group"], []).append(r)
    if not rows or not all(g[0].get("host_speed") and g[0].get("predicted_at_calibration_speed_s")
                           for g in groups.values()):
        return None
    if any("bracket" in (g[0]["host_speed"] or {}) for g in groups.values()):
        return None  # priced by --retime bracket already
    speed = [math.log(st.median(r["predicted_s"] / r["predicted_at_calibration_speed_s"] for r in groups[k]))
             for k in order]
    out = {}
    for mode in MODES:
        errs = []
        for i, k in enumerate(order):
            after = speed[i + 1] if i + 1 < len(order) else speed[i]
            s = {"none": 0.0, "before": speed[i], "after": after, "bracket": (speed[i] + after) / 2}[mode]
            for r in groups[k]:
                p = r["predicted_at_calibration_speed_s"] * math.exp(s)
                errs.append(abs(p - r["measured_s"]) / r["measured_s"])
        out[mode] = (st.median(errs), max(errs))
    return out


def main(paths):
    tally = {m: [] for m in MODES}
    for p in sorted(paths):
        got = score(p)
        if got is None:
            continue
        print(f"{p.split('/')[-1]:24s} " + "  ".join(f"{m} {100 * a:4.1f}/{100 * b:4.1f}" for m, (a, b) in got.items()))
        for m, v in got.items():
            tally[m].append(v)
    for m, v in tally.items():
        ok = sum(a <= 0.10 and b <= 0.25 for a, b in v)
        print(f"{m:8s} median <= 10 % and worst <= 25 % in {ok} of {len(v)} grids; mean median "
              f"{100 * st.fmean(a for a, _ in v):.1f} %, mean worst {100 * st.fmean(b for _, b in v):.1f} %")


if __name__ == "__main__":
    main(sys.argv[1:])
