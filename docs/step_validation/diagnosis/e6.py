"""The calibration's probe steps without and with their collectives: CPU, wall, waits (as measure_all records them)."""
import sys, time, json
from pathlib import Path
sys.path.insert(0, '.')  # run from the repository root
from atp_pipeline.run import calibrate_compute as cc
if __name__ == '__main__':
    built = cc.compose_models(cc.probe_entries(list(cc.PROBES)), Path('conf'))
    shapes = [s for s, _ in built]; models = [m for _, m in built]
    plans = cc.plan_points(shapes, 4, (1, 2))
    t0 = time.time()
    got, timed, foreign = cc.measure_all([], 4, 3, 8.0, plans=plans, models=models, live=list(plans))
    n = len(plans)
    out = []
    for i, p in enumerate(plans):
        sk, lv = timed[i], timed[n + i]
        calls = cc.plan_calls(shapes[p[0]], (p[1], p[2]), p[3])
        out.append({"plan": p, "skip_cpu": sk.cpu, "skip_wall": sk.wall, "live_cpu": lv.cpu, "live_wall": lv.wall, "waits": lv.waits, "calls": calls})
        print(f"{list(cc.PROBES)[p[0]]:<12} {p[1]}x{p[2]}/c{p[3]} skip cpu {sk.cpu*1e3:6.2f} wall {sk.wall*1e3:6.2f} | live cpu {lv.cpu*1e3:6.2f} wall {lv.wall*1e3:6.2f} waits {({k: round(v*1e3,2) for k,v in lv.waits.items()})} calls {calls} | extra cpu {(lv.cpu-sk.cpu)*1e3:6.2f}")
    pass
    print(f"{time.time()-t0:.0f} s")
