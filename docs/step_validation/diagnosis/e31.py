"""Diagnosis e31 (issue 27, after e30; development check, not a validation): the rank CPU's line with the framework's
dispatch apart.

e30: the chunks-2 cells of the validation models are predicted long and the chunks-1 cells short, consistently. The
run-35 line ``U = a·Û + b`` is fitted per process and chunk count on the probes, whose steps are mostly the framework's
dispatch (small kernels): where the probes' chunks-2 steps cost more CPU than priced (``a`` 1.2-1.5 against 1.0-1.1 at
chunks 1), ``a`` scales the validation models' whole predicted CPU, their kernels' compute included, which chunking
does not double. Here the predicted rank CPU split into the framework's dispatch ``D̂`` and the rest ``Û - D̂`` (the
timeline's ``dispatch``, re-predicted by the current code from each calibration's committed profile as e29 does) and
the probes' measured rank CPU fitted per process and chunk count as

- ``pooled``: ``U = a·Û + b`` (the code);
- ``dispatch``: ``U = a·(Û - D̂) + e·D̂ + b``;
- ``dispatch, a shared``: the same with ``a`` one per process count (every chunk count), ``e`` and ``b`` per chunk count;

the step per cell ``T = g·U + w`` either way; each grid's points predicted by all three (paired).

    python docs/step_validation/diagnosis/e31.py > docs/step_validation/diagnosis/e31.log
"""
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[2]))
import e29  # noqa: E402
from e25 import cell, line, probe_steps_of, rows_of, score  # noqa: E402

FORMS = ('pooled', 'dispatch', 'dispatch, a shared')


def parts(name, shape, mesh, chunks, processes, speed=None):
    """(Û, D̂): the predicted rank CPU and its framework dispatch, as estimate_step's timeline has them."""
    tl = e29.timeline(name, shape, mesh, chunks, processes, speed)
    return tl.compute + tl.coll_cpu, tl.dispatch


def rel_nnls(cols, u):
    a = np.array([[c / y for c in row] for row, y in zip(cols, u)])
    return nnls(a, np.ones(len(u)))[0]


def fit(probe, pp, form):
    steps, cpu = defaultdict(list), defaultdict(list)
    for r, (uh, d) in zip(probe, pp):
        steps[r['processes'], cell(r)].append((r['measured_cpu_s'], r['measured_s']))
        cpu[r['processes']].append((r['chunks'], uh, d, r['measured_cpu_s']))
    gw = {k: line(v) for k, v in steps.items()}
    coef = {}
    for n, pts in cpu.items():
        chunks = sorted({c for c, *_ in pts})
        if form == 'dispatch, a shared':
            x = rel_nnls([[uh - d] + [d if c == cc else 0.0 for cc in chunks] + [1.0 if c == cc else 0.0 for cc in chunks]
                          for c, uh, d, _ in pts], [u for *_, u in pts])
            for i, cc in enumerate(chunks):
                coef[n, cc] = (x[0], x[1 + i], x[1 + len(chunks) + i])
            continue
        for cc in chunks:
            q = [(uh, d, u) for c, uh, d, u in pts if c == cc]
            if form == 'pooled':
                a, b = line([(uh, u) for uh, _, u in q])
                coef[n, cc] = (a, a, b)
            else:
                coef[n, cc] = tuple(rel_nnls([[uh - d, d, 1.0] for uh, d, _ in q], [u for *_, u in q]))

    def pred(r, uh, d):
        ov = r['host_speed']['overhead'] if r.get('host_speed') else 1.0
        a, e, b = coef[r['processes'], r['chunks']]
        g, w = gw[r['processes'], cell(r)]
        return g * (a * (uh - d) + e * d + b * ov) + w * ov
    pred.coef = coef
    return pred


def main(parts=parts, what='Û and D̂', label='e31'):
    """Every grid's points under the three forms, ``parts`` giving each point's (Û, D̂) (e33 passes its own)."""
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.run.calibrate_compute import PROBES
    from benchmarks.step_validation import variant_overrides
    print(f'{label}: {len(e29.GRIDS_40)} grids (runs 22-40), no measurement; {what} re-predicted with the current code\n')
    res = {f: [] for f in FORMS}
    shown = set()
    for g in e29.GRIDS_40:
        name, probe = probe_steps_of(g)
        if any(r['probe'] not in PROBES for r in probe):
            continue
        try:
            profile_of(e29.topo_of(name))
        except ConfigError as err:  # runs 39-40's copies carry the reverted cpu_coll
            print(f"  {g:16s} skipped: the code as it stands does not read {name} ({str(err).split(': ')[-1]})")
            continue
        rows = rows_of(g)
        pp = [parts(name, e29.shape_of((r['probe'], tuple(PROBES[r['probe']]))), e29.mesh_of(r), r['chunks'],
                    r['processes']) for r in probe]
        rp = [parts(name, e29.shape_of((f"{r['model']}@{r['batch']}x{r['seq_len']}",
                                        tuple(variant_overrides(r['model'], r['batch'], r['seq_len'], e29.CONF)))),
                    e29.mesh_of(r), r['chunks'], r['processes'], r.get('host_speed')) for r in rows]
        s = {}
        for f in FORMS:
            p = fit(probe, pp, f)
            by = {id(r): p(r, uh, d) for r, (uh, d) in zip(rows, rp)}
            s[f] = score(rows, lambda r: by[id(r)])
            res[f].append(s[f])
            if f != 'pooled' and (name, f) not in shown:
                shown.add((name, f))
                print(f"  {name} {f}: " + '; '.join(f"{n}p c{c}: a {a:.2f} e {e:.2f} b {b * 1e3:.1f} ms"
                                                      for (n, c), (a, e, b) in sorted(p.coef.items())))
        print(f"  {g:16s} " + ' | '.join(
            f"{f} {s[f]['median']:5.1%} / {s[f]['worst']:5.1%}{' ok' if s[f]['ok'] else '   '}" for f in FORMS))
    print()
    for f, v in res.items():
        print(f"  {f:18s}: every target in {sum(x['ok'] for x in v):2d} of {len(v)} grids; mean worst "
              f"{np.mean([x['worst'] for x in v]):.3f}; median of the medians {np.median([x['median'] for x in v]):.3f}; "
              f"mean level {np.mean([x['level'] for x in v]):+.3f}; mean sd {np.mean([x['sd'] for x in v]):.3f}")
        r = v[-8:]
        print(f"  {f:18s} on runs 35-38 alone: every target in {sum(x['ok'] for x in r)} of {len(r)}; mean worst "
              f"{np.mean([x['worst'] for x in r]):.3f}")


if __name__ == '__main__':
    sys.exit(main())
