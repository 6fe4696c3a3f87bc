"""Diagnosis e25 (issue 27, after run 34; development check, not a validation): where the grids' worst points
come from, and a wait per step beside the step / CPU ratio.

Arithmetic on the committed grids (every real out-of-sample row of runs 22-34: the code as it stands and the
trials alike) and the probe steps of the calibration each grid used (the byte copies
``docs/step_validation/local_*_probe_steps.json``, matched by the grid's calibration SHA-256); no measurement.

Part 1: each grid's four worst points, and the cells whose points were off by more than 20 % most often.
Part 2: each point's log of measured / predicted step split into the rank CPU's part (measured CPU against
        ``a·Û + b``) and the step / CPU ratio's part (measured step / measured CPU against its cell's ratio),
        per process count, chunk count and model.
Part 3: a correction learned from the *other* grids (leave one grid out) per level of detail: how much of the
        misses is a bias shared across grids.
Part 4: the CPU form's cell step as the median ratio (runs 16-34) against a line ``T = ratio·U + wait`` (run 35),
        both fitted on the same probe steps, each grid's points predicted by both (paired: the same measured
        steps, the same rank CPU and host speed); the code's own prediction is reproduced first (|rel| < 1e-3
        for the form its calibration used).
Part 5: both forms on the probe models left out in turn (the calibration's own choice of form).

    python docs/step_validation/diagnosis/e25.py > docs/step_validation/diagnosis/e25.log
    python docs/step_validation/diagnosis/e25.py --grids steps_wait1,steps_wait2   # Part 4 on more grids
"""
import argparse
import hashlib
import json
import math
import statistics as st
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent
GRIDS = (['steps_read%d' % i for i in range(1, 11)] + ['l2_1', 'l2_2'] + ['steps_blk%d' % i for i in range(1, 5)]
         + ['steps_warm%d' % i for i in range(1, 5)] + ['steps_warmlive1', 'steps_warmlive2'])
STANDING = ['steps_read%d' % i for i in range(1, 11)]  # runs 22-25, 28: the code as it stood before run 35


def cell(r):
    return f"{r['mesh']}/c{r['chunks']}"


def line(pts):
    """``y = s·x + c``, relative non-negative least squares (calibrate_compute._line)."""
    s = c = 0.0
    if len(pts) >= 3:
        s, c = nnls(np.array([[x / y, 1.0 / y] for x, y in pts]), np.ones(len(pts)))[0]
    if not s > 0:
        s, c = st.median(y / x for x, y in pts), 0.0
    return float(s), float(c)


def probe_steps_of(grid):
    sha = json.loads((DOCS / f'{grid}.json').read_text())['meta']['calibration']['sha256']
    for y in sorted(DOCS.glob('local*.yaml')):
        if hashlib.sha256(y.read_bytes()).hexdigest().startswith(sha):  # the JSON keeps its first 12 digits
            steps = y.with_name(y.stem + '_probe_steps.json')
            return y.name, json.loads(steps.read_text())['rows']
    raise SystemExit(f'{grid}: no committed calibration with sha256 {sha[:12]}')


def form(probe, wait):
    """The CPU form fitted on ``probe``: per cell the median ratio (``wait`` False) or the line."""
    cells, cpu = defaultdict(list), defaultdict(list)
    for r in probe:
        cells[r['processes'], cell(r)].append((r['measured_cpu_s'], r['measured_s']))
        cpu[r['processes'], r['chunks']].append((r['cpu_s'], r['measured_cpu_s']))
    ab = {k: line(v) for k, v in cpu.items()}
    gw = {k: line(v) if wait else (st.median(y / x for x, y in v), 0.0) for k, v in cells.items()}

    def pred(r):
        ov = r['host_speed']['overhead'] if r.get('host_speed') else 1.0
        a, b = ab[r['processes'], r['chunks']]
        g, w = gw[r['processes'], cell(r)]
        return g * (a * r['predicted_rank_cpu_s'] + b * ov) + w * ov
    pred.ab, pred.gw = ab, gw
    return pred


def rows_of(grid):
    return [r for r in json.loads((DOCS / f'{grid}.json').read_text())['rows'] if r['class'] == 'real' and not r['in_sample']]


