"""Diagnosis e28 (issue 27, after e26-e27; development check, not a validation): the rank CPU's line per cell.

e26 measured a 2x2 chunks-2 step's extra collective calls at 38-92 us of a rank's CPU each where the calibration's
pure loops price them at 453 us; e27 found the calibration's own collective-during-compute loops no cheaper per call
than its blocking ones (so a "done" price per call has nothing to be calibrated from). What the probes' own steps
measure per (mesh, chunk count) cell is the rank's CPU against the model's (``U`` against ``Û``): the run-35 form
fits that line per process and chunk count, pooled over the meshes, so a mesh whose calls the model misprices keeps
its error. Here, arithmetic on the committed grids (each grid's points and the probe steps of its calibration,
matched by SHA-256 as in e25; no measurement), three forms fitted on the same probe steps:

- ``pooled`` (the code as it stands, run 35): ``U = a·Û + b`` per (processes, chunks), ``T = g·U + w`` per cell;
- ``cell``: ``U = a·Û + b`` per (processes, cell) too;
- ``direct``: ``T = k·Û + w`` per cell (the composition of the two lines, fitted in one).

Each grid's points predicted by all three (paired: the same measured steps, rank CPU and host speed), then each
form's error on the probe models left out in turn.

    python docs/step_validation/diagnosis/e28.py > docs/step_validation/diagnosis/e28.log
"""
import math
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e25 import GRIDS, cell, line, probe_steps_of, rows_of, score  # noqa: E402

GRIDS = GRIDS + ['steps_wait%d' % i for i in range(1, 5)] + ['steps_calls%d' % i for i in range(1, 5)]
FORMS = ('pooled', 'cell', 'direct')


def fit(probe, form):
    cells, cpu, direct = defaultdict(list), defaultdict(list), defaultdict(list)
    for r in probe:
        key = (r['processes'], cell(r))
        cells[key].append((r['measured_cpu_s'], r['measured_s']))
        cpu[(r['processes'], r['chunks']) if form == 'pooled' else key].append((r['cpu_s'], r['measured_cpu_s']))
        direct[key].append((r['cpu_s'], r['measured_s']))
    ab = {k: line(v) for k, v in cpu.items()}
    gw = {k: line(v) for k, v in cells.items()}
    kw = {k: line(v) for k, v in direct.items()}

    def pred(r, cpu_key='predicted_rank_cpu_s', speed=True):
        ov = r['host_speed']['overhead'] if speed and r.get('host_speed') else 1.0
        key = (r['processes'], cell(r))
        if form == 'direct':
            k, w = kw[key]
            return k * r[cpu_key] + w * ov
        a, b = ab[(r['processes'], r['chunks']) if form == 'pooled' else key]
        g, w = gw[key]
        return g * (a * r[cpu_key] + b * ov) + w * ov
    return pred


def main():
    print(f'e28: {len(GRIDS)} grids (runs 22-38), no measurement\n')
    res = {f: [] for f in FORMS}
    for g in GRIDS:
        name, probe = probe_steps_of(g)
        rows = rows_of(g)
        s = {f: score(rows, fit(probe, f)) for f in FORMS}
        for f in FORMS:
            res[f].append(s[f])
        print(f"  {g:16s} ({name:22s}) " + ' | '.join(
            f"{f} {s[f]['median']:5.1%} / {s[f]['worst']:5.1%}{' ok' if s[f]['ok'] else '   '}" for f in FORMS))
    print()
    for f in FORMS:
        v = res[f]
        print(f"  {f:7s}: every target in {sum(x['ok'] for x in v):2d} of {len(v)} grids; worst <= 25 % in "
              f"{sum(x['worst'] <= 0.25 for x in v):2d}; mean worst {np.mean([x['worst'] for x in v]):.3f}; median of the "
              f"medians {np.median([x['median'] for x in v]):.3f}; mean level {np.mean([x['level'] for x in v]):+.3f}; "
              f"best {sum(x['best'] for x in v)} of {sum(x['groups'] for x in v)} groups")
    recent = slice(len(GRIDS) - 8, None)
    for f in FORMS:
        v = res[f][recent]
        print(f"  {f:7s} on runs 35-38 alone: every target in {sum(x['ok'] for x in v)} of {len(v)}; mean worst "
              f"{np.mean([x['worst'] for x in v]):.3f}")
    print('\n  the probe models left out in turn (log of measured / predicted step), every committed calibration above:')
    seen = {}
    for g in GRIDS:
        name, probe = probe_steps_of(g)
        seen[name] = probe
    tot = {f: [] for f in FORMS}
    for name, probe in seen.items():
        for m in sorted({r['probe'] for r in probe}):
            train = [r for r in probe if r['probe'] != m]
            for f in FORMS:
                p = fit(train, f)
                tot[f] += [math.log(r['measured_s'] / p(r, 'cpu_s', False)) for r in probe if r['probe'] == m]
    for f in FORMS:
        e = np.abs(tot[f])
        print(f"  {f:7s}: rms {np.sqrt(np.mean(np.square(tot[f]))):.3f}, median {np.median(e):.3f}, worst {e.max():.3f}"
              f" ({len(e)} probe steps)")


if __name__ == '__main__':
    sys.exit(main())
