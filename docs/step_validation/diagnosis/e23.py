"""Diagnosis e23 (issue 27, after run 29 and e22; development check, not a validation): what the framework's
per-kernel price stands for.

e21 found every block priced above its CPU (measured / priced 0.53-0.85) and every step's fixed part below it,
and e22 the transformers models' chunks-2 cells predicted longest (-9 to -12 %). The framework's form
``T = K(1+f) + n o + m a + B b + r p`` has no term for what a step pays once (the model's own forward call,
its masks and positions, the loss, ``backward()``) nor for what a block pays per chunk (a module call, a
coroutine's turns) beyond its listed kernels: the fit can only put those into ``o``.

Part A (measure; one launch per process count, as the calibration runs its probes: every process at once):
the collective-free forward and backward (``calibrate_compute._plan_runner``) of the calibration's six probes,
of the three one-block probes at 2 and 3 blocks, and of the validation models at two batch x sequence points
already used (8x32, 2x128); 4 processes on 4x1/2x2/1x4 and 2 processes on 2x1/1x2, chunks 1 and 2; a rank's
CPU (process_time), median of 8 rounds of 2 steps, the mean over the ranks (as the calibration). Raw: e23.json.

Part B (arithmetic on e23.json): forms of the framework fitted on the six probes' steps (relative least squares,
f >= -0.5, the rest >= 0, as fit_framework), and on those with the two-block transformers probes, at each process
count: F0 the form of runs 12-29, F1 with a cost once a step, F2 with a cost per block and chunk, F3 with both;
the probes' fit error, and the validation models' measured / fitted per model and per cell (out of sample for the
fit). Written before run 30 (the code of which is F3 with the two-block probes); it reads plan_features' first
five terms, so it runs at any commit since.

    python docs/step_validation/diagnosis/e23.py measure   # Part A -> e23.json (~10 min, exclusive CPU lock)
    python docs/step_validation/diagnosis/e23.py > docs/step_validation/diagnosis/e23.log
"""
import json, statistics as st, sys, time
from pathlib import Path
sys.path.insert(0, '.')
sys.path.insert(0, str(Path(__file__).parent))
from atp_pipeline.run import calibrate_compute as C
from e21 import layers, worker  # e21's runner of the calibration's collective-free steps, and its block counts

OUT = Path(__file__).with_name('e23.json')
BASE = ['probe_gpt_s', 'probe_gpt_m', 'probe_llama', 'probe_gpt2', 'probe_gpt_s_b48', 'probe_llama_b48']
FAM = {'probe_gpt_s': 'gpt_s', 'probe_llama': 'llama', 'probe_gpt2': 'gpt2'}
MESHES = {4: ((4, 1), (2, 2), (1, 4)), 2: ((2, 1), (1, 2))}
POINTS = ((8, 32), (2, 128))


def entries(conf):
    from benchmarks.step_validation import variant_overrides
    ent = [(n, C.PROBES[n]) for n in BASE]
    ent += [(f'{FAM[n]}_L{k}', layers(n, k)) for n in FAM for k in (2, 3)]
    ent += [(f'{m}@{b}x{s}', variant_overrides(m, b, s, conf)) for m in ('llama_tiny', 'gpt2_tiny', 'small')
            for b, s in POINTS]
    return ent


def measure():
    from atp_pipeline.launch import spawn
    conf = Path('conf')
    ent = entries(conf)
    built = C.compose_models(ent, conf)
    rows = []
    for world in (4, 2):
        plans = [(i, d1, d2, c) for i in range(len(ent)) for d1, d2 in MESHES[world] for c in (1, 2)]
        t0 = time.time()
        res = spawn(worker, world, [spec for _, spec in built], plans, 8, timeout=2400)
        print(f'{world} processes: {len(plans)} plans in {time.time() - t0:.0f} s', file=sys.stderr)
        for j, (i, d1, d2, c) in enumerate(plans):
            rows.append({'name': ent[i][0], 'overrides': list(ent[i][1]), 'processes': world, 'mesh': [d1, d2],
                         'chunks': c, 'rank_cpu_s': [r[j] for r in res]})
    OUT.write_text(json.dumps({'date': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'rows': rows}, indent=1))



