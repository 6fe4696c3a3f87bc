"""Collective-free forward + backward, a rank's CPU, of the validation's models and of the probes on
the same processes, against the price a calibration's framework fit gives them (K(1+f) + n.o + ...).

    python docs/step_validation/diagnosis/e47/plans_models.py CALIBRATION.yaml WORLD MESHES TAG
e.g. docs/step_validation/local_gc1.yaml 2 2x1,1x2 gc1_2proc"""
import sys, json, statistics
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from pathlib import Path
from atp_pipeline.planning.compute_profile import profile_of
from atp_pipeline.run.calibrate_compute import (compose_models, probe_entries, measure_all, plan_features,
                                                framework_seconds)
from benchmarks.step_validation import load_calibrated, variant_overrides

MODELS = [("gpt2_tiny", 12, 140), ("llama_tiny", 12, 140), ("small", 12, 140), ("gpt2_tiny", 4, 228),
          ("llama_tiny", 4, 228), ("small", 4, 228)]
PROBE_NAMES = ["probe_gpt_s_b48", "probe_llama_b48", "probe_gpt2_b48", "probe_llama", "probe_gpt2"]


def main():
    cal, world, meshes, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    topo, _ = load_calibrated(cal, '', Path('conf'))
    prof = profile_of(topo)
    entries = [(f"{n} b{b} s{s}", variant_overrides(n, b, s, Path('conf'))) for n, b, s in MODELS]
    entries += probe_entries(PROBE_NAMES)
    built = compose_models(entries, Path('conf'))
    shapes = [s for s, _ in built]
    mesh_list = [tuple(int(x) for x in m.split('x')) for m in meshes.split(',')]
    plans = [(i, d1, d2, c) for i in range(len(entries)) for d1, d2 in mesh_list for c in (1, 2)]
    runs = []
    for _ in range(2):
        _, timed, _ = measure_all([], world, 3, 10.0, plans=plans, models=[sp for _, sp in built])
        runs.append([t.cpu for t in timed])
    rows = []
    for j, pl in enumerate(plans):
        t = statistics.mean(r[j] for r in runs)
        ft = plan_features(prof, shapes[pl[0]], (pl[1], pl[2]), pl[3])
        p = framework_seconds(prof.framework, ft)
        rows.append({"model": entries[pl[0]][0], "mesh": f"{pl[1]}x{pl[2]}", "chunks": pl[3], "measured_s": t,
                     "priced_s": p, "kernels_s": ft[0], "kernels": ft[1], "per_run": [r[j] for r in runs]})
        print(f"  {entries[pl[0]][0]:22s} {pl[1]}x{pl[2]}/c{pl[3]} meas {t*1e3:7.2f} priced {p*1e3:7.2f} "
              f"(x{t/p:.2f})  K {ft[0]*1e3:6.2f} n {ft[1]}", flush=True)
    json.dump({"calibration": cal, "world": world, "rows": rows},
              open(_P(__file__).with_name(f'plans_models_{tag}.json'), 'w'), indent=1)


if __name__ == '__main__':
    main()