def score(rows, pred):
    e = [abs(pred(r) - r['measured_s']) / r['measured_s'] for r in rows]
    lg = [math.log(r['measured_s'] / pred(r)) for r in rows]
    groups = defaultdict(list)
    for r in rows:
        groups[r['group']].append((pred(r), r['measured_s']))
    best = sum(min(g)[1] == min(m for _, m in g) for g in groups.values())
    ok = st.median(e) <= 0.10 and max(e) <= 0.25 and best >= 0.9 * len(groups)
    return {'median': st.median(e), 'worst': max(e), 'level': float(np.mean(lg)), 'sd': float(np.std(lg)),
            'best': best, 'groups': len(groups), 'ok': ok}


def part1(grids):
    print('Part 1: each grid\'s four worst points (rel. error of the prediction, + = predicted long; the rank CPU\'s log '
          'of measured / predicted)')
    often = Counter()
    for g in grids:
        rows = sorted(rows_of(g), key=lambda r: -abs(r['predicted_s'] - r['measured_s']) / r['measured_s'])
        out = []
        for r in rows[:4]:
            e = (r['predicted_s'] - r['measured_s']) / r['measured_s']
            out.append(f"{r['model']} {r['processes']}p {r['point']} b{r['batch']}s{r['seq_len']} {e:+.2f} "
                       f"(cpu {math.log(r['measured_rank_cpu_s'] / r['predicted_rank_cpu_s']):+.2f})")
        for r in rows:
            e = (r['predicted_s'] - r['measured_s']) / r['measured_s']
            if abs(e) > 0.2:
                often[r['model'], r['processes'], r['point'], 'long' if e > 0 else 'short'] += 1
        print(f'  {g:16s} ' + ' | '.join(out))
    print(f'  points off by > 20 % ({sum(often.values())} in {len(grids)} grids), by cell:')
    for k, v in often.most_common(8):
        print(f'    {v:2d}  {k[0]} {k[1]} proc. {k[2]} predicted {k[3]}')


def part2(grids):
    print('\nPart 2: log of measured / predicted step = the rank CPU\'s part + the step / CPU ratio\'s part (mean over the '
          'grids\' points)')
    by = defaultdict(list)
    for g in grids:
        _, probe = probe_steps_of(g)
        std = form(probe, wait=False)
        for r in rows_of(g):
            ratio = std.gw[r['processes'], cell(r)][0]
            u_pred = r['predicted_s'] / ratio  # a·Û + b at the row's host speed (the code's own prediction)
            parts = (math.log(r['measured_s'] / r['predicted_s']), math.log(r['measured_rank_cpu_s'] / u_pred),
                     math.log(r['measured_s'] / r['measured_rank_cpu_s'] / ratio))
            by[r['processes'], r['chunks'], ''].append(parts)
            by[r['processes'], r['chunks'], r['model']].append(parts)
    for k in sorted(by, key=lambda k: (k[0], k[1], k[2])):
        a = np.array(by[k])
        print(f"  {k[0]} proc. chunks {k[1]} {k[2] or 'all':11s}: step {a[:, 0].mean():+.3f} = rank CPU {a[:, 1].mean():+.3f}"
              f" + step / CPU {a[:, 2].mean():+.3f}  ({len(a)} points)")


def part3(grids):
    print('\nPart 3: a correction learned from the other grids (leave one grid out), applied to each grid\'s predictions')
    rows = {g: rows_of(g) for g in grids}
    for label, key in (('none', None), ('one level', lambda r: 0), ('per process count', lambda r: r['processes']),
                       ('per process count and cell', lambda r: (r['processes'], r['point'])),
                       ('per model and process count', lambda r: (r['model'], r['processes'])),
                       ('per model, process count and cell', lambda r: (r['model'], r['processes'], r['point']))):
        res = []
        for g in grids:
            corr = defaultdict(list)
            for h in grids:
                if h != g and key is not None:
                    for r in rows[h]:
                        corr[key(r)].append(math.log(r['measured_s'] / r['predicted_s']))
            mean = {k: float(np.mean(v)) for k, v in corr.items()}
            res.append(score(rows[g], lambda r: r['predicted_s'] * math.exp(mean.get(key(r), 0.0) if key else 0.0)))
        print(f"  {label:34s}: every target in {sum(x['ok'] for x in res):2d} of {len(res)}; worst <= 25 % in "
              f"{sum(x['worst'] <= 0.25 for x in res):2d}; mean worst {np.mean([x['worst'] for x in res]):.3f}")


