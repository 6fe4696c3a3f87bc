"""Diagnosis e22 (issue 27, after runs 26-27; no model, measurements only): how far the same grid point's measured
step moves between two measurements on this host. Run 25's first grid (`steps_read7.json`: run 25's calibration,
variants 16x28 and 4x76, 60 real points) measured again twice, back to back, with the same calibration and command
(`e22a.json`, `e22b.json`; 4 processes on 2 cores and 2 on 2, as the grids). Taking one run's measured steps as the
prediction of another's (a perfect model of the first) gives the error a grid of 60 points shows from the host alone.

Part 2 (arithmetic on the committed grids of the CPU form, runs 18-27, 1,200 points): each point's error split into
its rank CPU's (measured over the step predicted divided by its cell's step / CPU ratio) and its step / CPU ratio's
(measured over the cell's), and the CPU part's bias per model and process count, per cell, and within them.

Part 3 (after run 28, the same arithmetic): the step's bias per model, process count and cell over the 22 grids of
runs 18-28 (runs 18-27's and run 28's two), the cells furthest from their predictions first.

    python -m benchmarks.step_validation --calibration-dir outputs/calibration/run25 --models llama_tiny,gpt2_tiny,small \
        --variants 16x28,4x76 --worlds 4,2 --out docs/step_validation/diagnosis --tag e22a    # then again: --tag e22b
    python docs/step_validation/diagnosis/e22.py > docs/step_validation/diagnosis/e22.log
"""
import collections, itertools, json, re, statistics as st
import numpy as np

D = 'docs/step_validation'
RUNS = {'run 25 (20:53 UTC)': f'{D}/steps_read7.json', 'e22a': f'{D}/diagnosis/e22a.json', 'e22b': f'{D}/diagnosis/e22b.json'}


def points(path):
    rows = [r for r in json.load(open(path))['rows'] if r['class'] == 'real']
    return {(r['model'], r['batch'], r['seq_len'], r['processes'], r['point']): r for r in rows}


P = {k: points(v) for k, v in RUNS.items()}
print("One run's measured value as the prediction of another's, per point (60 points):")
print(f"  {'runs':34s} {'what':10s} {'sd of log':>9s} {'median':>7s} {'worst':>7s}  points beyond 10 / 15 / 20 / 25 %")
for a, b in itertools.combinations(P, 2):
    keys = sorted(set(P[a]) & set(P[b]))
    for what, key in (('step', 'measured_s'), ('rank CPU', 'measured_rank_cpu_s')):
        r = np.array([P[b][k][key] / P[a][k][key] for k in keys])
        e = np.abs(1 / r - 1)  # |"predicted" (measured a) - measured b| / measured b: the grids' relative error
        print(f"  {a + ' vs ' + b:34s} {what:10s} {np.std(np.log(r)):9.3f} {np.median(e):7.1%} {e.max():7.1%}  "
              + ' / '.join(str(int((e > x).sum())) for x in (0.10, 0.15, 0.20, 0.25)))
    worst = max(keys, key=lambda k: abs(P[a][k]['measured_s'] / P[b][k]['measured_s'] - 1))  # as e
    print(f"  {'':34s} worst step: {worst}: {P[a][worst]['measured_s']*1e3:.1f} vs {P[b][worst]['measured_s']*1e3:.1f} ms")
print("\nThe grid's own errors against run 25's calibration (median / worst), each run:")
for k, v in P.items():
    e = [r['rel_error'] for r in v.values()]
    print(f"  {k:20s} {st.median(e):.1%} / {max(e):.1%}")

print("\nPart 2: the CPU form's error split, the 20 grids of runs 18-27 (log of measured / predicted)")
GRIDS = [f'steps_anch{i}' for i in range(5, 9)] + [f'steps_loop{i}' for i in range(1, 5)] + \
    [f'steps_read{i}' for i in range(1, 9)] + [f'act{i}' for i in range(1, 5)]
cpu, ratio, step, group, cell = [], [], [], collections.defaultdict(dict), collections.defaultdict(list)
within = []
for g in GRIDS:
    per = collections.defaultdict(list)
    for r in (r for r in json.load(open(f'{D}/{g}.json'))['rows'] if r['class'] == 'real'):
        part = re.search(rf"{r['processes']} processes: rank CPU[^;]*; step / rank CPU ([^;)\]]*)", r['calibration']).group(1)
        g_cell = dict((k, float(v)) for k, v in re.findall(r"(\dx\d/c\d) x([\d.]+)", part))[r['point']]
        c = np.log(r['measured_rank_cpu_s'] / (r['predicted_s'] / g_cell))
        cpu.append(c); ratio.append(np.log(r['measured_s'] / r['measured_rank_cpu_s'] / g_cell))
        step.append(np.log(r['measured_s'] / r['predicted_s']))
        per[(r['model'], r['processes'])].append(c); cell[(r['processes'], r['point'])].append(c)
    for k, v in per.items():
        group[k][g] = float(np.median(v)); within += list(np.array(v) - np.median(v))
cpu, ratio, step = map(np.array, (cpu, ratio, step))
big = np.abs(np.exp(step) - 1) > 0.20
print(f"  {len(step)} points: sd of log, step {step.std():.3f} = rank CPU {cpu.std():.3f} and step / CPU {ratio.std():.3f} "
      f"(correlation {np.corrcoef(cpu, ratio)[0, 1]:+.2f}); off by > 15 %: rank CPU {int((np.abs(np.exp(cpu) - 1) > 0.15).sum())}, "
      f"step / CPU {int((np.abs(np.exp(ratio) - 1) > 0.15).sum())}")
print(f"  the {int(big.sum())} points off by > 20 %: rank CPU off by > 10 % in {int((big & (np.abs(np.exp(cpu) - 1) > 0.10)).sum())}, "
      f"step / CPU in {int((big & (np.abs(np.exp(ratio) - 1) > 0.10)).sum())}")
print(f"  the rank CPU's: per model and process count, mean over grids of the grid's median (sd over grids); "
      f"within one (model, processes, grid): sd {np.std(within):.3f}")
for k in sorted(group):
    v = list(group[k].values())
    print(f"    {k[0]:11s} {k[1]} proc. {np.mean(v):+.3f} ({np.std(v):.3f})")
print("  per cell (processes, mesh/chunks): mean (sd)")
for k in sorted(cell):
    print(f"    {k[0]} proc. {k[1]}: {np.mean(cell[k]):+.3f} ({np.std(cell[k]):.3f})")

print("\nPart 3: the step's log of measured / predicted per model, process count and cell, 22 grids of runs 18-28")
by = collections.defaultdict(list)
for g in GRIDS + ['steps_read9', 'steps_read10']:
    for r in (r for r in json.load(open(f'{D}/{g}.json'))['rows'] if r['class'] == 'real'):
        by[(r['model'], r['processes'], r['point'])].append(np.log(r['measured_s'] / r['predicted_s']))
ranked = sorted(by.items(), key=lambda kv: np.mean(kv[1]))
for k, v in ranked[:6] + ranked[-4:]:
    print(f"  {k[0]:11s} {k[1]} proc. {k[2]}: mean {np.mean(v):+.3f}, sd {np.std(v):.3f}, {len(v)} points")
gpt = [np.mean(v) for k, v in by.items() if k[0] == 'small']
print(f"  the built-in GPT's ('small') cells: {min(gpt):+.3f} to {max(gpt):+.3f}")
