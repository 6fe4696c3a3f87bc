"""Every committed grid whose calibration is committed beside it, its real rows predicted again from that
calibration in each form of the step residual (``cpu``: the step from a rank's CPU, ``terms``: the
terms' two factors), whatever form the calibration chose; each row scaled by its own host speed as
recorded (the row's ``host_speed``: the calibration's profile at that speed, as the validation prices
it). A development check of the form rule, not a validation: the rows were measured.

    python docs/step_validation/diagnosis/e48/forms.py [GRID_TAG ...]"""
import sys
from pathlib import Path as _P
sys.path.insert(0, str(_P(__file__).resolve().parents[4]))
import json, hashlib, statistics, tempfile, collections
import yaml
from pathlib import Path
from benchmarks.step_validation import load_calibrated, variant_overrides
from atp_pipeline.planning.compute_profile import HostSpeed, profile_of
from atp_pipeline.planning.steptime import StepSetting, estimate_step
from atp_pipeline.run.calibrate_compute import compose_models

root = Path(__file__).resolve().parents[4]
sv = root / "docs/step_validation"
CONF = root / "conf"
by_sha = {hashlib.sha256(p.read_bytes()).hexdigest()[:12]: p for p in sv.glob("local*.yaml")}


def figures(rows, key):
    errs = [abs(r[key] / r["measured_s"] - 1) for r in rows]
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    agree = sum(min(g, key=lambda r: r[key])["point"] == min(g, key=lambda r: r["measured_s"])["point"]
                for g in groups.values())
    return statistics.median(errs), max(errs), agree, len(groups)


tags = sys.argv[1:] or sorted(p.stem for p in sv.glob("*.json"))
out = {}
for tag in tags:
    data = json.loads((sv / f"{tag}.json").read_text())
    if not isinstance(data, dict) or "meta" not in data:
        continue
    cal = data["meta"].get("calibration")
    if not isinstance(cal, dict) or cal.get("sha256") not in by_sha:
        continue
    rows = [r for r in data["rows"] if r.get("interconnect") == "gloo" and r.get("predicted_at_calibration_speed_s")]
    if not rows:
        continue
    path = by_sha[cal["sha256"]]
    doc = yaml.safe_load(path.read_text())
    sr = doc["device"]["compute"].get("step_residual") or {}
    if "cpu_fit" not in sr:
        continue
    chose = sr.get("form", "terms")
    res = {"calibration": path.name, "chose": chose, "cv": sr.get("cv")}
    for form in ("cpu", "terms"):
        sr["form"] = form
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(doc, f)
        try:
            topo, _ = load_calibrated(f.name, "unused", CONF)
        finally:
            Path(f.name).unlink()
        profile = profile_of(topo)
        keys = sorted({(r["model"], r["batch"], r["seq_len"]) for r in rows})
        built = compose_models([(f"{m}@{b}x{s}", variant_overrides(m, b, s, CONF)) for m, b, s in keys], CONF)
        shapes = {k: sh for k, (sh, _) in zip(keys, built)}
        for r in rows:
            hs = r.get("host_speed") or {}
            p = profile.at_speed(HostSpeed(hs["compute"], hs["overhead"])) if hs else profile
            d1, d2 = (int(x) for x in r["mesh"].split("x"))
            est = estimate_step(topo.restrict(r["processes"]), shapes[(r["model"], r["batch"], r["seq_len"])],
                                (d1, d2), StepSetting(chunks=r["chunks"]), p)
            r["pred_form"] = est.step_s
        res[form] = figures(rows, "pred_form")
    res["as_committed"] = figures(rows, "predicted_s")
    out[tag] = res
    print(f"{tag:10s} {path.name:22s} chose {chose:5s} committed {res['as_committed'][0]*100:5.1f}/{res['as_committed'][1]*100:5.1f}% "
          f"{res['as_committed'][2]}/{res['as_committed'][3]} | cpu {res['cpu'][0]*100:5.1f}/{res['cpu'][1]*100:5.1f}% "
          f"{res['cpu'][2]}/{res['cpu'][3]} | terms {res['terms'][0]*100:5.1f}/{res['terms'][1]*100:5.1f}% "
          f"{res['terms'][2]}/{res['terms'][3]}", flush=True)
if len(tags) > 1:
    (Path(__file__).with_name("forms.json")).write_text(json.dumps(out, indent=1) + "\n")
