"""Diagnosis e40 (issue 27, run 45): which host speed tracks a launch's level — the kernel reference probe or
the probes' whole steps?

Arithmetic on the rows of the two diagnosis grids of run 45 (``steps_sp1.json``: the fresh calibration
``local_sp1.yaml``; ``steps_sp2.json``: run 44's ``local_br5.yaml``, two days old), measured with the harness of
that commit: before each launch the two probes' whole steps (``probe_gpt_s``, ``probe_llama``, every mesh and chunk
count of its process count) and the kernel reference probe, after it the probes' steps again; rows carry
``probe_steps`` (measured / the calibration's prediction, before and ``after``), ``host_speed`` (the kernel
reference's bracket, what ``predicted_s`` is priced at) and ``predicted_at_calibration_speed_s``. Each row is
priced again at: the calibration's speed (none); the kernel bracket; the probes' steps before the launch; their
geometric mean before and after (steps bracket); and that over the same steps' ratio at calibration (from the
calibration's ``*_probe_steps.json``: the steps read against their own time then, as ``stage=plan`` now reads them).
Before that, (0): one launch (``gpt2_tiny`` b4 s168, 2 processes) on the two-day-old calibration timed five times in a
row with the kernel bracket, and once with the probes' steps (``diagnosis/run45_ab/``, code 3cbc022). After it, (2):
over every launch of the grids, the correlation of its level (measured / predicted at the calibration's speed,
median) with the log of each speed it was or could be priced at — the probes' steps over the five grids of runs 45-46
(run 46's rows are priced at them), the kernel reference (per-call work) over the fourteen grids of runs 37-44.

    python docs/step_validation/diagnosis/e40.py
"""

import json
import math
import statistics as st
from collections import defaultdict

ROOT = "docs/step_validation"
GRIDS = (("steps_sp1.json", "local_sp1_probe_steps.json"), ("steps_sp2.json", "local_br5_probe_steps.json"))
PROBES = ("probe_gpt_s", "probe_llama")


def spearman(a, b):
    ra = {v: i for i, v in enumerate(sorted(a))}
    rb = {v: i for i, v in enumerate(sorted(b))}
    x, y = [ra[v] for v in a], [rb[v] for v in b]
    mx, my = st.fmean(x), st.fmean(y)
    return sum((p - mx) * (q - my) for p, q in zip(x, y)) / math.sqrt(
        sum((p - mx) ** 2 for p in x) * sum((q - my) ** 2 for q in y))


def at_calibration(probe_steps):
    """Per process count, the geometric mean of measured / predicted over the two probes' steps at calibration."""
    rows = json.load(open(f"{ROOT}/{probe_steps}"))["rows"]
    return {n: math.exp(st.fmean(math.log(r["measured_s"] / r["predicted_s"]) for r in rows
                                 if r["processes"] == n and r["probe"] in PROBES)) for n in (2, 4)}


def level(v):
    return st.median(math.log(r["measured_s"] / r["predicted_at_calibration_speed_s"]) for r in v)


def by_group(rows):
    groups = defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    return groups


