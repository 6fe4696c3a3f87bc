"""Diagnosis e26 (issue 27, after run 37; development check, not a validation): what a collective call costs a
rank's CPU inside a training step, against the calibration's price for it.

Run 37's grids missed at 4-process 2x2/c2 (the cells with the most collective calls a step), the rank CPU predicted
long. The calibration prices a call's backend CPU from pure collective loops (every group of a layout at once,
``collective_cpu``). Here, on 4 processes as the calibration runs its probes, the validation models at one batch x
sequence point already used (8x32) on every mesh and chunk count: the runtime's forward and backward with its
collectives skipped (the calibration's collective-free runner) and its whole training step (collectives run,
optimizer, closing barrier; the calibration's live probe-step runner), a rank's CPU (mean over ranks), median of
5 passes. Per model, the difference live - free against the step program's calls by group size plus one constant
(the optimizer and barrier, the same on every mesh within 10 %): the CPU a call costs inside a step, set beside
run 37's price (``collective_cpu`` at the call's bytes, plus the framework's per-call ``a``).

    python docs/step_validation/diagnosis/e26.py measure   # -> e26.json (~4 min, exclusive CPU lock)
    python docs/step_validation/diagnosis/e26.py > docs/step_validation/diagnosis/e26.log
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, '.')
OUT = Path(__file__).with_name('e26.json')
MODELS = ('llama_tiny', 'gpt2_tiny', 'small')
MESHES = ((4, 1), (2, 2), (1, 4))
CALIBRATION = 'docs/step_validation/local_calls1.yaml'  # run 37's


def entries():
    from benchmarks.step_validation import variant_overrides
    return [(f'{m}@8x32', variant_overrides(m, 8, 32, Path('conf'))) for m in MODELS]


def measure():
    from atp_pipeline.run import calibrate_compute as C
    built = C.compose_models(entries(), Path('conf'))
    plans = [(i, d1, d2, c) for i in range(len(built)) for d1, d2 in MESHES for c in (1, 2)]
    t0 = time.time()
    _, timed, foreign = C.measure_all([], 4, passes=5, batch_ms=10.0, plans=plans, models=[s for _, s in built],
                                      live=plans)
    free, live = timed[:len(plans)], timed[len(plans):]
    rows = [{'model': MODELS[i], 'mesh': [d1, d2], 'chunks': c, 'free_cpu_s': f.cpu, 'live_cpu_s': l.cpu,
             'live_wall_s': l.wall} for (i, d1, d2, c), f, l in zip(plans, free, live)]
    OUT.write_text(json.dumps({'date': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'seconds': time.time() - t0,
                               'foreign_load_cores': foreign, 'rows': rows}, indent=1))


def analyse():
    import numpy as np
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.planning.step_program import all_items, build_program
    from atp_pipeline.run import calibrate_compute as C
    from benchmarks.step_validation import load_calibrated
    data = json.loads(OUT.read_text())
    shapes = {m: sh for m, (sh, _) in zip(MODELS, C.compose_models(entries(), Path('conf')))}
    topo, _ = load_calibrated(CALIBRATION, '', Path('conf'))
    prof = profile_of(topo)
    print(f"e26 (measured {data['date']}, {data['seconds']:.0f} s; other jobs' load {max(data['foreign_load_cores']):.2f} "
          f"cores); priced with {CALIBRATION} (run 37)")
    for m in MODELS:
        rows = [r for r in data['rows'] if r['model'] == m]
        feats, price, delta = [], [], []
        for r in rows:
            mesh, c = tuple(r['mesh']), r['chunks']
            prog, _ = build_program(shapes[m], mesh, shapes[m].batch_size, c)
            colls = [it[1] for it in all_items(prog) if it[0] in ('sync', 'async', 'linear')]
            size = lambda x: mesh[0] if x.term.dim == 1 else mesh[1]  # noqa: E731
            n2 = sum(1 for x in colls if size(x) == 2)
            n4 = sum(1 for x in colls if size(x) == 4)
            priced = sum(prof.collective_cpu.call_seconds(size(x), float(x.elements) * 4) for x in colls)
            feats.append([n2, n4, 1.0])
            price.append(priced)
            delta.append(r['live_cpu_s'] - r['free_cpu_s'])
            print(f"  {m:11s} {mesh[0]}x{mesh[1]}/c{c}: free {r['free_cpu_s'] * 1e3:6.1f} ms, live {r['live_cpu_s'] * 1e3:6.1f}"
                  f" ms, live - free {delta[-1] * 1e3:6.1f} ms; calls {n2:3d} (2 ranks) {n4:3d} (4 ranks); their backend CPU "
                  f"as priced {priced * 1e3:5.1f} ms")
        for i in range(0, len(rows), 2):  # chunks 2 against 1 on one mesh: the same bytes, the calls doubled
            mesh = rows[i]['mesh']
            calls = (feats[i + 1][0] + feats[i + 1][1]) - (feats[i][0] + feats[i][1])
            print(f"    {mesh[0]}x{mesh[1]}: chunks 2 - chunks 1: live - free {(delta[i + 1] - delta[i]) * 1e3:+5.1f} ms for "
                  f"{calls:+d} calls ({(delta[i + 1] - delta[i]) / calls * 1e6:4.0f} us a call); priced "
                  f"{(price[i + 1] - price[i]) * 1e3:+5.1f} ms ({(price[i + 1] - price[i]) / calls * 1e6:4.0f} us a call)")
        x, *_ = np.linalg.lstsq(np.array(feats), np.array(delta), rcond=None)
        fit = np.array(feats) @ x
        print(f"  {m}: live - free = {x[0] * 1e6:.0f} us a 2-rank call + {x[1] * 1e6:.0f} us a 4-rank call + "
              f"{x[2] * 1e3:.1f} ms (residual sd {np.std(np.array(delta) - fit) * 1e3:.2f} ms); priced per call "
              f"(no bytes) {prof.collective_cpu.call_seconds(2, 0) * 1e6:.0f} / {prof.collective_cpu.call_seconds(4, 0) * 1e6:.0f} us\n")


if __name__ == '__main__':
    if sys.argv[1:] == ['measure']:
        measure()
    else:
        analyse()
