"""Does a rank waiting in a gloo collective burn CPU? Pure collective loops (ranks together after a
barrier) vs the same loop with one rank late by a sleep (the others wait): CPU per call by rank."""
import sys, time, os
sys.path.insert(0, '.')
def worker(rank, world):
    import torch, torch.distributed as dist
    out = []
    g2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for size, grp in ((4, None), (2, g2[rank // 2])):
        for nbytes in (1024, 16384, 262144, 1048576):
            buf = torch.ones(nbytes // 4)
            for late_ms in (0.0, 2.0, 8.0):
                n = 40 if nbytes < 1048576 else 20
                for _ in range(3): dist.all_reduce(buf, group=grp)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                sl = 0.0
                for _ in range(n):
                    if late_ms and rank == 0:
                        s0 = time.process_time(); time.sleep(late_ms * 1e-3); sl += time.process_time() - s0
                    dist.all_reduce(buf, group=grp)
                w, c = (time.perf_counter() - t0) / n, (time.process_time() - c0 - sl) / n
                out.append((size, nbytes, late_ms, w * 1e3, c * 1e3))
    return out
if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    t = time.time()
    res = spawn(worker, 4, timeout=300)
    for i in range(len(res[0])):
        size, nb, late, w, _ = res[0][i]
        print(f"group {size} bytes {nb:8d} rank0 late {late:3.0f} ms: wall/call {w:7.3f} ms  cpu/call by rank " + " ".join(f"{r[i][4]:6.3f}" for r in res))
    print(f"{time.time()-t:.0f} s")
