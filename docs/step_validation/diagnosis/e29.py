"""Diagnosis e29 (issue 27, after e28; development check, not a validation): the rank CPU's collectives priced per
mesh from the probes' own steps.

e26: inside a step, a 2x2 chunks-2 step's collective calls cost a rank less CPU each than the pure loops price them
(and 4x1's what they price); e28: a line ``U = a·Û + b`` per cell instead of per chunk count does not fix it (the
compute and the collectives' CPU share one slope). Here the model's rank CPU is split into its two parts as the code
now predicts them (``Û = Ûc + Ûk``: the timeline's compute, and its collectives' backend CPU) and the probes' measured
rank CPU fitted as ``U = a·Ûc + k[mesh]·Ûk + b`` per (processes, chunks) — the collectives' CPU scaled per mesh —
against the pooled line of the code as it stands (``U = a·Û + b``); the step per cell ``T = g·U + w`` either way.
Arithmetic on the committed grids and the probe steps of each one's calibration (matched by SHA-256 as in e25):
both parts re-predicted with the current code from the calibration's committed profile, a grid row's at the host's
speed its prediction used (the CPU lines' offsets ``b`` and ``w`` scaled by its per-call speed, as the code does).

    python docs/step_validation/diagnosis/e29.py > docs/step_validation/diagnosis/e29.log
    python docs/step_validation/diagnosis/e29.py --grids steps_coll1,steps_coll2   # run 39 on: paired, the code's fits

``--grids`` runs the code's own ``fit_cpu_step`` with the collectives' CPU per cell: the code of runs 39-40 (29e8ace),
reverted after them by their rule (``run39_rule.txt``); at a later commit only the main mode runs.
"""
import dataclasses
import math
import statistics as st
import sys
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[2]))
from e25 import GRIDS as OLD, cell, line, probe_steps_of, rows_of, score  # noqa: E402

GRIDS = OLD + ['steps_wait%d' % i for i in range(1, 5)] + ['steps_calls%d' % i for i in range(1, 5)]
GRIDS_40 = GRIDS + ['steps_coll%d' % i for i in range(1, 5)]  # with runs 39-40 (e31)
CONF = HERE.parents[2] / 'conf'


@lru_cache(maxsize=None)
def topo_of(name):
    from benchmarks.step_validation import load_calibrated
    return load_calibrated(str(HERE.parent / name), '', CONF)[0]


@lru_cache(maxsize=None)
def shape_of(entry):
    from atp_pipeline.run import calibrate_compute as C
    name, over = entry
    return C.compose_models([(name, list(over))], CONF)[0][0]


def timeline(name, shape, mesh, chunks, processes, speed=None):
    """The step timeline estimate_step runs for ``shape`` on ``mesh`` (``name``'s committed profile on ``processes``;
    ``speed``: a grid row's ``host_speed``, the profile at it as the row's prediction was)."""
    from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
    from atp_pipeline.planning.step_program import build_program
    from atp_pipeline.planning.steptime import CommClock, _run
    topo = topo_of(name).restrict(processes)
    prof = profile_of(topo)
    if speed:
        prof = prof.at_speed(HostSpeed(float(speed['compute']), float(speed['overhead']), ''))
    prog, _ = build_program(shape, mesh, shape.batch_size, chunks)
    clock = CommClock(topo, mesh, shape.bytes_per_element, None, prof.comm_factor(processes))
    return _run(prog, clock, prof, shape.bytes_per_element, prof.timeline_factor(processes), prof.sync_factor(processes),
                prof.skewed(processes))


def parts(name, shape, mesh, chunks, processes, speed=None):
    """(the timeline's compute, its collectives' backend CPU) as estimate_step predicts them."""
    tl = timeline(name, shape, mesh, chunks, processes, speed)
    return tl.compute, tl.coll_cpu


def mesh_of(r):
    return tuple(int(x) for x in r['mesh'].split('x'))


def probe_parts(name, probe):
    from atp_pipeline.run import calibrate_compute as C
    out = []
    for r in probe:
        sh = shape_of((r['probe'], tuple(C.PROBES[r['probe']])))
        out.append(parts(name, sh, mesh_of(r), r['chunks'], r['processes']))
    return out


