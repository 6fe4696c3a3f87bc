"""Diagnosis e27 (issue 27, after e26; development check, not a validation): what a collective call costs a rank's
CPU when it is launched before compute and done by the time the rank waits for it, against a blocking call.

e26 measured a chunk's extra collective call at 38-92 us of a rank's CPU inside a 2x2 step against the 453 us the
pure collective loops price every call. Here the calibration's own compute-then-collective loops
(``calibrate_compute.sync_patterns``: ``m`` SYNC_GEMMs then a blocking collective, ``sync``; the collective launched
first, the GEMMs, then its wait, ``async``) and its pure loops (``cpu_loops``) on 4 processes, each loop's CPU per
iteration (ranks' mean) less ``m`` times the SYNC_GEMM kernel's CPU timed in the same run: the CPU one call costs in
each way, per group layout, collective and message size.

    python docs/step_validation/diagnosis/e27.py measure   # -> e27.json (exclusive CPU lock)
    python docs/step_validation/diagnosis/e27.py > docs/step_validation/diagnosis/e27.log
"""
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, '.')
OUT = Path(__file__).with_name('e27.json')
WORLD = 4


def measure():
    from atp_pipeline.run import calibrate_compute as C
    pats = C.sync_patterns(WORLD) + C.cpu_loops(WORLD)
    t0 = time.time()
    _, timed, foreign = C.measure_all([C.SYNC_GEMM], WORLD, passes=5, batch_ms=10.0, patterns=pats)
    OUT.write_text(json.dumps({'date': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'seconds': time.time() - t0,
                               'foreign_load_cores': foreign, 'gemm': {'wall_s': timed[0].wall, 'cpu_s': timed[0].cpu},
                               'rows': [{'pattern': list(p), 'wall_s': t.wall, 'cpu_s': t.cpu}
                                        for p, t in zip(pats, timed[1:])]}, indent=1))


def analyse():
    data = json.loads(OUT.read_text())
    g = data['gemm']['cpu_s']
    print(f"e27 (measured {data['date']}, {data['seconds']:.0f} s; other jobs' load {max(data['foreign_load_cores']):.2f} cores); "
          f"SYNC_GEMM 64x256x256: {g * 1e6:.0f} us CPU, {data['gemm']['wall_s'] * 1e6:.0f} us wall a call (4 ranks at once)")
    by = {}
    for r in data['rows']:
        d1, d2, dim, coll, nbytes, m, mode = r['pattern']
        size = d1 if dim == 1 else d2
        by.setdefault((size, (d1, d2, dim)), []).append((coll, nbytes, m, mode, r['cpu_s'] - m * g, r['wall_s']))
    for (size, lay), rows in sorted(by.items()):
        print(f"\n  group of {size} ({lay[0]}x{lay[1]} dim {lay[2]}): a call's CPU (loop CPU - m x GEMM), wall a loop")
        for coll in ('all_reduce', 'all_gather'):
            for nbytes in sorted({b for c, b, *_ in rows if c == coll}):
                cells = {(m, mode): (cpu, wall) for c, b, m, mode, cpu, wall in rows if c == coll and b == nbytes}
                line = '  '.join(f"{mode[0]}{m:<2d} {cells[(m, mode)][0] * 1e6:5.0f} us ({cells[(m, mode)][1] * 1e3:5.2f} ms)"
                                 for m, mode in sorted(cells, key=lambda k: (k[1], k[0])))
                print(f"    {coll:10s} {nbytes:8d} B: {line}")
        for mode, ms in (('sync', (1, 4, 16)), ('async', (1, 4, 16))):
            vals = [cpu for c, b, m, md, cpu, _ in rows if md == mode and m in ms]
            if vals:
                print(f"    median over {mode} m={ms}: {statistics.median(vals) * 1e6:.0f} us a call")


if __name__ == '__main__':
    if sys.argv[1:] == ['measure']:
        measure()
    else:
        analyse()
