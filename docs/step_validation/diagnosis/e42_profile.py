"""Diagnosis e42, a step's operators (issue 27, run 50): one validation-size point (model, batch, sequence, and
``d1,d2,chunks``) on 2 processes under torch.profiler, rank 0's self CPU per step by operator beside a committed
calibration's price of the step program's kernels by kind, by score elements (since run 50) and by FLOPs (before).

    python docs/step_validation/diagnosis/e42_profile.py gpt2_tiny 16 120 2,1,1
"""
import json, sys, time, collections
from pathlib import Path
sys.path.insert(0, ".")
CONF = Path("conf")

def work(rank, world, spec):
    import copy, torch
    from torch.profiler import profile, ProfilerActivity
    from atp_pipeline.lightning.module import adamw
    from atp_pipeline.models.adapter import get_adapter
    from atp_pipeline.parallel import init_mesh
    from atp_pipeline.parallel.apply import apply_plan
    ad = get_adapter(spec["family"]); torch.manual_seed(0); dense = ad.build(spec["model_config"])
    d1, d2, c = spec["cell"]
    mesh = init_mesh((d1, d2)); model = copy.deepcopy(dense); apply_plan(model, ad.parallel_plan(model), mesh, c)
    opt = adamw(model.parameters(), lr=1e-4)
    b, s = spec["batch"], spec["seq_len"]
    idx = torch.randint(0, 256, (b, s)); tgt = torch.randint(0, 256, (b, s))
    def step():
        ad.lm_loss(model, idx, tgt).backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(3): step()
    c0 = time.process_time()
    for _ in range(5): step()
    plain = (time.process_time() - c0) / 5
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(5): step()
    agg = collections.Counter()
    for e in p.key_averages():
        agg[e.key] += e.self_cpu_time_total / 5 / 1e3
    return {"plain_ms": plain * 1e3, "ops": dict(agg.most_common(40))}

def main():
    from atp_pipeline.launch import spawn
    from atp_pipeline.run.calibrate_compute import compose_models
    from benchmarks.step_validation import variant_overrides, load_calibrated
    from atp_pipeline.planning.compute_profile import profile_of
    from atp_pipeline.planning.step_program import build_program, all_items
    m, b, s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); cell = tuple(int(x) for x in sys.argv[4].split(","))
    (shape, spec), = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, CONF))], CONF)
    topo, _ = load_calibrated("docs/step_validation/local_lb.yaml", "unused", CONF); prof = profile_of(topo)
    prog, _ = build_program(shape, cell[:2], b, cell[2])
    import contextlib
    sys.path.insert(0, str(Path(__file__).parent))
    from e42 import by_flops, by_scores, fresh
    for label, p, flops in (("by score elements", by_scores(prof), False), ("by FLOPs (before run 50)", fresh(prof), True)):
        by = collections.Counter(); cnt = collections.Counter()
        with by_flops() if flops else contextlib.nullcontext():
            for it in all_items(prog):
                if it[0] == "k": by[it[1].kind] += p.seconds(it[1]) * 1e3; cnt[it[1].kind] += 1
        print(f"the program's kernels priced {label} (ms):", {k: round(v, 2) for k, v in by.items()}, "calls", dict(cnt))
    got = spawn(work, 2, {**spec, "cell": cell}, timeout=600)[0]
    print("plain step CPU ms", round(got["plain_ms"], 1))
    tot = sum(got["ops"].values())
    for k, v in got["ops"].items(): print(f"  {k:45s} {v:7.2f}")
    print("sum of top ops", round(tot, 1))
if __name__ == "__main__":
    main()