def row_parts(name, rows):
    from benchmarks.step_validation import variant_overrides
    return [parts(name, shape_of((f"{r['model']}@{r['batch']}x{r['seq_len']}",
                                  tuple(variant_overrides(r['model'], r['batch'], r['seq_len'], CONF)))),
                  mesh_of(r), r['chunks'], r['processes'], r.get('host_speed')) for r in rows]


def fit(probe, pp, form, floor=False):
    """Per (processes, chunks) the rank CPU's fit; per cell the step's line."""
    cpu, steps = defaultdict(list), defaultdict(list)
    for r, (c, k) in zip(probe, pp):
        cpu[r['processes'], r['chunks']].append((r['mesh'], c, k, r['measured_cpu_s']))
        steps[r['processes'], cell(r)].append((r['measured_cpu_s'], r['measured_s']))
    gw = {key: line(v) for key, v in steps.items()}
    if floor:  # the step's slope on the rank CPU fixed at the host's floor (processes / cores, at least 1): a wait per cell
        for (n, c), v in steps.items():
            h = max(1.0, n / 2)
            gw[n, c] = (h, sum((t - h * u) / t ** 2 for u, t in v) / sum(1 / t ** 2 for u, t in v))
    coef = {}
    for key, pts in cpu.items():
        if form == 'pooled':
            coef[key] = ('pooled', line([(c + k, u) for _, c, k, u in pts]))
            continue
        meshes = sorted({m for m, *_ in pts})
        if form == 'corrected':  # the pooled line, then per mesh the factor of its collectives' CPU on the residual
            a0, b0 = line([(c + k, u) for _, c, k, u in pts])
            ks = {}
            for mm in meshes:
                q = [(c, k, u) for m, c, k, u in pts if m == mm]
                num = sum((u - a0 * (c + k) - b0) * a0 * k / u ** 2 for c, k, u in q)
                den = sum((a0 * k / u) ** 2 for c, k, u in q)
                ks[mm] = a0 * max(0.0, 1.0 + (num / den if den > 0 else 0.0))
            coef[key] = ('split', (a0, ks, b0))
            continue
        a = np.array([[c / u] + [k / u if m == mm else 0.0 for mm in meshes] + [1.0 / u] for m, c, k, u in pts])
        x, _ = nnls(a, np.ones(len(pts)))
        if form == 'split0' and min(x[1:-1]) <= 0:  # a mesh's factor at its bound: the pooled line
            coef[key] = ('pooled', line([(c + k, u) for _, c, k, u in pts]))
            continue
        coef[key] = ('split', (x[0], dict(zip(meshes, x[1:-1])), x[-1]))

    def pred(r, c, k):
        ov = r['host_speed']['overhead'] if r.get('host_speed') else 1.0
        kind, v = coef[r['processes'], r['chunks']]
        if kind == 'pooled':
            u = v[0] * (c + k) + v[1] * ov
        else:
            u = v[0] * c + v[1].get(r['mesh'], 1.0) * k + v[2] * ov
        g, w = gw[r['processes'], cell(r)]
        return g * u + w * ov
    pred.coef = coef
    return pred


