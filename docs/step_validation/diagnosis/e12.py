"""Issue 27 / run 10 diagnosis: do two calibrations taken back to back predict the same steps, with and
without pricing both at one host speed (their recorded reference probes)?

    python docs/step_validation/diagnosis/e12.py <a.yaml> <b.yaml> <rows.json> ...

Predicts the measured rows of earlier runs (their shapes, meshes, chunks, processes) from both
calibrations and prints b/a per row's predicted step (median, range): as calibrated, and with a priced
at b's recorded host speed (a.at_speed(host_speed(a.reference, b.reference))). Nothing is measured.
"""
import json
import statistics as S
import sys
from pathlib import Path

sys.path.insert(0, ".")


def main(a_path, b_path, *row_files):
    from benchmarks.step_validation import load_calibrated, variant_overrides
    from atp_pipeline.planning.compute_profile import host_speed, profile_of
    from atp_pipeline.planning.steptime import StepSetting, estimate_step
    from atp_pipeline.run.calibrate_compute import CONF, compose_models

    (ta, ca), (tb, cb) = load_calibrated(a_path, "", CONF), load_calibrated(b_path, "", CONF)
    pa, pb = profile_of(ta), profile_of(tb)
    speed = host_speed(pa.reference, pb.reference)
    aligned = pa.at_speed(speed)
    print(f"a {a_path} ({ca['sha256']}), b {b_path} ({cb['sha256']}); b's reference probe / a's: {speed.describe()}")
    for f in row_files:
        rows = [r for r in json.loads(Path(f).read_text())["rows"] if r["interconnect"] == "gloo"]
        keys = sorted({(r["model"], r["batch"], r["seq_len"]) for r in rows})
        shapes = dict(zip(keys, (sh for sh, _ in compose_models(
            [(f"{m}@{b}x{s}", variant_overrides(m, b, s, CONF)) for m, b, s in keys], CONF))))
        raw, al = [], []
        for r in rows:
            d1, d2 = (int(x) for x in r["mesh"].split("x"))
            sh, st = shapes[(r["model"], r["batch"], r["seq_len"])], StepSetting(chunks=r["chunks"])
            eb = estimate_step(tb.restrict(r["processes"]), sh, (d1, d2), st, pb).step_s
            raw.append(eb / estimate_step(ta.restrict(r["processes"]), sh, (d1, d2), st, pa).step_s)
            al.append(eb / estimate_step(ta.restrict(r["processes"]), sh, (d1, d2), st, aligned).step_s)
        print(f"{f} ({len(rows)} rows): predicted b/a as calibrated median {S.median(raw):.3f} "
              f"({min(raw):.3f}-{max(raw):.3f}); a at b's reference speed: median {S.median(al):.3f} ({min(al):.3f}-{max(al):.3f})")


if __name__ == "__main__":
    main(*sys.argv[1:])
