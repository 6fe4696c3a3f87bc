"""A real training step (validation's worker) on P processes: CPU per step, and torch.profiler's per-op self CPU on rank 0."""
import sys, time, statistics, copy, json
from pathlib import Path
sys.path.insert(0, '.')  # run from the repository root

def worker(rank, world, spec, mesh, chunks, prof):
    import torch, torch.distributed as dist
    from atp_pipeline.lightning.module import adamw
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import comm_for, init_mesh
    from atp_pipeline.parallel.apply import apply_plan
    adapter = get_adapter(spec["family"])
    torch.manual_seed(0)
    dense = adapter.build(spec["model_config"])
    g = torch.Generator().manual_seed(0)
    b, s, V = spec["batch"], spec["seq_len"], spec["vocab"]
    idx = torch.randint(0, V, (b, s), generator=g); tgt = torch.randint(0, V, (b, s), generator=g)
    m = init_mesh(mesh); model = copy.deepcopy(dense)
    apply_plan(model, adapter.parallel_plan(model), m, chunks)
    comm = comm_for(m)
    opt = adamw(model.parameters(), lr=1e-4)
    def step():
        loss = adapter.lm_loss(model, idx, tgt); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(3):
        dist.barrier(); step()
    cpus, walls = [], []
    comm.stats.reset()
    for _ in range(12):
        dist.barrier(); c0, t0 = time.process_time(), time.perf_counter(); step(); cpus.append(time.process_time() - c0); dist.barrier(); walls.append(time.perf_counter() - t0)
    wait = sum(c.wait_s for c in comm.stats.totals.values()) / 12
    table = None
    if prof:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(4):
                dist.barrier(); step()
        if rank == 0:
            ka = p.key_averages()
            table = [(e.key, e.count / 4, e.self_cpu_time_total / 4, e.cpu_time_total / 4) for e in ka]
    return {"cpu": statistics.median(cpus), "wall": statistics.median(walls), "wait": wait, "table": table}

if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    from atp_pipeline.run.calibrate_compute import compose_models
    from benchmarks.step_validation import variant_overrides
    model, b, s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mesh = tuple(int(x) for x in sys.argv[4].split('x')); chunks = int(sys.argv[5]); prof = len(sys.argv) > 6
    (shape, spec), = compose_models([(model, variant_overrides(model, b, s, Path('conf')))], Path('conf'))
    r = spawn(worker, mesh[0] * mesh[1], spec, mesh, chunks, prof, timeout=900)
    print(f"{model} {b}x{s} {mesh} c{chunks}: rank cpu/step " + ", ".join(f"{x['cpu']*1e3:.1f}" for x in r)
          + f" ms; wall {r[0]['wall']*1e3:.1f} ms; wait rank0 {r[0]['wait']*1e3:.1f} ms")
    if prof:
        t = sorted(r[0]["table"], key=lambda x: -x[2])
        tot = sum(x[2] for x in t)
        print(f"profiled self cpu total {tot/1e3:.1f} ms/step over {sum(x[1] for x in t):.0f} op calls")
        for k, n, self_us, tot_us in t[:45]:
            print(f"  {k:<50} {n:6.1f} calls  self {self_us:8.0f} us  total {tot_us:8.0f} us")
