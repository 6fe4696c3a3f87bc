import json, sys, statistics
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from atp_pipeline.run.calibrate_compute import sweep_kernels, measure_all
def main():
    ks = sweep_kernels()
    out = {}
    for w in (2, 4, 2, 4):
        _, timed, load = measure_all(ks, w, passes=3)
        out.setdefault(w, []).append([t.cpu for t in timed])
        print(w, 'load', load, flush=True)
    rows = []
    for i, k in enumerate(ks):
        c2 = statistics.mean(r[i] for r in out[2]); c4 = statistics.mean(r[i] for r in out[4])
        rows.append((k.kind, list(k.dims), c2, c4))
    json.dump(rows, open(str(Path(__file__).with_name('kernels_2v4.json')), 'w'))
    for kind, dims, c2, c4 in rows:
        print(f"{kind:10s} {str(dims):24s} {c2*1e6:9.1f} {c4*1e6:9.1f} {c2/c4:6.2f}")
    
if __name__ == '__main__':
    main()
