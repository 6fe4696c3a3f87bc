"""Offline: 2-process kernel prices (k24.json ratios) for 2-process rows; lines refit."""
import dataclasses, glob, hashlib, json, math, statistics, sys, warnings
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT)); warnings.filterwarnings('ignore')
from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run.calibrate_compute import compose_models, fit_cpu_step, probe_entries, probe_step_predictions
from benchmarks.step_validation import load_calibrated, variant_overrides
SV = ROOT / 'docs/step_validation'
RECENT = ("la", "lb", "at1", "at2", "at3", "inl1", "inl2", "ln1", "ln2", "cell1", "cell2")
k24 = json.load(open(str(Path(__file__).with_name('kernels_2v4.json'))))
KINDS = sys.argv[1].split(',') if len(sys.argv) > 1 else None
ratio = {(k, tuple(d)): c2 / c4 for k, d, c2, c4 in k24 if KINDS is None or k in KINDS}
def scaled(prof):
    return dataclasses.replace(prof, points={k: t * ratio.get(k, 1.0) for k, t in prof.points.items()})
def fig(logs):
    rel = [abs(math.exp(-x) - 1) for x in logs]
    return f"{100*statistics.median(rel):.1f}/{100*max(rel):.1f}"
errs = {'base': {}, 'k2': {}}
for tag in RECENT:
    y = SV / f'local_{tag}.yaml'
    sha = hashlib.sha256(y.read_bytes()).hexdigest()[:12]
    grids = [g for g in sorted(glob.glob(str(SV / '*.json'))) if f'sha256 {sha}' in Path(g).read_text()]
    topo, _ = load_calibrated(str(y), '', ROOT / 'conf'); prof = profile_of(topo)
    rows = json.loads((SV / f'local_{tag}_probe_steps.json').read_text())['rows']
    names = sorted({r['probe'] for r in rows})
    shapes = [s for s, _ in compose_models(probe_entries(names), ROOT / 'conf')]
    plans = [(names.index(r['probe']), *map(int, r['mesh'].split('x')), r['chunks']) for r in rows]
    u, t = [r['measured_cpu_s'] for r in rows], [r['measured_s'] for r in rows]
    procs, chunks = [r['processes'] for r in rows], [r['chunks'] for r in rows]
    meshes = [tuple(map(int, r['mesh'].split('x'))) for r in rows]
    p2 = scaled(prof)
    profs = {'base': prof, 'k2': p2}
    cpus = {}
    for f, pp in profs.items():
        est = probe_step_predictions(pp, topo, shapes, plans)
        est0 = probe_step_predictions(prof, topo, shapes, plans)
        uh = [(e.cpu_s if n == 2 else e0.cpu_s) for e, e0, n in zip(est, est0, procs)]
        cpus[f] = fit_cpu_step(uh, u, t, procs, meshes, chunks)
    for g in grids:
        data = json.loads(Path(g).read_text())['rows']
        keys = sorted({(r['model'], r['batch'], r['seq_len']) for r in data})
        built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, ROOT / 'conf')) for m, b, s in keys], ROOT / 'conf')
        shape = {k: s for k, (s, _) in zip(keys, built)}
        for f in errs:
            errs[f][Path(g).stem] = {2: [], 4: []}
        for r in data:
            if r.get('class', 'real') != 'real' or r.get('in_sample'):
                continue
            hs = r.get('host_speed_in_launch') or r.get('host_speed')
            speed = HostSpeed(hs['compute'], hs['overhead'], '', 'steps', r['processes']) if hs else None
            n, c = r['processes'], r['chunks']; mesh = tuple(map(int, r['mesh'].split('x')))
            for f in errs:
                pp = profs[f] if n == 2 else prof
                p = dataclasses.replace(pp, step_residual=dataclasses.replace(prof.step_residual, anchored=cpus[f]))
                p = p.at_speed(speed) if speed else p
                e = estimate_step(topo.restrict(n), shape[(r['model'], r['batch'], r['seq_len'])], mesh, StepSetting(chunks=c), p)
                errs[f][Path(g).stem][n].append(math.log(r['measured_s'] / e.step_s))
for f, per in errs.items():
    ok = 0; allp = []; p2 = []
    line = []
    for g, v in per.items():
        pts = v[2] + v[4]; allp += pts; p2 += v[2]
        w = max(abs(math.exp(-x) - 1) for x in pts); ok += w <= 0.25
        line.append(f"{g} {fig(pts)} (2p {statistics.fmean(v[2]):+.3f})")
    print(f, f"all {fig(allp)} rms {math.sqrt(statistics.fmean(x*x for x in allp)):.3f}; 2p mean {statistics.fmean(p2):+.3f} rms {math.sqrt(statistics.fmean(x*x for x in p2)):.3f}; ok {ok}/{len(per)}")
    print('   ', ' | '.join(line))
