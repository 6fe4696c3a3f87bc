"""Diagnosis e34 (issue 27, run 41): does the host speed re-timed before each launch track the groups?

Arithmetic on committed grids, nothing measured. Per grid: the sd of the log re-timed speed over its groups
(each row's ``predicted_s / predicted_at_calibration_speed_s``), and per group of the named grids the probe's
speed against the group's measured / predicted at the calibration's speed and re-timed.

    python docs/step_validation/diagnosis/e34.py docs/step_validation/steps_opt1.json docs/step_validation/steps_opt2.json
"""

import glob
import json
import math
import statistics as st
import sys


def groups(path):
    g = {}
    for r in json.load(open(path))["rows"]:
        if r.get("class") == "real" and r.get("host_speed") and r.get("predicted_at_calibration_speed_s"):
            g.setdefault(r["group"], []).append(r)
    return g


def speed_sd(path):
    xs = [math.log(st.median(r["predicted_s"] / r["predicted_at_calibration_speed_s"] for r in rs))
          for rs in groups(path).values()]
    return st.pstdev(xs) if len(xs) >= 3 else None


sds = {}
for f in sorted(glob.glob("docs/step_validation/*.json")):
    try:
        sd = speed_sd(f)
    except (ValueError, KeyError, TypeError):
        continue
    if sd is not None:
        sds[f.split("/")[-1]] = sd
named = {p.split("/")[-1] for p in sys.argv[1:]}
earlier = [v for k, v in sds.items() if k not in named]
print(f"sd of the log re-timed speed within a grid: {len(earlier)} earlier grids {min(earlier):.3f}-{max(earlier):.3f} "
      f"(median {st.median(earlier):.3f}); " + ", ".join(f"{k} {sds[k]:.3f}" for k in sorted(named) if k in sds))
for p in sys.argv[1:]:
    print(p)
    for k, rs in groups(p).items():
        sp = rs[0]["host_speed"]
        b = st.median(r["measured_s"] / r["predicted_s"] for r in rs)
        b0 = st.median(r["measured_s"] / r["predicted_at_calibration_speed_s"] for r in rs)
        print(f"  {k:40s} probe x{sp['compute']:.2f} (kernels) x{sp['overhead']:.2f} (per call)   "
              f"measured/predicted x{b:.2f} re-timed, x{b0:.2f} at the calibration's speed")
