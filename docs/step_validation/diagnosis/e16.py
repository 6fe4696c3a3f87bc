"""Diagnosis e16 (issue 27, run 16): is a step a fixed multiple of a rank's CPU per (processes,
mesh, chunks) cell, and where does the rest of the error sit? Arithmetic on committed files only
(no timing): e14's probe steps (``e14.json``: six probe models' whole steps, measured step and
rank CPU, against run 12's calibration ``local_resid2.yaml``) and the validation rows of runs
12-15 (``steps_resid*.json``, ``steps_probe*.json``).

    python docs/step_validation/diagnosis/e16.py > docs/step_validation/diagnosis/e16.log
"""

from __future__ import annotations

import json
import statistics as st
from pathlib import Path

from atp_pipeline.run.calibrate_compute import fit_residual

HERE = Path(__file__).resolve().parent
GRIDS = ["steps_resid", "steps_resid2", "steps_resid3", "steps_resid4", "steps_resid5", "steps_resid6",
         "steps_resid7", "steps_probe1", "steps_probe2"]
RUN12 = ["steps_resid2", "steps_resid3"]  # the grids of e14's calibration (run 12, sha256 2057d0e62bef)


def cell(r):
    return r["processes"], r["mesh"], r["chunks"]


def mesh(r):
    return tuple(int(x) for x in r["mesh"].split("x"))


def rows(tag):
    return json.loads((HERE.parent / f"{tag}.json").read_text())["rows"]


def spread(v):
    return f"{min(v):+.0%}..{max(v):+.0%} (median |.| {st.median(abs(x) for x in v):.0%})"


def main() -> None:
    e14 = json.loads((HERE / "e14.json").read_text())["rows"]
    print("1. e14's probes: measured step / measured rank CPU per cell (six probe models each)")
    ratio = {}
    for r in e14:
        ratio.setdefault(cell(r), []).append(r["measured_s"] / r["measured_cpu_s"])
    for k, v in sorted(ratio.items()):
        print(f"   {k}: median x{st.median(v):.2f}, " + " ".join(f"{x:.2f}" for x in v))
    g = {k: st.median(v) for k, v in ratio.items()}
    print("\n2. validation rows (models e14 never ran, 2-4 h later): their step / rank CPU against e14's cell median;"
          "\n   their predicted rank CPU against their measured; the step as e14's ratio x the MEASURED rank CPU"
          " (an oracle of the CPU, not a validation)")
    for t in GRIDS:
        rs = rows(t)
        dev = [r["measured_s"] / r["measured_rank_cpu_s"] / g[cell(r)] - 1 for r in rs]
        cpu = [r["predicted_rank_cpu_s"] / r["measured_rank_cpu_s"] - 1 for r in rs]
        orc = [abs(g[cell(r)] * r["measured_rank_cpu_s"] / r["measured_s"] - 1) for r in rs]
        print(f"   {t:13s} step/CPU vs e14 {spread(dev)}; CPU predicted/measured {spread(cpu)}; "
              f"oracle median {st.median(orc):.1%} worst {max(orc):.1%}")
    print("\n3. development check: calibrate_compute.fit_residual over e14's probes (both forms, the form chosen on"
          "\n   probe models left out), applied to run 12's grids (same calibration; e14 was timed after them)")
    names = sorted({r["probe"] for r in e14})
    res = fit_residual([(r["compute_s"], r["exposed_s"]) for r in e14], [r["cpu_s"] for r in e14],
                       [r["measured_cpu_s"] for r in e14], [r["measured_s"] for r in e14],
                       [r["processes"] for r in e14], [mesh(r) for r in e14], [r["chunks"] for r in e14],
                       [names.index(r["probe"]) for r in e14])
    print("   " + res.describe())
    for t in RUN12:
        rs = rows(t)
        cpu = [abs(res.cpu_step(r["processes"], mesh(r), r["chunks"], r["predicted_rank_cpu_s"]) / r["measured_s"] - 1)
               for r in rs]
        terms = []
        for r in rs:
            fc, fe = res.at(r["processes"], r["chunks"])
            terms.append(abs((fc * r["predicted_compute_s"] + fe * r["predicted_exposed_comm_s"]) / r["measured_s"] - 1))
        now = [r["rel_error"] for r in rs]
        print(f"   {t}: CPU form median {st.median(cpu):.1%} worst {max(cpu):.1%} (>25 %: {sum(e > .25 for e in cpu)}); "
              f"terms' form {st.median(terms):.1%} / {max(terms):.1%}; as run (run 12's one factor) "
              f"{st.median(now):.1%} / {max(now):.1%}")


if __name__ == "__main__":
    main()
