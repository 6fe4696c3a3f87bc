"""Diagnosis e44 (session 54): ranks pinned to cores against the scheduler's placement.

    python docs/step_validation/diagnosis/e44_pin.py <repeats> <model> <batch> <seq> > <log>

The validation's worker (``benchmarks.step_validation._worker``) on 4 processes (4x1/c1, 2x2/c1,
1x4/c2) and on 2 (2x1/c1, 1x2/c2) of ``<model>`` at ``<batch>x<seq>``, launched ``<repeats>`` times
each way, pinned (each rank to core ``rank % cores`` of its affinity, after its process group
started) and not, alternating which goes first. Per way: the launches' level (the mean log of
their points' median steps) and its standard deviation over the launches, the ranks' CPU the same.
A session-local check: nothing in the runtime pins (``atp_pipeline/launch.py``)."""
import json, math, os, statistics as st, sys, time
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
from benchmarks.step_validation import _worker, variant_overrides, CONF


def pinned(rank, world, spec):
    if spec.get("pin"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return _worker(rank, world, spec)


if __name__ == "__main__":
    from atp_pipeline.launch import spawn
    from atp_pipeline.run.calibrate_compute import compose_models
    model, b, s = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    entries = [(f"{model}@{b}x{s}", variant_overrides(model, b, s, CONF))]
    (shape, spec), = compose_models(entries, CONF)
    out = []
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for rep in range(n):
        for w, pts in ((4, [(4, 1, 1, False), (2, 2, 1, False), (1, 4, 2, False)]), (2, [(2, 1, 1, False), (1, 2, 2, False)])):
            for pin in ((False, True) if rep % 2 == 0 else (True, False)):
                s = {**spec, "points": pts, "emulate": None, "slowdown": 1.0, "steps": 3, "warmup": 2, "repeats": 4, "pin": pin}
                t0 = time.time()
                ranks = spawn(pinned, w, s, timeout=600)
                got = ranks[0]
                med = {k: st.median(v) for k, v in got["times"].items()}
                cpu = {k: st.mean(st.median(r["cpus"][k]) for r in ranks) for k in got["times"]}
                rec = {"rep": rep, "w": w, "pin": pin, "med": med, "cpu": cpu, "foreign": got["foreign"], "wall": time.time() - t0}
                out.append(rec)
                print(json.dumps(rec), flush=True)
    for w in (4, 2):
        for pin in (False, True):
            rs = [r for r in out if r["w"] == w and r["pin"] == pin]
            keys = list(rs[0]["med"])
            lv = [st.mean(math.log(r["med"][k]) for k in keys) for r in rs]
            lc = [st.mean(math.log(r["cpu"][k]) for k in keys) for r in rs]
            print(f"w={w} pin={pin}: level mean {st.mean(lv):.3f} sd {st.stdev(lv):.3f}  cpu level {st.mean(lc):.3f} sd {st.stdev(lc):.3f}  per point " +
                  " ".join(f"{k}:{1e3*math.exp(st.mean(math.log(r['med'][k]) for r in rs)):.0f}ms/sd{st.stdev([math.log(r['med'][k]) for r in rs]):.3f}" for k in keys))
