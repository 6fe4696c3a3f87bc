"""The calibration's own measurement set (cc._worker's runners), user and system CPU per call per kernel:
kernels alone vs kernels among the full set (probes, loops, live probes)."""
import sys, os, time, statistics, resource
from pathlib import Path
sys.path.insert(0, '.')  # run from the repository root
from atp_pipeline.run import calibrate_compute as cc

def worker(rank, world, kernels, plans, models, patterns, live, passes):
    import torch, torch.distributed as dist
    fns = ([cc._runner(k, rank, world) for k in kernels] + [cc._plan_runner(p, models, rank) for p in plans]
           + [cc._pattern_runner(p, rank) for p in patterns] + [cc._live_runner(p, models, rank) for p in live])
    reps = []
    for fn in fns:
        fn(); t0 = time.perf_counter(); fn(); dt = max(time.perf_counter() - t0, 1e-7)
        r = torch.tensor([max(1, min(200, int(8e-3 / dt)))]); dist.all_reduce(r, op=dist.ReduceOp.MIN); reps.append(int(r))
    import threading
    nthreads = int([l for l in open('/proc/self/status') if l.startswith('Threads')][0].split()[1])
    out = []
    for _ in range(passes):
        row = []
        for i, fn in enumerate(fns):
            dist.barrier()
            t0, p0, th0, a = time.perf_counter(), time.process_time(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(reps[i]): fn()
            b = resource.getrusage(resource.RUSAGE_SELF)
            n = reps[i]
            row.append(((time.perf_counter() - t0) / n, (time.process_time() - p0) / n, (time.thread_time() - th0) / n,
                        (b.ru_minflt - a.ru_minflt) / n, (b.ru_nvcsw - a.ru_nvcsw) / n, (b.ru_nivcsw - a.ru_nivcsw) / n))
        out.append(row)
    return out + [nthreads]

if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    mode = sys.argv[1]
    kernels = cc.sweep_kernels()
    kernels = [k for k in kernels if k.kind in ('norm_fwd', 'norm_bwd', 'pointwise') or (k.kind == 'gemm' and k.dims in [(512,64,64),(512,256,256),(2048,64,64),(128,64,64)])]
    built = cc.compose_models(cc.probe_entries(list(cc.PROBES)), Path('conf'))
    shapes = [s for s, _ in built]; models = [m for _, m in built]
    plans = cc.plan_points(shapes, 4, (1, 2)); patterns = cc.sync_patterns(4)
    if mode == 'alone':
        plans, patterns, live = [], [], []
    else:
        live = list(plans)
    t0 = time.time()
    runs = spawn(worker, 4, kernels, plans, models, patterns, live, 3, timeout=1200)
    print(f"mode {mode}: {len(kernels)} kernels, {len(plans)} plans, {len(patterns)} loops, {len(live)} live; {time.time()-t0:.0f} s")
    print('threads per rank', [r[-1] for r in runs])
    runs = [r[:-1] for r in runs]
    names = [f"{k.kind}{k.dims}" for k in kernels] + [f"plan{p}" for p in plans]
    for i, n in enumerate(names[:len(kernels) + 6]):
        per_rank = [[statistics.median(r[p][i][j] for p in range(3)) for j in range(6)] for r in runs]
        m = [statistics.mean(x[j] for x in per_rank) for j in range(6)]
        print(f"  {n:<28} wall {m[0]*1e6:9.1f}  proc {m[1]*1e6:9.1f}  thread {m[2]*1e6:9.1f} us  minflt {m[3]:7.1f} vcsw {m[4]:6.2f} ivcsw {m[5]:6.2f}")