def paired(grids):
    """Grids whose rows and probe steps carry the split (run 39 on): the code's own fit (``fit_cpu_step``) with and
    without the collectives' CPU per cell, each at the host speed of a row's prediction, on the same points."""
    from atp_pipeline.run.calibrate_compute import fit_cpu_step
    res = {f: [] for f in ('pooled', 'per cell', 'per cell, 0 -> pooled')}
    for g in grids:
        name, probe = probe_steps_of(g)
        rows = rows_of(g)
        args = ([r['cpu_s'] for r in probe], [r['measured_cpu_s'] for r in probe], [r['measured_s'] for r in probe],
                [r['processes'] for r in probe], [mesh_of(r) for r in probe], [r['chunks'] for r in probe])
        fits = {'pooled': fit_cpu_step(*args), 'per cell': fit_cpu_step(*args, [r['coll_cpu_s'] for r in probe])}
        # the same, where a chunk count's fit put a mesh's factor at 0: that chunk count's pooled line
        pc, po = fits['per cell'], fits['pooled']
        zero = {(n, key.split('/c')[1]) for n, ks in pc.coll.items() for key, v in ks.items() if v <= 0}
        fits['per cell, 0 -> pooled'] = dataclasses.replace(
            pc, cpu={n: {c: (po.cpu[n][c] if (n, str(c)) in zero else ab) for c, ab in per.items()} for n, per in pc.cpu.items()},
            coll={n: {key: v for key, v in ks.items() if (n, key.split('/c')[1]) not in zero} for n, ks in pc.coll.items()})

        def pred(f):
            def one(r):
                ov = r['host_speed']['overhead'] if r.get('host_speed') else 1.0
                return fits[f].at_speed(ov).step(r['processes'], mesh_of(r), r['chunks'], r['predicted_rank_cpu_s'],
                                                 r['predicted_coll_cpu_s'])
            return one
        own = max(abs(pred('per cell')(r) / r['predicted_s'] - 1) for r in rows)
        code = score(rows, lambda r: r['predicted_s'])
        s = {f: score(rows, pred(f)) for f in res}
        for f in res:
            res[f].append(s[f])
        print(f"  {g:12s} ({name}; code {code['median']:.1%} / {code['worst']:.1%}{' ok' if code['ok'] else ''}, "
              f"{'the per-cell form reproduced' if own < 1e-3 else 'the terms form chosen at calibration'}): "
              + ' | '.join(f"{f} {s[f]['median']:5.1%} / {s[f]['worst']:5.1%}{' ok' if s[f]['ok'] else '   '}" for f in res))
    for f, v in res.items():
        print(f"  {f:22s}: every target in {sum(x['ok'] for x in v)} of {len(v)} grids; mean worst "
              f"{np.mean([x['worst'] for x in v]):.3f}; median of the medians {np.median([x['median'] for x in v]):.3f}")


def main():
    if sys.argv[1:2] == ['--grids']:
        paired(sys.argv[2].split(','))
        return
    print(f'e29: {len(GRIDS)} grids (runs 22-38), no measurement; both parts re-predicted with the current code\n')
    res = {f: [] for f in ('pooled', 'split', 'split0', 'corrected', 'pooled+floor', 'split+floor')}
    shown = set()
    for g in GRIDS:
        name, probe = probe_steps_of(g)
        rows = rows_of(g)
        from atp_pipeline.run.calibrate_compute import PROBES
        if any(r['probe'] not in PROBES for r in probe):
            print(f"  {g:16s} ({name:22s}) skipped: a probe model no longer defined")
            continue
        pp, rp = probe_parts(name, probe), row_parts(name, rows)
        s = {}
        for f in res:
            p = fit(probe, pp, f.split('+')[0], f.endswith('+floor'))
            by = {id(r): p(r, c, k) for r, (c, k) in zip(rows, rp)}
            s[f] = score(rows, lambda r: by[id(r)])
            res[f].append(s[f])
            if f == 'split' and name not in shown and p.coef:
                shown.add(name)
                print(f"  {name}: " + '; '.join(
                    f"{n}p c{ch}: a {v[0]:.2f}, k " + ' '.join(f"{m} {x:.2f}" for m, x in sorted(v[1].items()))
                    + f", b {v[2] * 1e3:.1f} ms" for (n, ch), (_, v) in sorted(p.coef.items())))
        print(f"  {g:16s} ({name:22s}) " + ' | '.join(
            f"{f} {s[f]['median']:5.1%} / {s[f]['worst']:5.1%}{' ok' if s[f]['ok'] else '   '}" for f in res))
    print()
    for f, v in res.items():
        print(f"  {f:7s}: every target in {sum(x['ok'] for x in v):2d} of {len(v)} grids; worst <= 25 % in "
              f"{sum(x['worst'] <= 0.25 for x in v):2d}; mean worst {np.mean([x['worst'] for x in v]):.3f}; median of the "
              f"medians {np.median([x['median'] for x in v]):.3f}; mean level {np.mean([x['level'] for x in v]):+.3f}; "
              f"best {sum(x['best'] for x in v)} of {sum(x['groups'] for x in v)} groups")
        r = v[-8:]
        print(f"  {f:7s} on runs 35-38 alone: every target in {sum(x['ok'] for x in r)} of 8; mean worst "
              f"{np.mean([x['worst'] for x in r]):.3f}")


if __name__ == '__main__':
    sys.exit(main())
