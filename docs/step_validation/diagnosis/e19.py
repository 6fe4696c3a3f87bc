"""Diagnosis e19 (issue 27, after runs 16-21; arithmetic on committed files, no timing; development checks, not
validations: every grid below was seen before these were run).

Part 1: a collective's backend CPU per call and byte as each calibration's pure loops fitted it.
Part 2: runs 18-21's grids predicted again with the CPU form re-fitted on each run's own probe steps and the
        collectives' CPU replaced by fixed prices: how far the grids move with that one term.
Part 3: other shapes of the CPU form's rank-CPU correction on the same probe steps and grids: an offset only, a
        factor only, and a factor per layout style (the probes' style as the validation model's).

    python docs/step_validation/diagnosis/e19.py > docs/step_validation/diagnosis/e19.log
"""
import json, statistics as st, sys, yaml, numpy as np
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, '.')
from atp_pipeline.planning import steptime as S
from atp_pipeline.planning.compute_profile import profile_of, CollectiveCPU
from atp_pipeline.planning.lstsq import nnls
from atp_pipeline.run.calibrate_compute import compose_models, PROBES
from benchmarks.step_validation import load_calibrated, variant_overrides

conf, SV = Path('conf'), 'docs/step_validation'
RUNS = [('18', 'local_anch3', ['steps_anch5', 'steps_anch6']), ('19', 'local_anch4', ['steps_anch7', 'steps_anch8']),
        ('20', 'local_loop1', ['steps_loop1', 'steps_loop2']), ('21', 'local_loop2', ['steps_loop3', 'steps_loop4'])]
compute = lambda f: yaml.safe_load(open(f'{SV}/{f}.yaml'))['device']['compute']

print("Part 1: the pure-loop fit of a collective's backend CPU (a rank's CPU a call + a byte)")
for f in ['local_resid', 'local_resid2', 'local_resid3', 'local_resid4', 'local_anch', 'local_anch2', 'local_anch3',
          'local_anch4', 'local_loop1', 'local_loop2']:
    cc = compute(f).get('collective_cpu')
    if cc:
        print(f"  {f:13s} 2 ranks {cc['per_call_us'][2]:5.0f} us + {cc['per_byte_ns'][2]:.3f} ns/B   "
              f"4 ranks {cc['per_call_us'][4]:5.0f} us + {cc['per_byte_ns'][4]:.3f} ns/B")
print("  (local_loop1/2: runs 20-21, loops at 1 KiB-1 MiB, 4x the calls a pass; the others: 16 KiB-1 MiB)")


def rank_cpu(prof, topo, sh, mesh, c, P):
    prog, _ = S.build_program(sh, mesh, sh.batch_size, c)
    clock = S.CommClock(topo.restrict(P), mesh, sh.bytes_per_element, None, prof.comm_factor(P))
    tl = S._run(prog, clock, prof, sh.bytes_per_element, prof.timeline_factor(P), prof.sync_factor(P), prof.skewed(P))
    return tl.compute + tl.coll_cpu


DATA = []
for run, f, grids in RUNS:
    topo, _ = load_calibrated(f'{SV}/{f}.yaml', '', conf)
    prof, sr = profile_of(topo), compute(f)['step_residual']
    probes = json.load(open(f'{SV}/{f}_probe_steps.json'))['rows']
    names = sorted({r['probe'] for r in probes})
    psh = dict(zip(names, [s for s, _ in compose_models([(n, PROBES[n]) for n in names], conf)]))
    for r in probes:
        r['sh'] = psh[r['probe']]
    rows = []
    for t in grids:
        rs = [r for r in json.load(open(f'{SV}/{t}.json'))['rows'] if r['class'] == 'real']
        keys = sorted({(r['model'], r['batch'], r['seq_len']) for r in rs})
        shp = dict(zip(keys, [s for s, _ in compose_models(
            [(f"{m}@{b}x{s}", variant_overrides(m, b, s, conf)) for m, b, s in keys], conf)]))
        for r in rs:
            r['t'], r['sh'] = t, shp[(r['model'], r['batch'], r['seq_len'])]
        rows += rs
    DATA.append((run, topo, prof, sr, probes, rows))
mesh_of = lambda r: tuple(int(x) for x in r['mesh'].split('x'))
PC = lambda r: (r['processes'], r['chunks'])


def ab_fit(pairs):  # U = a*U_hat + b, relative NNLS (the CPU form's fit)
    return tuple(nnls(np.array([[u / m, 1 / m] for u, m in pairs]), np.ones(len(pairs))))


def step_err(sr, r, cpu):
    return abs(sr['cpu_ratio'][r['processes']][f"{r['mesh']}/c{r['chunks']}"] * cpu / r['measured_s'] - 1)


