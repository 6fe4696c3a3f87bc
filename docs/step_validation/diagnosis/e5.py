"""Kernel CPU per call vs how many device meshes (gloo process groups) the process holds."""
import sys, time, statistics, resource
sys.path.insert(0, '.')  # run from the repository root
from atp_pipeline.planning.kernels import Kernel, GEMM, NORM_BWD, NORM_FWD
from atp_pipeline.run import calibrate_compute as cc
KS = [Kernel(GEMM, (512, 256, 256)), Kernel(GEMM, (640, 64, 64)), Kernel(NORM_FWD, (40960,)), Kernel(NORM_BWD, (8192,))]

def worker(rank, world, counts):
    import torch, torch.distributed as dist
    from atp_pipeline.parallel import init_mesh
    fns = [cc._runner(k, rank, world) for k in KS]
    meshes, res = [], {}
    for n in counts:
        while len(meshes) < n:
            meshes.append(init_mesh((2, 2)))
        th = int([l for l in open('/proc/self/status') if l.startswith('Threads')][0].split()[1])
        row = []
        for fn in fns:
            fn(); t0 = time.perf_counter(); fn(); k = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-7)))
            r = torch.tensor([k]); dist.all_reduce(r, op=dist.ReduceOp.MIN); k = int(r)
            vals = []
            for _ in range(5):
                dist.barrier()
                t0, p0, h0, a = time.perf_counter(), time.process_time(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
                for _ in range(k): fn()
                b = resource.getrusage(resource.RUSAGE_SELF)
                vals.append(((time.perf_counter() - t0) / k, (time.process_time() - p0) / k, (time.thread_time() - h0) / k, (b.ru_nvcsw - a.ru_nvcsw) / k))
            row.append([statistics.median(v[j] for v in vals) for j in range(4)])
        # idle: the process's CPU over 1 s asleep
        p0 = time.process_time(); a = resource.getrusage(resource.RUSAGE_SELF); time.sleep(1.0); b = resource.getrusage(resource.RUSAGE_SELF)
        res[n] = (th, row, time.process_time() - p0, b.ru_nvcsw - a.ru_nvcsw)
        dist.barrier()
    return res

if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    counts = [0, 4, 16, 48]
    runs = spawn(worker, 4, counts, timeout=900)
    for n in counts:
        th = runs[0][n][0]
        idle = statistics.mean(r[n][2] for r in runs); idlecs = statistics.mean(r[n][3] for r in runs)
        print(f"{n:3d} extra meshes, {th} threads/rank, idle CPU {idle*1e3:.1f} ms/s per rank ({idlecs:.0f} switches/s)")
        for i, k in enumerate(KS):
            m = [statistics.mean(r[n][1][i][j] for r in runs) for j in range(4)]
            print(f"    {k.kind}{k.dims}: wall {m[0]*1e6:8.1f} proc {m[1]*1e6:8.1f} thread {m[2]*1e6:8.1f} us, {m[3]:.2f} vcsw/call")
