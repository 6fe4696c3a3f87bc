"""Offline: the rank CPU's model per cell (line vs alternatives); the step's ratio/wait as calibrated."""
import dataclasses, glob, hashlib, json, math, statistics, sys, warnings
from pathlib import Path
import numpy as np
ROOT = Path(__file__).resolve().parents[4]; sys.path.insert(0, str(ROOT)); warnings.filterwarnings('ignore')
from atp_pipeline.planning.compute_profile import HostSpeed, profile_of, cell_key
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run.calibrate_compute import compose_models, fit_cpu_step, probe_entries, probe_step_predictions, _line
from benchmarks.step_validation import load_calibrated, variant_overrides
SV = ROOT / 'docs/step_validation'
RECENT = ("la", "lb", "at1", "at2", "at3", "inl1", "inl2", "ln1", "ln2", "cell1", "cell2")
def fig(logs):
    rel = [abs(math.exp(-x) - 1) for x in logs]
    return f"{100*statistics.median(rel):.1f}/{100*max(rel):.1f}"
def m_line(pts):
    a, b = _line(pts); return lambda x: a * x + b
def m_origin(pts):
    a = statistics.median(y / x for x, y in pts); return lambda x: a * x
def m_power(pts):
    X = np.log([x for x, _ in pts]); Y = np.log([y for _, y in pts])
    beta, alpha = np.polyfit(X, Y, 1); return lambda x: math.exp(alpha + beta * math.log(x))
def m_top(pts):  # ratio of the larger half of the probes
    s = sorted(pts); top = s[len(s)//2:]
    a = statistics.median(y / x for x, y in top); return lambda x: a * x
def m_lineabs(pts):
    A = np.array([[x, 1.0] for x, _ in pts]); Y = np.array([y for _, y in pts])
    from atp_pipeline.planning.lstsq import nnls
    a, b = nnls(A, Y); return lambda x: a * x + b
MODELS = {'line': m_line, 'origin': m_origin, 'power': m_power, 'top': m_top, 'lineabs': m_lineabs}
errs = {f: {} for f in MODELS}
for tag in RECENT:
    y = SV / f'local_{tag}.yaml'
    sha = hashlib.sha256(y.read_bytes()).hexdigest()[:12]
    grids = [g for g in sorted(glob.glob(str(SV / '*.json'))) if f'sha256 {sha}' in Path(g).read_text()]
    topo, _ = load_calibrated(str(y), '', ROOT / 'conf'); prof = profile_of(topo)
    rows = json.loads((SV / f'local_{tag}_probe_steps.json').read_text())['rows']
    names = sorted({r['probe'] for r in rows})
    shapes = [s for s, _ in compose_models(probe_entries(names), ROOT / 'conf')]
    plans = [(names.index(r['probe']), *map(int, r['mesh'].split('x')), r['chunks']) for r in rows]
    est = probe_step_predictions(prof, topo, shapes, plans)
    u, t = [r['measured_cpu_s'] for r in rows], [r['measured_s'] for r in rows]
    procs, chunks = [r['processes'] for r in rows], [r['chunks'] for r in rows]
    meshes = [tuple(map(int, r['mesh'].split('x'))) for r in rows]
    cpu = fit_cpu_step([e.cpu_s for e in est], u, t, procs, meshes, chunks)
    pts = {}
    for e, uu, n, m, c in zip(est, u, procs, meshes, chunks):
        pts.setdefault((n, cell_key(m, c)), []).append((e.cpu_s, uu))
    fitted = {f: {k: fn(v) for k, v in pts.items()} for f, fn in MODELS.items()}
    for g in grids:
        data = json.loads(Path(g).read_text())['rows']
        keys = sorted({(r['model'], r['batch'], r['seq_len']) for r in data})
        built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, ROOT / 'conf')) for m, b, s in keys], ROOT / 'conf')
        shape = {k: s for k, (s, _) in zip(keys, built)}
        for f in errs: errs[f][Path(g).stem] = {2: [], 4: []}
        for r in data:
            if r.get('class', 'real') != 'real' or r.get('in_sample'): continue
            hs = r.get('host_speed_in_launch') or r.get('host_speed')
            speed = HostSpeed(hs['compute'], hs['overhead'], '', 'steps', r['processes']) if hs else None
            n, c = r['processes'], r['chunks']; mesh = tuple(map(int, r['mesh'].split('x')))
            p = dataclasses.replace(prof, step_residual=dataclasses.replace(prof.step_residual, anchored=cpu))
            p = p.at_speed(speed) if speed else p
            e = estimate_step(topo.restrict(n), shape[(r['model'], r['batch'], r['seq_len'])], mesh, StepSetting(chunks=c), p)
            an = p.step_residual.anchored
            a, b = an.line(n, mesh, c)
            g_, w_ = an.ratio[n][cell_key(mesh, c)], an.wait.get(n, {}).get(cell_key(mesh, c), 0.0)
            ov = hs['overhead'] if hs else 1.0
            base_line = prof.step_residual.anchored  # unused
            for f in errs:
                fn = fitted[f][(n, cell_key(mesh, c))]
                # the line's offset b at host speed: scale the model's output difference by speed like at_speed does
                if f == 'line':
                    uhat = a * e.cpu_s + b
                else:
                    uhat = fn(e.cpu_s)
                pred = g_ * uhat + w_
                errs[f][Path(g).stem][n].append(math.log(r['measured_s'] / pred))
for f, per in errs.items():
    ok = 0; allp = []; p2 = []; p4 = []
    line = []
    for g, v in per.items():
        pts_ = v[2] + v[4]; allp += pts_; p2 += v[2]; p4 += v[4]
        w = max(abs(math.exp(-x) - 1) for x in pts_); ok += w <= 0.25
        line.append(f"{g} {fig(pts_)}")
    print(f"{f:8s} all {fig(allp)} rms {math.sqrt(statistics.fmean(x*x for x in allp)):.3f}; 2p {statistics.fmean(p2):+.3f}/{math.sqrt(statistics.fmean(x*x for x in p2)):.3f} 4p {statistics.fmean(p4):+.3f}/{math.sqrt(statistics.fmean(x*x for x in p4)):.3f}; ok {ok}/{len(per)}")
    print('   ', ' | '.join(line))
