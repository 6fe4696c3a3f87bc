"""Issue 27 / run 10 diagnosis: what moves between calibrations, the host or the measurement?

    flock -x /tmp/atp-cpu.lock python docs/step_validation/diagnosis/e9.py probe [label]

Times the reference probe (atp_pipeline.run.calibrate_compute.reference_probe: the calibration's own
kernel runners at fixed sweep shapes and probe_gpt_s's collective-free 4x1 step, 4 processes at once,
a rank's CPU per call, median of 5 passes) once and appends one JSON line to e9_probe.jsonl with the
UTC time, the host's steal and other jobs' CPU over the probe (/proc/stat), the CPU MHz (/proc/cpuinfo)
and a single-process pure-Python loop's rate (work per CPU-second, no torch).

    python docs/step_validation/diagnosis/e9.py compare <calibration.yaml> ...

The calibrations' prices at the probe's shapes (their sweep points), their framework fits and
their recorded reference probe, side by side.
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")  # run from the repository root
HERE = Path(__file__).resolve().parent


def stat():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v[:3]) + sum(v[5:8]), v[7], sum(v[:8])  # busy, steal, total (ticks)


def mhz():
    return [float(l.split(":")[1]) for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")]


def py_rate(seconds=0.5):
    c0, n = time.process_time(), 0
    while time.process_time() - c0 < seconds:
        x = 0
        for i in range(10000):
            x += i * i
        n += 1
    return n / (time.process_time() - c0)


def probe(label):
    from atp_pipeline.run.calibrate_compute import reference_probe

    rate0 = py_rate()
    s0, t0 = stat(), time.time()
    ref = reference_probe(4)
    s1, t1 = stat(), time.time()
    row = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "label": label, "wall_s": round(t1 - t0, 2),
           "busy_cores": round((s1[0] - s0[0]) / 100 / (t1 - t0), 3), "steal_cores": round((s1[1] - s0[1]) / 100 / (t1 - t0), 4),
           "mhz": mhz(), "py_loops_per_cpu_s": round((rate0 + py_rate()) / 2, 1),
           "reference_us": {g: {k: round(v * 1e6, 2) for k, v in d.items()} for g, d in ref.items()}}
    with open(HERE / "e9_probe.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


def compare(paths):
    import yaml

    from atp_pipeline.planning.compute_profile import ComputeProfile, host_speed
    from atp_pipeline.run.calibrate_compute import REFERENCE, reference_label

    profs = [(p, ComputeProfile.from_config(yaml.safe_load(open(p))["device"]["compute"])) for p in paths]
    for p, pr in profs:
        fw = pr.framework
        print(f"{p}: {pr.date} peak {pr.peak_flops / 1e9:.1f} GFLOP/s, framework {fw.per_kernel_s * 1e6:.1f} us/kernel "
              f"+ {fw.kernel_factor:.1%}, {fw.per_collective_s * 1e6:.0f} us/collective")
        for g, ks in REFERENCE.items():
            print(f"  sweep points ({g}): " + ", ".join(f"{reference_label(k)} {pr.seconds(k) * 1e6:.1f} us" for k in ks))
        for g, d in pr.reference.items():
            print(f"  reference probe ({g}): " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in d.items()))
    base = profs[0][1]
    for p, pr in profs[1:]:
        for g, ks in REFERENCE.items():
            r = [pr.seconds(k) / base.seconds(k) for k in ks]
            print(f"{p} / {paths[0]} sweep points ({g}): " + ", ".join(f"{x:.3f}" for x in r))
        if pr.reference and base.reference:
            print(f"{p} / {paths[0]} reference probe: {host_speed(base.reference, pr.reference).describe()}")


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe(sys.argv[2] if len(sys.argv) > 2 else "")
    else:
        compare(sys.argv[2:])
