"""Issue 27 / run 10 diagnosis: is the reference probe's noise per pass or per launch?

    flock -x /tmp/atp-cpu.lock python docs/step_validation/diagnosis/e10.py [launches] [passes]

Times the reference probe's set (atp_pipeline.run.calibrate_compute.REFERENCE and probe_gpt_s's
collective-free 4x1 step) with the calibration's own worker (_worker: 4 processes at once, a rank's
CPU per call) in `launches` launches of `passes` interleaved passes each, and prints per launch and
measurement the median and the spread (quartiles) over the passes, then the spread of the launches'
medians and of the geometric means per group. Appends the JSON to e10.jsonl.
"""
import json
import math
import statistics as S
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
HERE = Path(__file__).resolve().parent


def main(launches=3, passes=15):
    from atp_pipeline.launch import spawn
    from atp_pipeline.run import calibrate_compute as cc

    built = cc.compose_models(cc.probe_entries([cc.REFERENCE_STEP]), cc.CONF)
    kernels = [k for ks in cc.REFERENCE.values() for k in ks]
    labels = [cc.reference_label(k) for k in kernels] + ["step"]
    groups = [g for g, ks in cc.REFERENCE.items() for _ in ks] + ["overhead"]
    out = []
    for li in range(launches):
        t0 = time.time()
        runs = spawn(cc._worker, 4, kernels, passes, 10.0, [(0, 4, 1, 1)], [built[0][1]], (), "", (), timeout=600)[0]
        per = [[c * 1e6 for _, c, _ in r] for r in runs[:-1]]  # per measurement: a rank's CPU per call, every pass
        out.append({"utc": time.strftime("%H:%M:%S", time.gmtime(t0)), "cpu_us": dict(zip(labels, per)),
                    "foreign": runs[-1]})
        for lab, xs in zip(labels, per):
            q = S.quantiles(xs, n=4)
            print(f"launch {li} {lab:<18} median {S.median(xs):8.1f} us  quartiles {q[0]:8.1f} {q[2]:8.1f} "
                  f"(IQR/median {(q[2] - q[0]) / S.median(xs):.2f})")
    print("launch medians / launch 0's; geometric mean per group; also with the first half and second half of passes")
    for li, o in enumerate(out):
        row = []
        for g in ("compute", "overhead"):
            for sl, name in ((slice(None), "all"), (slice(0, passes // 2), "1st"), (slice(passes // 2, None), "2nd")):
                r = [S.median(o["cpu_us"][lab][sl]) / S.median(out[0]["cpu_us"][lab]) for lab, gg in zip(labels, groups) if gg == g]
                row.append(f"{g} {name} {math.exp(sum(map(math.log, r)) / len(r)):.3f}")
        print(f"launch {li} {o['utc']}: " + ", ".join(row))
    with open(HERE / "e10.jsonl", "a") as f:
        f.write(json.dumps({"launches": out, "passes": passes}) + "\n")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:]))
