"""Diagnosis e32 (issue 27, after e31; development check, not a validation): what a collective call costs a probe's
rank inside its step, as e26 measured it for the validation models.

e26 measured, for the validation models at 8x32 on 4 processes, the CPU of a rank's whole step against its
collective-free forward and backward on every mesh and chunk count: at 2x2 a chunks-2 step's extra calls cost a
tenth of the calibration's price, at 4x1 what priced. The calibration times the same two things for its probe models
(its collective-free plans and its live probe steps) but fits the collectives' price from pure loops. Here the
probes, on 4 processes, both ways (the calibration's runners, 5 passes): whether their steps show e26's pattern, i.e.
whether the calibration could price a cell's calls from its own probe steps.

    python docs/step_validation/diagnosis/e32.py measure   # -> e32.json (exclusive CPU lock)
    python docs/step_validation/diagnosis/e32.py > docs/step_validation/diagnosis/e32.log
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, '.')
OUT = Path(__file__).with_name('e32.json')
MESHES = ((4, 1), (2, 2), (1, 4))
CALIBRATION = 'docs/step_validation/local_calls2.yaml'  # run 38's (the code as it stands reads it)


def probes():
    from atp_pipeline.run import calibrate_compute as C
    return list(C.PROBES)


def measure():
    from atp_pipeline.run import calibrate_compute as C
    built = C.compose_models(C.probe_entries(probes()), Path('conf'))
    plans = [(i, d1, d2, c) for i in range(len(built)) for d1, d2 in MESHES for c in (1, 2)
             if not built[i][0].batch_size % c]
    t0 = time.time()
    _, timed, foreign = C.measure_all([], 4, passes=5, batch_ms=10.0, plans=plans, models=[s for _, s in built],
                                      live=plans)
    free, live = timed[:len(plans)], timed[len(plans):]
    rows = [{'probe': probes()[i], 'mesh': [d1, d2], 'chunks': c, 'free_cpu_s': f.cpu, 'live_cpu_s': lv.cpu,
             'live_wall_s': lv.wall} for (i, d1, d2, c), f, lv in zip(plans, free, live)]
    OUT.write_text(json.dumps({'date': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'seconds': time.time() - t0,
                               'foreign_load_cores': foreign, 'rows': rows}, indent=1))


def analyse():
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.planning.step_program import all_items, build_program
    from atp_pipeline.run import calibrate_compute as C
    from benchmarks.step_validation import load_calibrated
    data = json.loads(OUT.read_text())
    shapes = {n: sh for n, (sh, _) in zip(probes(), C.compose_models(C.probe_entries(probes()), Path('conf')))}
    topo, _ = load_calibrated(CALIBRATION, '', Path('conf'))
    prof = profile_of(topo)
    print(f"e32 (measured {data['date']}, {data['seconds']:.0f} s; other jobs' load {max(data['foreign_load_cores']):.2f} "
          f"cores); priced with {CALIBRATION} (run 38)")
    ratios = {}
    for name in probes():
        rows = {(tuple(r['mesh']), r['chunks']): r for r in data['rows'] if r['probe'] == name}
        for mesh in MESHES:
            got = []
            for c in (1, 2):
                r = rows.get((mesh, c))
                if r is None:
                    continue
                sh = shapes[name]
                prog, _ = build_program(sh, mesh, sh.batch_size, c)
                colls = [it[1] for it in all_items(prog) if it[0] in ('sync', 'async', 'linear')]
                size = lambda x: mesh[0] if x.term.dim == 1 else mesh[1]  # noqa: E731
                priced = sum(prof.collective_cpu.call_seconds(size(x), float(x.elements) * 4) for x in colls)
                got.append((c, len(colls), r['live_cpu_s'] - r['free_cpu_s'], priced, r))
                print(f"  {name:16s} {mesh[0]}x{mesh[1]}/c{c}: free {r['free_cpu_s'] * 1e3:6.1f} ms, live "
                      f"{r['live_cpu_s'] * 1e3:6.1f} ms, live - free {(r['live_cpu_s'] - r['free_cpu_s']) * 1e3:6.1f} ms; "
                      f"{len(colls):3d} calls priced {priced * 1e3:5.1f} ms")
            if len(got) == 2:
                (_, n1, d1, p1, _), (_, n2, d2, p2, _) = got
                ratios.setdefault(mesh, []).append((d2 - d1) / (p2 - p1))
                print(f"    {mesh[0]}x{mesh[1]} chunks 2 - 1: live - free {(d2 - d1) * 1e3:+5.1f} ms for {n2 - n1:+d} calls "
                      f"({(d2 - d1) / (n2 - n1) * 1e6:5.0f} us a call); priced {(p2 - p1) * 1e3:+5.1f} ms "
                      f"({(p2 - p1) / (n2 - n1) * 1e6:5.0f} us a call): measured / priced {(d2 - d1) / (p2 - p1):.2f}")
    print('\n  measured / priced, chunks 2 - 1, per mesh over the probes (e26, validation models at 8x32: 4x1 1.16 / 0.84 / '
          '0.87, 2x2 0.20 / 0.10 / 0.08, 1x4 0.41 / 0.22 / 0.43):')
    for mesh, v in ratios.items():
        print(f"    {mesh[0]}x{mesh[1]}: " + ' '.join(f'{x:.2f}' for x in v) + f"  (median {np.median(v):.2f})")


if __name__ == '__main__':
    if sys.argv[1:] == ['measure']:
        measure()
    else:
        analyse()
