"""Diagnosis e36 (issue 27, runs 42-43): the grids priced by ``--retime bracket``, predicted again at each
of the four host speeds a launch could be priced at (the calibration's own, the probe before the launch,
the one after it, their geometric mean: the rows' ``host_speed.bracket``) by the committed step model from
the grid's calibration (its byte copy), nothing measured. Run from the repository root:

    PYTHONPATH=. python docs/step_validation/diagnosis/e36.py docs/step_validation/steps_br1.json=docs/step_validation/local_br1.yaml ...
"""

import json
import statistics as st
import sys
from pathlib import Path

from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run.calibrate_compute import compose_models
from benchmarks.step_validation import load_calibrated, variant_overrides

CONF = Path("conf")


def main(pairs):
    for pair in pairs:
        grid, calibration = pair.split("=")
        rows = [r for r in json.load(open(grid))["rows"] if r["class"] == "real"]
        topo, source = load_calibrated(calibration, "", CONF)
        assert all(r["calibration"].split(" ")[2].rstrip(":") == source["sha256"] for r in rows), "another calibration"
        profile = profile_of(topo)
        shapes, errs = {}, {m: [] for m in ("none", "before", "after", "bracket")}
        for r in rows:
            key = (r["model"], r["batch"], r["seq_len"])
            if key not in shapes:
                label = f"{r['model']}@{r['batch']}x{r['seq_len']}"
                shapes[key] = compose_models([(label, variant_overrides(*key, CONF))], CONF)[0][0]
            b, a = (HostSpeed(s["compute"], s["overhead"]) for s in r["host_speed"]["bracket"])
            mesh = tuple(int(x) for x in r["mesh"].split("x"))
            for mode, p in (("none", profile), ("before", profile.at_speed(b)), ("after", profile.at_speed(a)),
                            ("bracket", profile.at_speed(b.until(a)))):
                e = estimate_step(topo.restrict(r["processes"]), shapes[key], mesh, StepSetting(chunks=r["chunks"]), p)
                errs[mode].append(abs(e.step_s - r["measured_s"]) / r["measured_s"])
            assert abs(errs["bracket"][-1] - r["rel_error"]) < 1e-9  # the rows' own prediction, again
        print(f"{Path(grid).name} ({Path(calibration).name}, sha256 {source['sha256']}), median / worst relative error: "
              + ", ".join(f"{m} {100 * st.median(v):.1f} / {100 * max(v):.1f} %" for m, v in errs.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
