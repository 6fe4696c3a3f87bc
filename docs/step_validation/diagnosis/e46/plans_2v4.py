import sys, json, statistics
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from pathlib import Path
from atp_pipeline.planning.compute_profile import profile_of
from atp_pipeline.run.calibrate_compute import (compose_models, probe_entries, plan_points, measure_all, PROBES,
                                                plan_features, framework_seconds, fit_framework)
from benchmarks.step_validation import load_calibrated
def main():
    topo, _ = load_calibrated('docs/step_validation/local_cell2.yaml', '', Path('conf')); prof = profile_of(topo)
    names = list(PROBES); built = compose_models(probe_entries(names), Path('conf')); shapes = [s for s, _ in built]
    out = {}
    for w in (2, 4, 2, 4):
        plans = plan_points(shapes, w, [1, 2])
        _, timed, _ = measure_all([], w, 3, 10.0, plans=plans, models=[sp for _, sp in built])
        out.setdefault(w, []).append((plans, [t.cpu for t in timed]))
    res = {}
    for w, runs in out.items():
        plans = runs[0][0]
        cpu = [statistics.mean(r[1][i] for r in runs) for i in range(len(plans))]
        fw = fit_framework(prof, shapes, plans, cpu)
        print(w, 'refit', fw)
        for pl, t in zip(plans, cpu):
            ft = plan_features(prof, shapes[pl[0]], (pl[1], pl[2]), pl[3])
            p4 = framework_seconds(prof.framework, ft); pw = framework_seconds(fw, ft)
            print(f"  {names[pl[0]][6:]:10s} {pl[1]}x{pl[2]}/c{pl[3]} meas {t*1e3:6.2f} calib-fw {p4*1e3:6.2f} ({t/p4:.2f}) refit {pw*1e3:6.2f} ({t/pw:.2f})  K {ft[0]*1e3:.2f} n {ft[1]}")
        res[w] = [(names[pl[0]], pl, t) for pl, t in zip(plans, cpu)]
    json.dump(res, open(_P(__file__).with_name('plans_2v4.json'), 'w'))
    print('calib fw', prof.framework)
if __name__ == '__main__':
    main()
