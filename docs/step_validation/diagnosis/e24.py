"""Diagnosis e24 (issue 27, after runs 30-31; development check, not a validation): does the calibration time a
probe's step as the validation times a step?

Over the grids of the code as it stands (runs 22-25, 28) every grid was predicted long on average (log of measured /
predicted -0.009 to -0.085, mean -0.048). The step from a rank's CPU is fitted from the probes' whole steps, timed by
``calibrate_compute._worker``: after a barrier, ``reps`` calls of the step (its closing barrier included), each
rank's own clock, the *slowest rank's* time, the median over passes. ``benchmarks.step_validation`` times a step
between two barriers on *rank 0's* clock and takes the median over steps.

One launch per process count: the calibration's own ``_live_runner`` of three probes (every mesh, chunks 1 and 2),
each timed both ways, interleaved, 8 passes: (A) as the calibration (slowest rank), (A0) the same calls on rank 0's
clock, (B) as the validation (rank 0, a step between barriers, median over 3 steps a pass). Raw: e24.json.

    python docs/step_validation/diagnosis/e24.py measure   # ~3 min, exclusive CPU lock
    python docs/step_validation/diagnosis/e24.py > docs/step_validation/diagnosis/e24.log
"""
import json, math, statistics as st, sys, time
from pathlib import Path
sys.path.insert(0, '.')
from atp_pipeline.run import calibrate_compute as C

OUT = Path(__file__).with_name('e24.json')
PROBES = ['probe_gpt_s', 'probe_llama', 'probe_gpt2']
MESHES = {4: ((4, 1), (2, 2), (1, 4)), 2: ((2, 1), (1, 2))}


def worker(rank, world, models, plans, passes):
    import torch
    import torch.distributed as dist
    fns = [C._live_runner(p, models, rank) for p in plans]
    for f in fns:
        f(); f()
    a, a0, b = ([[] for _ in plans] for _ in range(3))
    for p in range(passes):
        for i, f in enumerate(fns):
            dist.barrier()  # (A): as calibrate_compute._worker (one call a batch: a probe step is > 10 ms)
            t0 = time.perf_counter()
            f()
            mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, mine)
            a[i].append(max(float(t) for t in every))
            a0[i].append(float(every[0]))
            for _ in range(3):  # (B): as benchmarks.step_validation (the step's closing barrier is its own)
                dist.barrier()
                t0 = time.perf_counter()
                f()
                b[i].append(time.perf_counter() - t0)
    return {'A': a, 'A0': a0, 'B': b}


def measure():
    from atp_pipeline.launch import spawn
    conf = Path('conf')
    built = C.compose_models(C.probe_entries(PROBES), conf)
    rows = []
    for world in (4, 2):
        plans = [(i, d1, d2, c) for i in range(len(PROBES)) for d1, d2 in MESHES[world] for c in (1, 2)]
        t0 = time.time()
        got = spawn(worker, world, [spec for _, spec in built], plans, 8, timeout=1800)[0]
        print(f'{world} processes: {len(plans)} plans in {time.time() - t0:.0f} s', file=sys.stderr)
        for j, (i, d1, d2, c) in enumerate(plans):
            rows.append({'probe': PROBES[i], 'processes': world, 'mesh': [d1, d2], 'chunks': c,
                         **{k: got[k][j] for k in ('A', 'A0', 'B')}})
    OUT.write_text(json.dumps({'date': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'rows': rows}, indent=1))


def analyse():
    data = json.loads(OUT.read_text())
    print(f"e24 (measured {data['date']}): a probe's step (ms), median over passes (A, A0) or over steps (B)")
    print("  probe        proc mesh/c     A (slowest rank)  A0 (rank 0)  B (validation)   A/B    A0/B")
    logs = {4: [], 2: []}
    for r in data['rows']:
        a, a0, b = st.median(r['A']), st.median(r['A0']), st.median(r['B'])
        logs[r['processes']].append((math.log(a / b), math.log(a0 / b)))
        print(f"  {r['probe']:12s} {r['processes']}    {r['mesh'][0]}x{r['mesh'][1]}/c{r['chunks']}   {a*1e3:8.2f}         "
              f"{a0*1e3:8.2f}     {b*1e3:8.2f}      {a/b:.3f}  {a0/b:.3f}")
    for P, v in logs.items():
        print(f"  {P} processes: log A/B mean {st.mean(x for x, _ in v):+.3f} (sd {st.pstdev(x for x, _ in v):.3f}), "
              f"log A0/B mean {st.mean(y for _, y in v):+.3f}")


if __name__ == '__main__':
    if sys.argv[1:] == ['measure']:
        measure()
    else:
        analyse()
