"""Where a validation model's collective-free forward + backward CPU goes (torch.profiler self CPU by
ATen op, rank 0) against what the calibration prices its program's kernels at, by kind.

    python docs/step_validation/diagnosis/e47/profile_models.py CALIBRATION.yaml WORLD MESH MODEL:BxS,...
e.g. docs/step_validation/local_gc1.yaml 2 2x1 gpt2_tiny:12x140,small:12x140"""
import sys, time, collections
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from pathlib import Path


def worker(rank, world, plans, models):
    import torch
    import torch.distributed as dist
    from torch.profiler import profile, ProfilerActivity
    from atp_pipeline.run.calibrate_compute import _plan_runner
    out = {}
    for plan in plans:
        fn = _plan_runner(plan, models, rank)
        for _ in range(5):
            fn()
        dist.barrier()
        c0 = time.process_time()
        for _ in range(10):
            fn()
        cpu = (time.process_time() - c0) / 10
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fn()
        out[str(plan)] = {'cpu': cpu, 'ops': {e.key: (e.count / 10, e.self_cpu_time_total / 10 / 1e6)
                                              for e in prof.key_averages()}}
    return out


def main():
    from atp_pipeline.launch import spawn
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.planning.step_program import build_program, all_items
    from atp_pipeline.run.calibrate_compute import compose_models
    from benchmarks.step_validation import load_calibrated, variant_overrides
    cal, world, mesh = sys.argv[1], int(sys.argv[2]), tuple(int(x) for x in sys.argv[3].split('x'))
    specs = [(m.split(':')[0], *map(int, m.split(':')[1].split('x'))) for m in sys.argv[4].split(',')]
    prof = profile_of(load_calibrated(cal, '', Path('conf'))[0])
    entries = [(f"{n} b{b} s{s}", variant_overrides(n, b, s, Path('conf'))) for n, b, s in specs]
    built = compose_models(entries, Path('conf'))
    plans = [(i, mesh[0], mesh[1], 1) for i in range(len(entries))]
    res = spawn(worker, world, plans, [sp for _, sp in built])[0]
    for (i, *_), (name, _) in zip(plans, entries):
        r = res[str((i, mesh[0], mesh[1], 1))]
        shape = built[i][0]
        prog, _ = build_program(shape, mesh, shape.batch_size, 1)
        by = collections.defaultdict(lambda: [0, 0.0])
        for it in all_items(prog):
            if it[0] == 'k' and it[1].kind != 'optimizer':
                by[it[1].kind][0] += 1
                by[it[1].kind][1] += prof.seconds(it[1])
        ops = sorted(r['ops'].items(), key=lambda kv: -kv[1][1])
        tot = sum(t for _, (_, t) in ops)
        print(f"{name} {mesh[0]}x{mesh[1]}/c1 cpu {r['cpu']*1e3:.2f} ms, profiled self {tot*1e3:.2f} ms; priced by kind: "
              + ", ".join(f"{k} {n}x {t*1e3:.2f} ms" for k, (n, t) in sorted(by.items())))
        for k, (n, t) in ops[:22]:
            print(f"   {k:50s} {n:6.0f} {t*1e3:7.3f} ms")


if __name__ == '__main__':
    main()
