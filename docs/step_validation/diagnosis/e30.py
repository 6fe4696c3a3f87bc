"""Diagnosis e30 (issue 27, after runs 39-40; development check, not a validation): what is left of the grids' error,
and what does not take it out. Arithmetic on the committed grids' rows and their calibrations' probe steps (matched by
SHA-256 as in e25); no measurement.

Part 1: the host's re-timed speed (the reference probe before each group) against none, and shares of it in between
        (the prediction ``p_cal^(1-λ)·p^λ``), over the 34 grids since run 22.
Part 2: the error's structure over the 12 grids of runs 35-40: per (model, process count, cell) the mean and the spread
        over the grids of the log of measured / predicted (rank CPU and step), each point taken relative to its group
        (grid, model, processes, batch) so that the groups' common level is out.
Part 3: a correction per (family, process count, cell) from the probe models of the same family (the mean log of their
        measured / predicted rank CPU or step under the run-35 line) applied to the validation models of that family.

    python docs/step_validation/diagnosis/e30.py > docs/step_validation/diagnosis/e30.log
"""
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from e25 import GRIDS as OLD, cell, form, probe_steps_of, rows_of, score  # noqa: E402

RECENT = ['steps_wait%d' % i for i in range(1, 5)] + ['steps_calls%d' % i for i in range(1, 5)] + \
    ['steps_coll%d' % i for i in range(1, 5)]
ALL = OLD + RECENT
PROBES = ('probe_gpt_s', 'probe_gpt_m', 'probe_llama', 'probe_gpt2', 'probe_gpt_s_b48', 'probe_llama_b48')


def family(name):
    return 'llama' if 'llama' in name else 'gpt2' if 'gpt2' in name else 'gpt'


def summary(label, v):
    print(f"  {label:28s}: every target in {sum(x['ok'] for x in v):2d} of {len(v)} grids; mean worst "
          f"{np.mean([x['worst'] for x in v]):.3f}; median of the medians {np.median([x['median'] for x in v]):.3f}; "
          f"mean level {np.mean([x['level'] for x in v]):+.3f}")


def part1():
    print('Part 1: the host speed re-timing, all of it (λ = 1, the code), none (λ = 0) and shares between')
    for lam in (0.0, 0.25, 0.5, 0.75, 1.0):
        v = [score(rows_of(g), lambda r: r['predicted_at_calibration_speed_s'] ** (1 - lam) * r['predicted_s'] ** lam)
             for g in ALL]
        summary(f'λ = {lam}', v)


def part2():
    print('\nPart 2: per (model, processes, cell), runs 35-40 (12 grids): mean (sd over grids) of the log of measured / '
          'predicted, relative to its group')
    rows = [dict(r, grid=g) for g in RECENT for r in rows_of(g)]
    parts = {'rank CPU': lambda r: math.log(r['measured_rank_cpu_s'] / r['predicted_rank_cpu_s']),
             'step': lambda r: math.log(r['measured_s'] / r['predicted_s'])}
    out = {}
    for label, f in parts.items():
        groups = defaultdict(list)
        for r in rows:
            groups[r['grid'], r['model'], r['processes'], r['batch']].append(f(r))
        cells = defaultdict(list)
        for r in rows:
            cells[r['model'], r['processes'], r['point']].append(
                f(r) - np.mean(groups[r['grid'], r['model'], r['processes'], r['batch']]))
        out[label] = cells
    print(f"  {'model':10s} P {'cell':7s} {'rank CPU':>16s} {'step':>16s}")
    for k in sorted(out['step']):
        a, b = np.array(out['rank CPU'][k]), np.array(out['step'][k])
        print(f"  {k[0]:10s} {k[1]} {k[2]:7s} {a.mean():+.3f} ({a.std():.3f})   {b.mean():+.3f} ({b.std():.3f})")
    for label, cells in out.items():
        means = [np.mean(v) for v in cells.values()]
        print(f"  {label}: sd of the cells' means {np.std(means):.3f}; mean sd within a cell {np.mean([np.std(v) for v in cells.values()]):.3f}")


def part3():
    print('\nPart 3: a correction per (family, processes, cell) from the same family\'s probe models (grids whose probes '
          'are all defined today)')
    res = {'the run-35 line (the code)': [], 'its rank CPU corrected': [], 'its step corrected': []}
    for g in ALL:
        name, probe = probe_steps_of(g)
        if any(r['probe'] not in PROBES for r in probe):
            continue
        rows, f = rows_of(g), form(probe, True)
        cpu, step = defaultdict(list), defaultdict(list)
        for r in probe:
            a, b = f.ab[r['processes'], r['chunks']]
            gg, w = f.gw[r['processes'], cell(r)]
            key = (family(r['probe']), r['processes'], cell(r))
            cpu[key].append(math.log(r['measured_cpu_s'] / (a * r['cpu_s'] + b)))
            step[key].append(math.log(r['measured_s'] / (gg * (a * r['cpu_s'] + b) + w)))
        c = {k: np.mean(v) for k, v in cpu.items()}
        s = {k: np.mean(v) for k, v in step.items()}

        def by_cpu(r):
            ov = r['host_speed']['overhead'] if r.get('host_speed') else 1.0
            a, b = f.ab[r['processes'], r['chunks']]
            gg, w = f.gw[r['processes'], cell(r)]
            k = c.get((family(r['model']), r['processes'], cell(r)), 0.0)
            return gg * (a * r['predicted_rank_cpu_s'] * math.exp(k) + b * ov) + w * ov

        def by_step(r):
            return f(r) * math.exp(s.get((family(r['model']), r['processes'], cell(r)), 0.0))
        for label, p in zip(res, (f, by_cpu, by_step)):
            res[label].append(score(rows, p))
    for label, v in res.items():
        summary(label, v)


if __name__ == '__main__':
    part1()
    part2()
    part3()