def part4(grids):
    print('\nPart 4: the median ratio (runs 16-34) against the line T = ratio·U + wait (run 35), paired on each grid')
    res = {False: [], True: []}
    for g in grids:
        name, probe = probe_steps_of(g)
        rows = rows_of(g)
        fits = {w: form(probe, w) for w in (False, True)}
        own = {w: max(abs(fits[w](r) / r['predicted_s'] - 1) for r in rows) for w in (False, True)}
        used = min(own, key=own.get)
        if own[used] > 1e-3:  # the calibration chose the terms' form (its probe models left out): no CPU form ran
            code = score(rows, lambda r: r['predicted_s'])
            print(f"  {g:16s} ({name}, code: the terms' form, chosen at calibration; neither CPU form reproduces its "
                  f"rows): {code['median']:.1%} / {code['worst']:.1%}{' ok' if code['ok'] else ''}; not paired")
            continue
        s = {w: score(rows, fits[w]) for w in (False, True)}
        for w in (False, True):
            res[w].append(s[w])
        print(f"  {g:16s} ({name}, code: {'line' if used else 'median'}): median ratio {s[False]['median']:.1%} / "
              f"{s[False]['worst']:.1%}{' ok' if s[False]['ok'] else '   '}, level {s[False]['level']:+.3f} | line "
              f"{s[True]['median']:.1%} / {s[True]['worst']:.1%}{' ok' if s[True]['ok'] else '   '}, level {s[True]['level']:+.3f}")
    for w, label in ((False, 'median ratio'), (True, 'line')):
        v = res[w]
        print(f"  {label:12s}: every target in {sum(x['ok'] for x in v)} of {len(v)} grids; worst <= 25 % in "
              f"{sum(x['worst'] <= 0.25 for x in v)}; mean worst {np.mean([x['worst'] for x in v]):.3f}; median of the "
              f"medians {np.median([x['median'] for x in v]):.3f}; mean level {np.mean([x['level'] for x in v]):+.3f}; "
              f"mean within-grid sd {np.mean([x['sd'] for x in v]):.3f}; best {sum(x['best'] for x in v)} of "
              f"{sum(x['groups'] for x in v)} groups")
    return res


def part5(grids):
    print('\nPart 5: both forms on the probe models left out in turn (log of measured / predicted step)')
    seen = {}
    for g in grids:
        name, probe = probe_steps_of(g)
        seen[name] = probe
    tot = {False: [], True: []}
    for name, probe in seen.items():
        errs = {False: [], True: []}
        for m in sorted({r['probe'] for r in probe}):
            train = [r for r in probe if r['probe'] != m]
            for w in (False, True):
                f = form(train, w)
                for r in (r for r in probe if r['probe'] == m):
                    a, b = f.ab[r['processes'], r['chunks']]
                    gg, ww = f.gw[r['processes'], cell(r)]
                    errs[w].append(math.log(r['measured_s'] / (gg * (a * r['cpu_s'] + b) + ww)))
        for w in (False, True):
            tot[w] += errs[w]
        print(f"  {name:28s} median ratio: rms {np.sqrt(np.mean(np.square(errs[False]))):.3f}, worst "
              f"{np.max(np.abs(errs[False])):.3f} | line: rms {np.sqrt(np.mean(np.square(errs[True]))):.3f}, worst "
              f"{np.max(np.abs(errs[True])):.3f}")
    print(f"  all: median ratio rms {np.sqrt(np.mean(np.square(tot[False]))):.3f}, line rms "
          f"{np.sqrt(np.mean(np.square(tot[True]))):.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--grids', default='', help='comma-separated grid tags: Part 4 on these alone')
    args = p.parse_args()
    if args.grids:
        part4(args.grids.split(','))
        return
    print(f'e25: {len(GRIDS)} grids of runs 22-34 ({len(GRIDS) * 60} real points), no measurement\n')
    part1(GRIDS)
    part2(GRIDS)
    part3(GRIDS)
    print('\n(the code as it stood, runs 22-25 and 28, alone:)')
    part3(STANDING)
    part4(GRIDS)
    part5(GRIDS)


if __name__ == '__main__':
    sys.exit(main())
