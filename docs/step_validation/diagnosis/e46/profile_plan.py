"""Where a collective-free probe plan's CPU goes: torch.profiler self CPU by ATen op, rank 0.

    profile_plan.py PROBES WORLD MESHES [--shapes]   e.g. probe_llama_b48,probe_gpt_s_b48 2 2x1
--shapes: the copies, fills and elementwise ops by input shape instead."""
import sys, json, collections, time
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
from pathlib import Path

SHAPES = '--shapes' in sys.argv


def worker(rank, world, plans, models):
    import torch
    from torch.profiler import profile, ProfilerActivity
    from atp_pipeline.run.calibrate_compute import _plan_runner
    out = {}
    for plan in plans:
        fn = _plan_runner(plan, models, rank)
        for _ in range(5): fn()
        import torch.distributed as dist
        dist.barrier()
        c0 = time.process_time()
        for _ in range(20): fn()
        cpu = (time.process_time() - c0) / 20
        with profile(activities=[ProfilerActivity.CPU], record_shapes=SHAPES) as prof:
            for _ in range(10): fn()
        tab = {}
        for e in prof.key_averages(group_by_input_shape=SHAPES):
            if not SHAPES:
                tab[e.key] = (e.count / 10, e.self_cpu_time_total / 10 / 1e6)
            elif e.key in ('aten::copy_', 'aten::fill_', 'aten::clone', 'aten::cat', 'aten::mul', 'aten::add'):
                tab[e.key + ' ' + str(e.input_shapes)[:90]] = (e.count / 10, e.self_cpu_time_total / 10 / 1e6)
        out[str(plan)] = {'cpu': cpu, 'ops': tab}
    return out

def main():
    from atp_pipeline.launch import spawn
    from atp_pipeline.run.calibrate_compute import compose_models, probe_entries
    names = sys.argv[1].split(',')
    world = int(sys.argv[2]); meshes = [tuple(map(int, m.split('x'))) for m in sys.argv[3].split(',')]
    built = compose_models(probe_entries(names), Path('conf'))
    plans = [(i, d1, d2, 1) for i in range(len(names)) for d1, d2 in meshes]
    res = spawn(worker, world, plans, [sp for _, sp in built])[0]
    json.dump(res, open(str(Path(__file__).with_name(f'profile_{"shapes" if SHAPES else "plan"}_{world}proc.json')), 'w'))
    for plan, r in res.items():
        ops = sorted(r['ops'].items(), key=lambda kv: -kv[1][1])
        tot = sum(t for _, (_, t) in ops)
        print(names[eval(plan)[0]], plan, f"cpu {r['cpu']*1e3:.2f} ms, profiled self total {tot*1e3:.2f} ms")
        for k, (n, t) in ops[:25]:
            print(f"   {k:45s} {n:6.0f} {t*1e3:7.3f} ms")
if __name__ == '__main__':
    main()