def analyse():
    import dataclasses
    import numpy as np
    from scipy.optimize import lsq_linear
    from atp_pipeline.planning.compute_profile import profile_of
    from benchmarks.step_validation import load_calibrated
    conf = Path('conf')
    data = json.loads(OUT.read_text())
    ent = entries(conf)
    shapes = {name: sh for (name, _), (sh, _) in zip(ent, C.compose_models(ent, conf))}
    topo, _ = load_calibrated('docs/step_validation/local_read5.yaml', '', conf)
    prof = profile_of(topo)
    T = {(r['name'], r['processes'], tuple(r['mesh']), r['chunks']): st.mean(r['rank_cpu_s']) for r in data['rows']}
    print(f"e23 (measured {data['date']}); priced with local_read5.yaml's kernels (run 28)")

    def feats(sh, m, c, form):
        k, n, mm, b, r = C.plan_features(prof, sh, m, c)[:5]
        extra = {'F0': [], 'F1 +step': [1.0], 'F2 +block-chunk': [sh.layers * c],
                 'F3 +step +block-chunk': [1.0, sh.layers * c]}[form]
        return [k, n, mm, b, r, *extra]
    print("\nPart 0: per block (3 blocks - 1, halved) and the fixed part (1 block - per block), rank CPU ms")
    for P in (4, 2):
        for f in ('gpt_s', 'gpt2', 'llama'):
            for m in MESHES[P]:
                for c in (1, 2):
                    base = {'gpt_s': 'probe_gpt_s', 'gpt2': 'probe_gpt2', 'llama': 'probe_llama'}[f]
                    t = [T[(base if k == 1 else f'{f}_L{k}', P, m, c)] for k in (1, 2, 3)]
                    blk = (t[2] - t[0]) / 2
                    print(f"  {P}p {f:6s} {m[0]}x{m[1]} c{c}: {' '.join(f'{x*1e3:6.2f}' for x in t)}  block {blk*1e3:5.2f}"
                          f"  fixed {(t[0]-blk)*1e3:5.2f}")
    print("\nPart B: forms fitted on the probes' steps (per process count); validation models' measured / fitted")
    models = [n for n, _ in ent if '@' in n]
    for probes, label in ((BASE, 'the six probes'), (BASE + ['llama_L2', 'gpt2_L2'], 'the six probes and the two-block transformers probes')):
        print(f" fitted on {label}")
        for P in (4, 2):
            for form in ('F0', 'F1 +step', 'F2 +block-chunk', 'F3 +step +block-chunk'):
                rows = [(shapes[n], m, c, T[(n, P, m, c)]) for n in probes for m in MESHES[P] for c in (1, 2)]
                A = np.array([feats(sh, m, c, form) for sh, m, c, _ in rows], dtype=float)
                y = np.array([t for *_, t in rows])
                lo = [0.5] + [0.0] * (A.shape[1] - 1)
                x = lsq_linear(A / y[:, None], np.ones(len(y)), bounds=(lo, np.inf)).x
                fit = [abs(float(a @ x) / t - 1) for a, t in zip(A, y)]
                by, cell = {}, {}
                for n in models:
                    for m in MESHES[P]:
                        for c in (1, 2):
                            v = T[(n, P, m, c)] / float(np.array(feats(shapes[n], m, c, form)) @ x)
                            by.setdefault(n.split('@')[0], []).append(v)
                            cell.setdefault(f"{n.split('@')[0].split('_')[0]} {m[0]}x{m[1]}/c{c}", []).append(v)
                allv = np.log([v for vs in by.values() for v in vs])
                names = ['f', 'o', 'a', 'b', 'p', *form.split(' ')[1:]]
                terms = ', '.join(f"{nm} {x[i]-1:+.2f}" if nm == 'f' else f"{nm} {x[i]*1e6:.0f} us" for i, nm in enumerate(names) if nm != 'b')
                print(f"  {P}p {form:22s}: {terms}; probes' error median {st.median(fit):.1%}, worst {max(fit):.1%}")
                print(f"      models: sd of log {np.std(allv):.3f}, worst |log| {np.max(np.abs(allv)):.3f}; per model median "
                      + ', '.join(f"{k} {st.median(v):.2f}" for k, v in by.items()))
                print("      per cell (mean of its 2 points): " + ', '.join(f"{k} {st.mean(v):.2f}" for k, v in cell.items()))


if __name__ == '__main__':
    if sys.argv[1:] == ['measure']:
        measure()
    else:
        analyse()