def main():
    print("(0) gpt2_tiny b4 s168 on 2 processes, local_br5.yaml (2026-11-29): five launches priced at the kernel bracket")
    for i in range(1, 6):
        rows = json.load(open(f"{ROOT}/diagnosis/run45_ab/kernels_{i}.json"))["rows"]
        hs = rows[0]["host_speed"]
        print(f"  launch {i}: kernel reference x{hs['compute']:.2f} (kernels), x{hs['overhead']:.2f} (per-call work); "
              f"measured / predicted at the calibration's speed x{math.exp(level(rows)):.2f}, at the kernels' "
              f"x{math.exp(st.median(math.log(r['measured_s'] / r['predicted_s']) for r in rows)):.2f}")
    rows = json.load(open(f"{ROOT}/diagnosis/run45_ab/steps.json"))["rows"]
    for n in (2, 4):
        v = [r for r in rows if r["processes"] == n]
        print(f"  the probes' steps on {n} processes x{v[0]['probe_steps']['ratio']:.2f} their prediction; that launch "
              f"measured / predicted at the calibration's speed x{math.exp(level(v)):.2f}")
    print("(1) the diagnosis grids priced again at each speed")
    for grid, probe_steps in GRIDS:
        rows = [r for r in json.load(open(f"{ROOT}/{grid}"))["rows"] if r["class"] == "real"]
        cal = at_calibration(probe_steps)
        flat = lambda r: r["predicted_at_calibration_speed_s"]  # noqa: E731
        span = lambda r: math.sqrt(r["probe_steps"]["ratio"] * r["probe_steps"]["after"])  # noqa: E731
        policies = {
            "calibration's speed": flat,
            "kernel bracket": lambda r: r["predicted_s"],
            "steps before": lambda r: flat(r) * r["probe_steps"]["ratio"],
            "steps bracket": lambda r: flat(r) * span(r),
            "steps bracket / at calibration": lambda r: flat(r) * span(r) / cal[r["processes"]],
        }
        print(f"{grid} ({len(rows)} real points; the two probes' steps at calibration, measured / predicted: "
              f"2 proc. x{cal[2]:.3f}, 4 proc. x{cal[4]:.3f})")
        groups = defaultdict(list)
        for r in rows:
            groups[r["group"]].append(r)
        for name, f in policies.items():
            errs = [abs(f(r) - r["measured_s"]) / r["measured_s"] for r in rows]
            best = sum(min(v, key=f)["point"] == min(v, key=lambda r: r["measured_s"])["point"] for v in groups.values())
            rho = min(spearman([f(r) for r in rows if r["model"] == m], [r["measured_s"] for r in rows if r["model"] == m])
                      for m in {r["model"] for r in rows})
            lv = {n: st.median(math.log(r["measured_s"] / f(r)) for r in rows if r["processes"] == n) for n in (2, 4)}
            print(f"  {name:32s} median {100 * st.median(errs):5.1f} %  worst {100 * max(errs):5.1f} %  "
                  f"rho (least per model) {rho:.3f}  best {best}/{len(groups)}  "
                  f"median log(measured/predicted) 2 proc. {lv[2]:+.3f}, 4 proc. {lv[4]:+.3f}")
        print("  per launch: log(measured / predicted at the calibration's speed) median; log of the probes' steps "
              "before / after; log of the kernel bracket's per-call speed")
        for key, v in groups.items():
            ps, hs = v[0]["probe_steps"], v[0]["host_speed"]
            lv = st.median(math.log(r["measured_s"] / flat(r)) for r in v)
            print(f"    {key:38s} {lv:+.3f}   steps {math.log(ps['ratio']):+.3f} / {math.log(ps['after']):+.3f}   "
                  f"kernels {math.log(hs['overhead']):+.3f}")
        levels = [st.median(math.log(r["measured_s"] / flat(r)) for r in v) for v in groups.values()]
        steps = [math.log(span(v[0])) for v in groups.values()]
        kern = [math.log(v[0]["host_speed"]["overhead"]) for v in groups.values()]
        print(f"  correlation over the launches of their level with: the steps bracket {st.correlation(levels, steps):.2f}, "
              f"the kernel bracket {st.correlation(levels, kern):.2f}")
    tracking()


def tracking():
    """(2) per launch, its level against the log of a speed: the correlation and the slope."""
    steps, kernels = [], []
    for grid, probe_steps in GRIDS:
        cal = at_calibration(probe_steps)
        for v in by_group(r for r in json.load(open(f"{ROOT}/{grid}"))["rows"] if r["class"] == "real").values():
            ps = v[0]["probe_steps"]
            steps.append((math.log(math.sqrt(ps["ratio"] * ps["after"]) / cal[v[0]["processes"]]), level(v)))
    for grid in ("steps_st1.json", "steps_st2.json", "steps_st3.json"):
        for v in by_group(r for r in json.load(open(f"{ROOT}/{grid}"))["rows"] if r["class"] == "real").values():
            steps.append((math.log(v[0]["host_speed"]["compute"]), level(v)))
    for tag in ("calls1", "calls2", "wait1", "wait2", "wait3", "wait4", "opt1", "opt2", *(f"br{i}" for i in range(1, 7))):
        for v in by_group(r for r in json.load(open(f"{ROOT}/steps_{tag}.json"))["rows"] if r["class"] == "real").values():
            kernels.append((math.log(v[0]["host_speed"]["overhead"]), level(v)))
    print("(2) each launch's level against the log of the speed (correlation, least-squares slope)")
    for name, pts in (("the probes' steps, steps_sp1/sp2/st1/st2/st3", steps),
                      ("the kernel reference, steps_calls1-2, wait1-4, opt1-2, br1-6", kernels)):
        xs, ys = zip(*pts)
        print(f"  {name}: {len(pts)} launches, correlation {st.correlation(xs, ys):.2f}, "
              f"slope {st.covariance(xs, ys) / st.variance(xs):.2f}")


if __name__ == "__main__":
    main()
