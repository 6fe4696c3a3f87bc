"""A/B: collective-free forward+backward CPU per step (rank mean) of probe plans, code at sys.argv[1]."""
import sys, json, time
root = sys.argv[1]; sys.path.insert(0, root)
from pathlib import Path

def worker(rank, world, plans, models):
    import torch.distributed as dist
    from atp_pipeline.run.calibrate_compute import _plan_runner, _live_runner
    out = {}
    for plan in plans:
        fn = _live_runner(plan[:4], models, rank) if plan[-1] == 'live' else _plan_runner(plan[:4], models, rank)
        for _ in range(5): fn()
        best = []
        for _ in range(5):
            dist.barrier(); c0 = time.process_time(); w0 = time.perf_counter()
            for _ in range(10): fn()
            best.append(((time.process_time() - c0) / 10, (time.perf_counter() - w0) / 10))
        best.sort()
        out[str(plan)] = best[len(best) // 2]
    return out

def main():
    from atp_pipeline.launch import spawn
    from atp_pipeline.run.calibrate_compute import compose_models, probe_entries
    names = ['probe_llama_b48', 'probe_gpt2_b48'] if 'probe_gpt2_b48' in __import__('atp_pipeline.run.calibrate_compute', fromlist=['PROBES']).PROBES else ['probe_llama_b48']
    names = ['probe_llama_b48']
    built = compose_models(probe_entries(names), Path(root) / 'conf')
    plans = [(0, 2, 1, 1, 'plan'), (0, 1, 2, 1, 'plan'), (0, 2, 1, 1, 'live'), (0, 1, 2, 1, 'live')]
    res = spawn(worker, 2, plans, [sp for _, sp in built])
    print(json.dumps({k: [round(x * 1e3, 2) for x in v] for k, v in res[0].items()}))
if __name__ == '__main__':
    main()
