"""Diagnosis e42, the cells against the tokens (issue 27, run 50): two validation families at five batch x sequence sizes
(240-2,400 tokens), every cell of 2 processes, one launch per size, priced by a committed calibration at its own
speed. Per size: the level (mean over the cells of log measured / predicted step) and each cell against it, step and
rank CPU (step/CPU). Development data, not a validation (a launch per size, no host speed). ``--by-flops``: the
attention cores priced as before run 50 (interpolated by their FLOPs).

    python docs/step_validation/diagnosis/e42_tokens.py docs/step_validation/local_lb.yaml gpt2_tiny,llama_tiny \
        4x60,8x60,8x120,16x120,12x200
"""
import json, math, statistics as st, sys
from pathlib import Path
sys.path.insert(0, ".")
from benchmarks.step_validation import _worker, load_calibrated, variant_overrides
from atp_pipeline.launch import spawn
from atp_pipeline.planning.compute_profile import profile_of
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run.calibrate_compute import compose_models
sys.path.insert(0, str(Path(__file__).parent))
from e42 import by_flops  # noqa: E402
CONF = Path("conf")
def main():
    cal = sys.argv[1]; models = sys.argv[2].split(","); variants = [tuple(map(int, v.split("x"))) for v in sys.argv[3].split(",")]
    W = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4].isdigit() else 2
    if "--by-flops" in sys.argv:
        by_flops().__enter__()  # for the rest of this process: every price as before run 50
    topo, _ = load_calibrated(cal, "unused", CONF); prof = profile_of(topo)
    ent = [(f"{m}@{b}x{s}", variant_overrides(m, b, s, CONF)) for m in models for b, s in variants]
    pts = [(2, 1, 1, False), (2, 1, 2, False), (1, 2, 1, False), (1, 2, 2, False)] if W == 2 else \
          [(4, 1, 1, False), (4, 1, 2, False), (2, 2, 1, False), (2, 2, 2, False), (1, 4, 1, False), (1, 4, 2, False)]
    for (name, _), (shape, spec) in zip(ent, compose_models(ent, CONF)):
        spec = {**spec, "points": pts, "emulate": None, "slowdown": 1.0, "steps": 3, "warmup": 2, "repeats": 3}
        ranks = spawn(_worker, W, spec, timeout=900)
        qs = []
        for d1, d2, c, e in pts:
            key = json.dumps([d1, d2, c, e])
            T = st.median(ranks[0]["times"][key]); U = st.mean(st.median(g["cpus"][key]) for g in ranks)
            est = estimate_step(topo.restrict(W), shape, (d1, d2), StepSetting(chunks=c), prof)
            qs.append((f"{d1}x{d2}c{c}", math.log(T / est.step_s), math.log(U / est.cpu_s)))
        m = st.mean(q[1] for q in qs); mu = st.mean(q[2] for q in qs)
        print(f"{name:22s} level {m:+.3f} | " + " ".join(f"{k} {t - m:+.3f}/{u - mu:+.3f}" for k, t, u in qs), flush=True)


if __name__ == "__main__":
    main()
