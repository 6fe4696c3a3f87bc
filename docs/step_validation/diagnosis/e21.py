"""Diagnosis e21 (issue 27, after runs 22-25; development check, not a validation): what a block of each layout costs.

The collective-free forward and backward (the calibration's own runner, `calibrate_compute._plan_runner`) of the
calibration's probes, of the three layouts at 1-3 blocks, and of the validation models at two batch x sequence points
already used (8x32, 2x128), on 2 processes (2x1, 1x2; chunks 1, 2), all in one launch and interleaved: a rank's CPU
(process_time, median of 12 rounds of 2 steps, the slower rank). Priced by run 25's framework (local_read4.yaml).

Part 1: per block (2 blocks minus 1) and the step's fixed part (1 block minus the per-block cost), measured and
        priced. Part 2: the framework's form fitted on these steps (relative least squares, as fit_framework) from
        the 6 probes of runs 12-25 or with the two-block transformers probes, the program listing the MLP activation
        as one kernel each way or as its operators (ModelShape.act_ops); the validation models' measured / fitted.

Run at commit 6c825c6 (the code of runs 26-27, which has ModelShape.act_ops; reverted after):

    python docs/step_validation/diagnosis/e21.py > docs/step_validation/diagnosis/e21.log
"""
import dataclasses, json, statistics as st, sys, time
from pathlib import Path
sys.path.insert(0, '.')
from atp_pipeline.run import calibrate_compute as C


def worker(rank, world, models, plans, reps):
    fns = [C._plan_runner(p, models, rank) for p in plans]
    for f in fns:
        f(); f()
    res = [[] for _ in plans]
    for _ in range(reps):
        for i, f in enumerate(fns):
            c0 = time.process_time(); f(); f(); res[i].append((time.process_time() - c0) / 2)
    return [st.median(x) for x in res]


def layers(name, n):
    key = 'model.layers=' if name == 'probe_gpt_s' else 'model.hf.num_hidden_layers='
    return tuple(f'{key}{n}' if x.startswith(key) else x for x in C.PROBES[name])


if __name__ == '__main__':
    import numpy as np
    from scipy.optimize import lsq_linear
    from atp_pipeline.launch import spawn
    from atp_pipeline.planning.compute_profile import profile_of
    from benchmarks.step_validation import load_calibrated, variant_overrides
    conf = Path('conf')
    BASE = ['probe_gpt_s', 'probe_gpt_m', 'probe_llama', 'probe_gpt2', 'probe_gpt_s_b48', 'probe_llama_b48']
    ent = [(n, C.PROBES[n]) for n in BASE]
    fam = {'probe_gpt_s': 'gpt_s', 'probe_llama': 'llama', 'probe_gpt2': 'gpt2'}
    ent += [(f'{fam[n]}_L{k}', layers(n, k)) for n in fam for k in (2, 3)]
    ent += [(f'{m}@{b}x{s}', variant_overrides(m, b, s, conf)) for m in ('llama_tiny', 'gpt2_tiny', 'small')
            for b, s in ((8, 32), (2, 128))]
    built = C.compose_models(ent, conf)
    plans = [(i, d1, d2, c) for i in range(len(ent)) for d1, d2 in ((2, 1), (1, 2)) for c in (1, 2)]
    res = spawn(worker, 2, [spec for _, spec in built], plans, 12, timeout=1800)
    T = {(ent[i][0], (d1, d2), c): max(r0, r1) for (i, d1, d2, c), r0, r1 in zip(plans, res[0], res[1])}
    shapes = {name: sh for (name, _), (sh, _) in zip(ent, built)}
    shapes.update({'gpt_s_L1': shapes['probe_gpt_s'], 'llama_L1': shapes['probe_llama'], 'gpt2_L1': shapes['probe_gpt2']})
    T.update({(f'{fam[n]}_L1', m, c): T[(n, m, c)] for n in fam for m in ((2, 1), (1, 2)) for c in (1, 2)})
    topo, _ = load_calibrated('docs/step_validation/local_read4.yaml', '', conf)
    prof = profile_of(topo)
    one = lambda sh: dataclasses.replace(sh, act_ops=(1, 1))
    priced = lambda sh, m, c: C.framework_seconds(prof.framework, C.plan_features(prof, sh, m, c))
    print("Part 1: a block and the step's fixed part, measured (ms, the host now) / priced by run 25's framework (the")
    print("activation as one kernel each way, as runs 22-25 priced it). Fixed = 1 block - per block; per block = 3 blocks - 1, halved.")
    for f in ('gpt_s', 'gpt2', 'llama'):
        for m in ((2, 1), (1, 2)):
            for c in (1, 2):
                t = [T[(f'{f}_L{k}', m, c)] for k in (1, 2, 3)]
                p = [priced(one(shapes[f'{f}_L{k}']), m, c) for k in (1, 2, 3)]
                bt, bp = (t[2] - t[0]) / 2, (p[2] - p[0]) / 2
                print(f"  {f:6s} {m[0]}x{m[1]} c{c}: measured {' '.join(f'{x*1e3:6.2f}' for x in t)}  priced {' '.join(f'{x*1e3:6.2f}' for x in p)}"
                      f"  | block {bt*1e3:5.2f} / {bp*1e3:5.2f} = {bt/bp:.2f}   fixed {(t[0]-bt)*1e3:5.2f} / {(p[0]-bp)*1e3:5.2f} = {(t[0]-bt)/(p[0]-bp):.2f}")
    print("\nPart 2: T = K(1+f) + n o + m a + B b + r p fitted over the probes' steps here; the validation models' measured / fitted")
    models = sorted({k[0] for k in T if '@' in k[0]})
    for probes in (BASE, BASE + ['llama_L2', 'gpt2_L2']):
        for how, tr in (('activation as 1 kernel', one), ('activation as its operators', lambda sh: sh)):
            rows = [(tr(shapes[n]), m, c, T[(n, m, c)]) for n in probes for m in ((2, 1), (1, 2)) for c in (1, 2)]
            A = np.array([C.plan_features(prof, sh, m, c) for sh, m, c, _ in rows], dtype=float)
            y = np.array([t for *_, t in rows])
            x = lsq_linear(A / y[:, None], np.ones(len(y)), bounds=([0.5, 0, 0, 0, 0], np.inf)).x
            fit = [abs(float(a @ x) / t - 1) for a, t in zip(A, y)]
            by = {}
            for n in models:
                for m in ((2, 1), (1, 2)):
                    for c in (1, 2):
                        sh = tr(shapes[n])
                        by.setdefault(f"{n.split('@')[0]} {m[0]}x{m[1]}", []).append(
                            T[(n, m, c)] / float(np.array(C.plan_features(prof, sh, m, c)) @ x))
            allv = [v for vs in by.values() for v in vs]
            print(f"  {len(probes)} probes, {how}: f {x[0]-1:+.2f}, o {x[1]*1e6:.0f} us, a {x[2]*1e6:.0f} us, p {x[4]*1e6:.0f} us; "
                  f"probes' fit error median {st.median(fit):.1%}, worst {max(fit):.1%}")
            print(f"      models measured / fitted {min(allv):.2f}-{max(allv):.2f} (sd of log {np.std(np.log(allv)):.3f}); per model and mesh, median: "
                  + ', '.join(f"{k} {st.median(v):.2f}" for k, v in sorted(by.items())))
