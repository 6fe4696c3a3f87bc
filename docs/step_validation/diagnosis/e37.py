"""Diagnosis e37 (issue 27, runs 41-44): where the level of the eight grids since the optimizer change sits, per
(family, process count, mesh/chunks) cell. Arithmetic on the committed rows, nothing measured: the median over the
cell's rows of log(measured / predicted) of a rank's CPU (the model's CPU before the profile's line,
``predicted_rank_cpu_s``) and of the step at the calibration's own speed, the predicted collectives' share of that
CPU and the measured share of the step a rank waits in collectives; HF = ``gpt2_tiny`` and ``llama_tiny``, GPT =
``small``.

    python docs/step_validation/diagnosis/e37.py docs/step_validation/steps_opt1.json ... docs/step_validation/steps_br6.json
"""

import json
import math
import statistics as st
import sys


def main(paths):
    cells = {}
    for p in paths:
        for r in json.load(open(p))["rows"]:
            if r["class"] != "real":
                continue
            fam = "GPT" if r["model"] == "small" else "HF"
            cells.setdefault((fam, r["processes"], r["point"]), []).append((
                math.log(r["measured_rank_cpu_s"] / r["predicted_rank_cpu_s"]),
                math.log(r["measured_s"] / r["predicted_at_calibration_speed_s"]),
                r["predicted_coll_cpu_s"] / r["predicted_rank_cpu_s"], r["measured_rank_wait_s"] / r["measured_s"]))
    print(f"{len(paths)} grids; per cell, medians: log(measured/predicted) rank CPU, step at the calibration's speed; "
          "predicted collectives' share of the CPU; measured wait share of the step")
    for k in sorted(cells):
        v = cells[k]
        print(f"  {k[0]:3s} {k[1]} proc. {k[2]:7s} rows {len(v):3d}  CPU {st.median(x[0] for x in v):+.2f}  step "
              f"{st.median(x[1] for x in v):+.2f}  collectives {st.median(x[2] for x in v):.2f}  wait "
              f"{st.median(x[3] for x in v):.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