def line(errs_by_grid):
    cells = [f"{t[6:]} {st.median(e):4.1%}/{max(e):4.1%}" for t, e in errs_by_grid]
    ok = sum(st.median(e) <= 0.10 and max(e) <= 0.25 for _, e in errs_by_grid)
    return ' | '.join(cells) + f"   targets in {ok} of {len(errs_by_grid)}"


print("\nPart 2: the step error (median/worst per grid), the CPU form re-fitted on each run's probe steps, the")
print("collectives' CPU priced as given (us a call and ns a byte at 2 / 4 ranks)")


def part2(cc):
    out = []
    for run, topo, prof, sr, probes, rows in DATA:
        p2 = prof if cc is None else replace(prof, collective_cpu=CollectiveCPU({}, *cc))
        g = {}
        for r in probes:
            g.setdefault(PC(r), []).append((rank_cpu(p2, topo, r['sh'], mesh_of(r), r['chunks'], r['processes']),
                                            r['measured_cpu_s']))
        W = {k: ab_fit(v) for k, v in g.items()}
        for t in sorted({r['t'] for r in rows}):
            e = []
            for r in (r for r in rows if r['t'] == t):
                args = (r['sh'], mesh_of(r), r['chunks'], r['processes'])
                speed = r['predicted_rank_cpu_s'] / rank_cpu(prof, topo, *args)  # the grid's re-timed host speed
                a, b = W[PC(r)]
                e.append(step_err(sr, r, a * speed * rank_cpu(p2, topo, *args) + b))
            out.append((t, e))
    return line(out)


print(f"  {'as calibrated':24s}", part2(None))
for c2, c4, b2, b4 in [(330, 1070, 0.45, 0.20), (420, 1000, 0.60, 0.50), (250, 800, 0.45, 0.20), (400, 1300, 0.45, 0.20)]:
    print(f"  {f'{c2}/{c4} us {b2}/{b4} ns':24s}",
          part2(({2: c2 * 1e-6, 4: c4 * 1e-6}, {2: b2 * 1e-9, 4: b4 * 1e-9})))

print("\nPart 3: other shapes of the rank-CPU correction (the predicted rank CPU as the grid recorded it)")
STYLE = {'probe_gpt_s': 'gpt', 'probe_gpt_s_b48': 'gpt', 'probe_gpt_m': 'gpt', 'probe_llama': 'llama',
         'probe_llama_b48': 'llama', 'probe_gpt2': 'gpt2', 'llama_tiny': 'llama', 'gpt2_tiny': 'gpt2', 'small': 'gpt'}


def part3(how, style_key=None):
    out = []
    for run, topo, prof, sr, probes, rows in DATA:
        g = {}
        for r in probes:
            g.setdefault(PC(r), []).append(r)
        W = {}
        for k, v in g.items():
            U, P = np.array([r['measured_cpu_s'] for r in v]), np.array([r['cpu_s'] for r in v])
            W[k] = {'a, b (as run)': ab_fit(list(zip(P, U))), 'offset only': (1.0, max(0.0, float(np.median(U - P)))),
                    'factor only': (float(np.median(U / P)), 0.0)}[how]
        fac = {}
        if style_key:
            for r in probes:
                a, b = W[PC(r)]
                fac.setdefault((STYLE[r['probe']], style_key(r)), []).append(r['measured_cpu_s'] / (a * r['cpu_s'] + b))
        for t in sorted({r['t'] for r in rows}):
            e = []
            for r in (r for r in rows if r['t'] == t):
                a, b = W[PC(r)]
                f = st.median(fac[(STYLE[r['model']], style_key(r))]) if style_key else 1.0
                e.append(step_err(sr, r, f * (a * r['predicted_rank_cpu_s'] + b)))
            out.append((t, e))
    return line(out)


for how in ['a, b (as run)', 'offset only', 'factor only']:
    print(f"  {how:34s}", part3(how))
for name, key in [('P', lambda r: r['processes']), ('P, chunks', PC), ('P, mesh', lambda r: (r['processes'], r['mesh'])),
                  ('P, mesh, chunks', lambda r: (r['processes'], r['mesh'], r['chunks']))]:
    print(f"  {'a, b and a factor per style, ' + name:34s}", part3('a, b (as run)', key))

print("\nThe rank CPU measured / predicted (before the correction) per probe and model, per cell, median over the runs")
tab = {}
for run, topo, prof, sr, probes, rows in DATA:
    for r in probes:
        tab.setdefault((r['processes'], r['mesh'], r['chunks']), {}).setdefault(r['probe'].replace('probe_', ''), []).append(
            r['measured_cpu_s'] / r['cpu_s'])
    for r in rows:
        tab.setdefault((r['processes'], r['mesh'], r['chunks']), {}).setdefault(r['model'], []).append(
            r['measured_rank_cpu_s'] / r['predicted_rank_cpu_s'])
for cell, d in sorted(tab.items()):
    print(f"  {cell[0]} proc. {cell[1]}/c{cell[2]} ", '  '.join(f"{m} {st.median(v):.2f}" for m, v in sorted(d.items())))
