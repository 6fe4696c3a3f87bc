"""The calibration's pure collective loops (its compute-then-collective patterns with no GEMMs: every
rank in the same back-to-back collectives after a barrier): CPU per call (the ranks' mean, all threads)."""
import sys, time
sys.path.insert(0, '.')  # run from the repository root
from atp_pipeline.run import calibrate_compute as cc
if __name__ == '__main__':
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    pats = [p for p in cc.sync_patterns(world) if p[5] == 0 and p[6] == cc.SYNC]
    pats += [(d1, d2, dim, coll, 1048576, 0, cc.SYNC) for d1, d2, dim, coll, b, _, _ in pats if b == cc.SYNC_BYTES[-1]]
    t0 = time.time()
    got, timed, foreign = cc.measure_all([], world, 3, 8.0, patterns=pats)
    for p, t in zip(pats, timed):
        d1, d2, dim, coll, b, m, mode = p
        size = d1 if dim == 1 else d2
        print(f"{d1}x{d2} d{dim} (group {size}) {coll:10} {b:7d} B: wall {t.wall*1e3:6.3f} ms  cpu {t.cpu*1e3:6.3f} ms per call")
    fit = cc.fit_collective_cpu_loops(pats, timed)
    print('fit: ' + ', '.join(f'{k} ranks {fit.per_call[k]*1e6:.0f} us + {fit.per_byte[k]*1e9:.3f} ns/B' for k in sorted(fit.per_call)))
    print(f"{time.time()-t0:.0f} s")
