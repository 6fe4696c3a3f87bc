"""run 59 offline: the CPU lines with and without probe_gpt2_b48's steps, on gb_a/gb_b rows at their priced speed."""
import dataclasses, json, math, statistics, sys, warnings
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT)); warnings.filterwarnings('ignore')
from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run.calibrate_compute import compose_models, fit_cpu_step, probe_entries, probe_step_predictions
from benchmarks.step_validation import load_calibrated, variant_overrides
y = ROOT / 'docs/step_validation/local_gb1.yaml'  # run 59's calibration, byte copy
topo, _ = load_calibrated(str(y), '', ROOT / 'conf'); prof = profile_of(topo)
rows = json.loads((ROOT / 'docs/step_validation/local_gb1_probe_steps.json').read_text())['rows']
names = sorted({r['probe'] for r in rows})
shapes = [s for s, _ in compose_models(probe_entries(names), ROOT / 'conf')]
plans = [(names.index(r['probe']), *map(int, r['mesh'].split('x')), r['chunks']) for r in rows]
est = probe_step_predictions(prof, topo, shapes, plans)
def fit(excl):
    keep = [i for i, r in enumerate(rows) if r['probe'] not in excl]
    return fit_cpu_step([est[i].cpu_s for i in keep], [rows[i]['measured_cpu_s'] for i in keep], [rows[i]['measured_s'] for i in keep],
                        [rows[i]['processes'] for i in keep], [tuple(map(int, rows[i]['mesh'].split('x'))) for i in keep], [rows[i]['chunks'] for i in keep])
forms = {'all': fit(()), 'no gpt2_b48': fit(('probe_gpt2_b48',)), 'no b48s': fit(('probe_gpt2_b48', 'probe_llama_b48', 'probe_gpt_s_b48'))}
for g in ('gb_a', 'gb_b'):
    data = json.loads((ROOT / f'docs/step_validation/{g}.json').read_text())['rows']
    keys = sorted({(r['model'], r['batch'], r['seq_len']) for r in data})
    built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, ROOT / 'conf')) for m, b, s in keys], ROOT / 'conf')
    shape = {k: s for k, (s, _) in zip(keys, built)}
    for f, cpu in forms.items():
        errs = {2: [], 4: []}
        for r in data:
            hs = r['host_speed']
            speed = HostSpeed(hs['compute'], hs['overhead'], '', 'steps', r['processes'])
            n, c = r['processes'], r['chunks']; mesh = tuple(map(int, r['mesh'].split('x')))
            p = dataclasses.replace(prof, step_residual=dataclasses.replace(prof.step_residual, anchored=cpu)).at_speed(speed)
            e = estimate_step(topo.restrict(n), shape[(r['model'], r['batch'], r['seq_len'])], mesh, StepSetting(chunks=c), p)
            errs[n].append(math.log(r['measured_s'] / e.step_s))
        allp = errs[2] + errs[4]
        rel = [abs(math.exp(-x) - 1) for x in allp]
        print(g, f"{f:12s} {100*statistics.median(rel):.1f}/{100*max(rel):.1f}  2p mean {statistics.fmean(errs[2]):+.3f} 4p mean {statistics.fmean(errs[4]):+.3f}")
