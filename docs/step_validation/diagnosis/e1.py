"""CPU (process_time) and wall per call of kernels and a probe step with P of 4 ranks active."""
import sys, time, statistics, json
from pathlib import Path
sys.path.insert(0, '.')  # run from the repository root
from atp_pipeline.planning.kernels import Kernel, GEMM, NORM_FWD, NORM_BWD, POINTWISE, ATTN_FWD, ATTN_BWD
from atp_pipeline.run import calibrate_compute as cc

KS = [Kernel(NORM_FWD,(1024,)), Kernel(NORM_FWD,(40960,)), Kernel(NORM_BWD,(40960,)), Kernel(POINTWISE,(40960,)),
      Kernel(GEMM,(640,64,64)), Kernel(GEMM,(640,64,128)), Kernel(GEMM,(64,640,64)), Kernel(GEMM,(512,256,256)),
      Kernel(ATTN_FWD,(8,4,80,8)), Kernel(ATTN_BWD,(8,4,80,8))]

def worker(rank, world, counts, passes, models, plans):
    import torch, torch.distributed as dist
    fns = [cc._runner(k, rank, world) for k in KS] + [cc._plan_runner(p, models, rank) for p in plans]
    reps = []
    for fn in fns:
        fn(); t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
        r = torch.tensor([max(1, min(2000, int(0.03 / max(dt, 1e-7))))]); dist.all_reduce(r, op=dist.ReduceOp.MIN); reps.append(int(r))
    out = []
    for p in range(passes):
        row = {}
        for count in (counts if p % 2 == 0 else counts[::-1]):
            res = []
            for fn, k in zip(fns, reps):
                dist.barrier()
                w = c = 0.0
                if rank < count:
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(k): fn()
                    w, c = (time.perf_counter() - t0) / k, (time.process_time() - c0) / k
                t = torch.tensor([w, c], dtype=torch.float64)
                every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
                dist.all_gather(every, t)
                act = [e for i, e in enumerate(every) if i < count]
                res.append((max(float(e[0]) for e in act), statistics.mean(float(e[1]) for e in act)))
            row[count] = res
        out.append(row)
    return out

if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    built = cc.compose_models(cc.probe_entries(["probe_llama", "probe_gpt_m"]), Path('conf'))
    models = [s for _, s in built]
    plans = [(0, 4, 1, 1), (1, 2, 2, 1)]
    counts = [1, 2, 4]
    runs = spawn(worker, 4, counts, 5, models, plans, timeout=900)[0]
    names = [f"{k.kind}{k.dims}" for k in KS] + [f"plan{p}" for p in plans]
    for i, n in enumerate(names):
        line = f"{n:<28}"
        base = None
        for c in counts:
            w = statistics.median(r[c][i][0] for r in runs); cpu = statistics.median(r[c][i][1] for r in runs)
            base = base or cpu
            line += f" P{c}: wall {w*1e6:9.1f} cpu {cpu*1e6:9.1f} us (cpu x{cpu/base:.2f})"
        print(line, flush=True)
