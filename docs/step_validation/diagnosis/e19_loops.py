"""Diagnosis e19, loops (issue 27): the pure collective loops alone on 4 processes, at 1 KiB-1 MiB, a few launches
in a row at a batch of 10 ms and of 40 ms a pass: each loop's CPU a call (us, the ranks' mean) and the per-call /
per-byte fit from 16 KiB-1 MiB (the calibration's sizes before run 20) and from all six sizes.

    python docs/step_validation/diagnosis/e19_loops.py > docs/step_validation/diagnosis/e19_loops.log
"""
import sys, time
sys.path.insert(0, '.')
from atp_pipeline.run import calibrate_compute as C

SIZES = (1024, 4096, 16384, 65536, 262144, 1048576)

if __name__ == '__main__':
    world = 4
    pats = sorted({(d1, d2, dim, coll, b, 0, C.SYNC) for d1, d2, dim, coll, *_ in C.sync_patterns(world) for b in SIZES})
    for batch_ms, launches in ((10.0, 3), (40.0, 2)):
        for n in range(launches):
            t0 = time.time()
            _, timed, foreign = C.measure_all([], world, 5, batch_ms, patterns=pats)
            old = [(p, t) for p, t in zip(pats, timed) if p[4] >= 16384]
            f_old = C.fit_collective_cpu_loops([p for p, _ in old], [t for _, t in old])
            f_all = C.fit_collective_cpu_loops(pats, timed)
            fmt = lambda f: ', '.join(f"{s} ranks {f.per_call[s] * 1e6:.0f} us + {f.per_byte[s] * 1e9:.3f} ns/B" for s in sorted(f.per_call))
            print(f"batch {batch_ms:.0f} ms, launch {n + 1} ({time.time() - t0:.0f} s, other jobs' load <= {max(foreign, default=0):.2f} cores)")
            print(f"  fit 16 KiB-1 MiB: {fmt(f_old)}")
            print(f"  fit 1 KiB-1 MiB:  {fmt(f_all)}")
            by = {}
            for p, t in zip(pats, timed):
                by.setdefault((p[0], p[1], p[2], p[3]), []).append(f"{p[4] // 1024}K {t.cpu * 1e6:.0f}")
            for (d1, d2, dim, coll), v in sorted(by.items()):
                print(f"    {d1}x{d2} dim {dim} ({d1 if dim == 1 else d2} ranks) {coll:10s}", '  '.join(v))
