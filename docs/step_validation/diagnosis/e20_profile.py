"""Diagnosis e20, profile (issue 27, after runs 20-21): one forward and backward of three probes on 2 processes
(2x1, chunks 1, collectives run): the rank's CPU (process_time, 20 steps) against the framework's prediction of run 21's
calibration (local_loop2.yaml), and torch.profiler's self time by operator (5 steps): DTensor to_local
(_FromTorchTensor, _ToTorchTensorBackward, PythonSubclass, _ToTorchTensor) per parameter read.

    python docs/step_validation/diagnosis/e20_profile.py > docs/step_validation/diagnosis/e20_profile.log
"""
import sys
from pathlib import Path
sys.path.insert(0, '.')
from atp_pipeline.run import calibrate_compute as C

def worker(rank, world, entries):
    import time
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, 'docs/step_validation/diagnosis')
    from e19_ops import runtime_step
    out = []
    for label, spec, mesh in entries:
        step = runtime_step(spec, mesh)
        for _ in range(3):
            step()
        c0 = time.process_time()
        for _ in range(20):
            step()
        cpu = (time.process_time() - c0) / 20
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
        ka = prof.key_averages()
        rows = sorted(((e.key, e.count / 5, e.self_cpu_time_total / 5) for e in ka), key=lambda x: -x[2])
        out.append((label, mesh, cpu, rows[:22], sum(r[2] for r in rows)))
    return out

if __name__ == '__main__':
    from atp_pipeline.launch import spawn
    conf = Path('conf')
    names = ['probe_gpt_s', 'probe_llama', 'probe_gpt2']
    built = C.compose_models([(n, C.PROBES[n]) for n in names], conf)
    res = spawn(worker, 2, [(n, spec, (2, 1)) for n, (_, spec) in zip(names, built)], timeout=600)[0]
    import yaml
    from atp_pipeline.planning.compute_profile import profile_of
    from benchmarks.step_validation import load_calibrated
    topo, _ = load_calibrated('docs/step_validation/local_loop2.yaml', '', conf)
    prof = profile_of(topo)
    for (label, mesh, cpu, rows, tot), (sh, _) in zip(res, built):
        K, n, m, B, r = C.plan_features(prof, sh, mesh, 1)
        fw = prof.framework
        print(f"{label} {mesh}: measured fwd+bwd CPU {cpu*1e3:.2f} ms; profiler self total {tot/1e3:.2f} ms; program K {K*1e3:.2f} ms, n {n} kernels, m {m} calls, r {r} parameter reads -> framework {C.framework_seconds(fw, (K, n, m, B, r))*1e3:.2f} ms")
        for k, c, t in rows:
            print(f"    {k:45s} {c:6.1f} calls {t:8.0f} us")
