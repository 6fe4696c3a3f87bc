"""Diagnosis e14 (issue 27, after run 12; not a validation): the probes' whole training steps per
(process count, mesh, chunks) against run 12's calibration without its residual — do the probes show
the grids' pattern (4 processes, 1x4, chunks 2 predicted long)?

    python docs/step_validation/diagnosis/e14.py  # writes docs/step_validation/diagnosis/e14.json
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import yaml

from atp_pipeline.planning.compute_profile import ComputeProfile
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run import calibrate_compute as cc
from atp_pipeline.topology.model import Topology

HERE = Path(__file__).resolve().parent
CAL = HERE.parent / "local_resid2.yaml"


def main() -> int:
    data = yaml.safe_load(CAL.read_text())
    topo = Topology.from_config(data)
    prof = dataclasses.replace(ComputeProfile.from_config(data["device"]["compute"]), step_residual=None)
    built = cc.compose_models(cc.probe_entries(list(cc.PROBES)), cc.CONF)
    shapes = [sh for sh, _ in built]
    out = []
    for world in (4, 2):
        live = cc.plan_points(shapes, world, (1, 2))
        _, timed, foreign = cc.measure_all([], world, 5, 8.0, models=[s for _, s in built], live=live)
        for (mi, d1, d2, c), t in zip(live, timed):
            est = estimate_step(topo.restrict(world), shapes[mi], (d1, d2), StepSetting(chunks=c), prof)
            out.append({"probe": list(cc.PROBES)[mi], "processes": world, "mesh": f"{d1}x{d2}", "chunks": c,
                        "measured_s": t.wall, "measured_cpu_s": t.cpu, "measured_wait_s": sum(t.waits.values()),
                        "predicted_s": est.step_s, "compute_s": est.compute_s, "exposed_s": est.exposed_comm_s,
                        "cpu_s": est.cpu_s, "host_bound": est.host_bound, "timeline_s": est.timeline_s})
            r = out[-1]
            print(f"{r['probe']:<16} {world} {r['mesh']}/c{c}  measured {t.wall * 1e3:7.1f} ms  predicted "
                  f"{est.step_s * 1e3:7.1f}  m/p {t.wall / est.step_s:5.2f}  cpu m/p {t.cpu / est.cpu_s:5.2f}  "
                  f"exposed {est.exposed_comm_s * 1e3:6.1f} waited {r['measured_wait_s'] * 1e3:6.1f}"
                  f"{'  host-bound' if est.host_bound else ''}", flush=True)
        print(f"other jobs' load {foreign}")
    (HERE / "e14.json").write_text(json.dumps({"calibration": str(CAL.name), "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
