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


def main():
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
            level = {n: st.median(math.log(r["measured_s"] / f(r)) for r in rows if r["processes"] == n) for n in (2, 4)}
            print(f"  {name:32s} median {100 * st.median(errs):5.1f} %  worst {100 * max(errs):5.1f} %  "
                  f"rho (least per model) {rho:.3f}  best {best}/{len(groups)}  "
                  f"median log(measured/predicted) 2 proc. {level[2]:+.3f}, 4 proc. {level[4]:+.3f}")
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


if __name__ == "__main__":
    main()
